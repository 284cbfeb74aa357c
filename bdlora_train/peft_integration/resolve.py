"""A PEFT config -> exactly the targets it adapts in a model (arch/targets.py), with PEFT's own filters applied.

What PEFT decides about a target list is read from PEFT itself, never re-implemented: which modules
`exclude_modules` / `layers_to_transform` keep (`check_target_module_exists`), which rank and alpha a module gets
(`rank_pattern` / `alpha_pattern` via PEFT's `get_pattern_key`), and whether PEFT's transformers-v5 MoE conversion
would rewrite the resolved names (patterns.check_peft_conversion).
"""

from __future__ import annotations

import copy

from torch import nn

from bdlora_train.arch.targets import Request, Target, expert_mode, resolve_targets
from bdlora_train.models.tiny import probe_model
from bdlora_train.peft_integration.patterns import check_peft_conversion


def peft_keeps(config, name: str) -> bool:
    """Whether PEFT's exclude_modules / layers_to_transform keep `name` (asked as if it were targeted by name)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    probe = copy.copy(config)
    probe.target_modules = {name}
    return bool(check_target_module_exists(probe, name))


def peft_targets(model: nn.Module, config) -> list[str]:
    """The module names a stock LoraConfig's `target_modules` adapt in `model`, as PEFT matches them."""
    from peft.tuners.tuners_utils import check_target_module_exists

    names = [n for n, _ in model.named_modules() if n and ".lora_" not in n and not n.endswith(".base_layer")]
    return [name for name in names if check_target_module_exists(config, name)]


def _pattern_value(pattern: dict | None, name: str, default):
    if not pattern:
        return default
    from peft.utils.other import get_pattern_key

    return pattern.get(get_pattern_key(pattern.keys(), name), default)


def rank_for(config, name: str) -> int:
    """The rank PEFT gives module `name`: `rank_pattern` (PEFT's own pattern lookup) or `r`."""
    return _pattern_value(getattr(config, "rank_pattern", None), name, config.r)


def alpha_for(config, name: str) -> float:
    """The lora_alpha PEFT gives module `name`: `alpha_pattern` or `lora_alpha`."""
    return _pattern_value(getattr(config, "alpha_pattern", None), name, config.lora_alpha)


def resolve(model: nn.Module, config, nblocks: int, roles=None, experts="tp") -> dict[str, Target]:
    """Every module / expert parameter the LoRA `config` asks for in `model`, with its TP layout at `nblocks`,
    after every alignment check and PEFT's conversion check. Works on meta-device models."""
    request = Request(
        target_modules=config.target_modules,
        target_parameters=tuple(getattr(config, "target_parameters", None) or ()),
        rank_of=lambda name: rank_for(config, name),
        keeps=lambda name: peft_keeps(config, name),
        roles=roles,
        experts=expert_mode(experts),
    )
    targets = resolve_targets(model, request, nblocks, probe_model=probe_model)
    if getattr(model, "config", None) is not None:
        linears = [n for n, t in targets.items() if t.kind == "linear"]
        params = [n for n, t in targets.items() if t.kind == "expert"]
        check_peft_conversion(model, linears, params)
    return targets


def resolve_roles(model: nn.Module, peft_config, nblocks: int, overrides=None, experts="tp") -> dict[str, str]:
    """Role of every module (and expert parameter) `peft_config` targets in `model`, after every alignment check."""
    return {name: t.role for name, t in resolve(model, peft_config, nblocks, overrides, experts).items()}
