"""Module-name rules, each in one place: how a target name matches, how PEFT assigns BD-LoRA roles, wrapper levels.

Two matching rules exist in PEFT and both are needed:
  * target lists (`target_modules`, `target_parameters`): an entry matches a module whose full name equals it or
    ends with "." + entry (`matches_name`);
  * BD-LoRA role patterns (`use_bdlora.target_modules_bd_a/_bd_b`): a *substring* test on the full module name
    (`peft/tuners/lora/variants.py`, `BdLoraLinearVariant.init`), so "up_proj" also claims "gate_up_proj"
    (`substring_role`).
"""

from __future__ import annotations

from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.core.roles import BD_A, BD_B, Role

# transformers' text-only model type of a family whose config nests a text config (Llama-4).
_FAMILY_ALIASES = {"llama4_text": "llama4"}


def matches_name(name: str, pattern: str) -> bool:
    """PEFT's list semantics for target names: the full name, or a dotted suffix of it (never a substring)."""
    return name == pattern or name.endswith("." + pattern)


def matches_any(name: str, patterns) -> bool:
    return any(matches_name(name, pattern) for pattern in patterns)


def substring_role(name: str, bd_a, bd_b) -> Role | None:
    """The role PEFT gives module `name` under `use_bdlora` patterns: a substring test of each pattern."""
    in_a = any(pattern in name for pattern in bd_a or ())
    in_b = any(pattern in name for pattern in bd_b or ())
    if in_a and in_b:
        raise BlockDiagLoraConfigError(
            f"{name}: matched by both target_modules_bd_a and target_modules_bd_b; make the patterns disjoint "
            "(stock PEFT refuses this adapter too)"
        )
    return BD_A if in_a else BD_B if in_b else None


def canonical(name: str) -> str:
    """A module/parameter name with PEFT's wrapper levels (`.base_layer`) removed."""
    return name.replace(".base_layer", "")


def relative(name: str, prefix: str) -> str | None:
    """`name` relative to the module named `prefix`, or None when it lies outside it ("" prefix: the model)."""
    if not prefix:
        return name
    return name[len(prefix) + 1 :] if name.startswith(prefix + ".") else None


def layer_kind(relative_name: str) -> str:
    """`layers.3.self_attn.q_proj` -> `layers.*.self_attn.q_proj`."""
    return ".".join("*" if part.isdigit() else part for part in relative_name.split("."))


def family_name(model_type: str | None) -> str | None:
    """The family a model type belongs to (`llama4_text` -> `llama4`)."""
    return _FAMILY_ALIASES.get(model_type, model_type)


def unwrap(module):
    """The module under every adapter wrapper (PEFT's `get_base_layer`, nested ParamWrappers included)."""
    while hasattr(module, "get_base_layer"):
        base = module.get_base_layer()
        if base is module:
            break
        module = base
    return module
