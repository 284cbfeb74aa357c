"""Adapter parameter counts and rank matching, so BD-LoRA and LoRA are compared at equal budgets.

Per module (d_in -> d_out, rank r, N blocks):  LoRA r(d_in + d_out);  block-diagonal B r(d_in + d_out/N);
block-diagonal A r(d_in/N + d_out); an expert parameter counts that once per expert. Counts read shapes only, so
they work on meta-device models. A block-diagonal factor stored densely (segment-aware blocks, expert factors:
see peft_integration/storage.py) counts its free parameters; its explicit zeros are in
`adapter_layout(...)[name]["stored"]`.
The LoRA side of a comparison adapts exactly the modules and expert parameters BD-LoRA resolves (on Phi-3 the
fused qkv_proj / gate_up_proj, on Mixtral the experts), so both budgets cover the same layers.
"""

from __future__ import annotations

import math

from peft import LoraConfig

from bdlora_train.core.degrees import divides
from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.core.layout import expert_dims, is_transposed
from bdlora_train.core.naming import canonical, matches_any, matches_name, unwrap
from bdlora_train.core.roles import DEFAULT_TARGET_MODULES, module_params
from bdlora_train.peft_integration.config import BlockDiagLoraConfig
from bdlora_train.peft_integration.patterns import bdlora_nblocks, compact_names, stock_roles
from bdlora_train.peft_integration.resolve import peft_targets, rank_for, resolve

MATCH_MODES = ("below", "nearest", "above")


def adapter_layout(model, peft_config) -> dict[str, dict]:
    """{module or expert parameter: {role, d_in, d_out, r, nblocks, experts, params, stored}} for a
    BlockDiagLoraConfig or any stock LoraConfig (with target_parameters for expert parameters)."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    layout = {}
    if isinstance(peft_config, BlockDiagLoraConfig):
        targets = resolve(model, peft_config, peft_config.nblocks, peft_config.roles, peft_config.experts)
        for name, t in targets.items():
            layout[name] = dict(
                role=t.role,
                d_in=t.layout.d_in,
                d_out=t.layout.d_out,
                r=t.r,
                nblocks=t.nblocks,
                experts=t.layout.experts,
                segments=list(t.layout.segments),
                storage=t.storage,
                params=t.params,
                stored=t.stored,
            )
        return layout
    names = peft_targets(model, peft_config)
    bd = peft_config.use_bdlora
    nblocks = bdlora_nblocks(bd)
    roles = stock_roles(names, bd) if bd else dict.fromkeys(names)
    for name, role in roles.items():
        base = unwrap(model.get_submodule(name))
        r = rank_for(peft_config, name)
        d_in, d_out = base.in_features, base.out_features
        params = module_params(role, d_in, d_out, r, nblocks)
        layout[name] = dict(
            role=role,
            d_in=d_in,
            d_out=d_out,
            r=r,
            nblocks=nblocks if role else 1,
            experts=0,
            params=params,
            stored=params,
        )
    for key, (d_in, d_out, experts) in _target_parameters(model, peft_config).items():
        r = rank_for(peft_config, key)
        params = experts * module_params(None, d_in, d_out, r)
        layout[key] = dict(
            role=None, d_in=d_in, d_out=d_out, r=r, nblocks=1, experts=experts, params=params, stored=params
        )
    return layout


def _target_parameters(model, peft_config) -> dict[str, tuple[int, int, int]]:
    """Expert parameters a stock LoraConfig's target_parameters adapt: {key: (d_in, d_out, experts)} as PEFT's
    ParamWrapper reads a 3-D parameter (E, d1, d2): in d2, out d1 unless the module says is_transposed."""
    wanted = list(getattr(peft_config, "target_parameters", None) or [])
    out = {}
    for mname, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            key = canonical(f"{mname}.{pname}")
            if param.ndim != 3 or not matches_any(key, wanted):
                continue
            experts, d_in, d_out = expert_dims(param.shape, is_transposed(module))
            out[key] = (d_in, d_out, experts)
    return out


def count_adapter_params(model, peft_config) -> int:
    """Trainable adapter parameters `get_peft_model(model, peft_config)` creates (free ones: a densely stored
    block-diagonal factor's explicit zeros never train and are not counted), plus modules_to_save."""
    total = sum(entry["params"] for entry in adapter_layout(model, peft_config).values())
    for name in peft_config.modules_to_save or []:
        total += sum(
            p.numel() for n, m in model.named_modules() if matches_name(n, name) for p in m.parameters()
        )
    return total


def lora_baseline(model, lora_rank: int, nblocks: int, target_modules=None, experts="tp") -> LoraConfig:
    """Plain LoRA at `lora_rank` on exactly the modules / expert parameters BD-LoRA resolves for these targets."""
    targets = list(target_modules or DEFAULT_TARGET_MODULES)
    probe = BlockDiagLoraConfig(r=nblocks, nblocks=nblocks, target_modules=targets, experts=experts)
    resolved = resolve(model, probe, nblocks, None, probe.experts)
    linears = [n for n, t in resolved.items() if t.kind == "linear"]
    params = [n for n, t in resolved.items() if t.kind == "expert"]
    universe = {canonical(n) for n, _ in model.named_modules() if n}
    return LoraConfig(
        r=lora_rank,
        target_modules=compact_names(linears, universe) if linears else [],
        target_parameters=sorted(params) or None,
    )


def match_budget(model, lora_rank: int, nblocks: int, mode: str = "below", target_modules=None, experts="tp") -> int:
    """The BD-LoRA rank (a multiple of nblocks) whose parameter count is closest to LoRA at `lora_rank`.

    mode "below": the largest rank with at most LoRA's parameters; "above": the smallest with at least as
    many; "nearest": whichever of the two is closer.
    """
    if mode not in MATCH_MODES:
        raise BlockDiagLoraConfigError(f"match_budget: mode={mode!r}; use one of {MATCH_MODES}")
    targets = list(target_modules or DEFAULT_TARGET_MODULES)
    probe = BlockDiagLoraConfig(r=nblocks, nblocks=nblocks, target_modules=targets, experts=experts)
    return matched_rank(resolve(model, probe, nblocks, None, probe.experts), lora_rank, nblocks, mode)


def lora_params(targets: dict, lora_rank: int) -> int:
    """Parameters of plain LoRA at `lora_rank` on exactly these resolved targets (`resolve`'s Targets): the LoRA
    side of a matched budget (what `count_adapter_params(model, lora_baseline(...))` counts, without PEFT)."""
    return sum(
        module_params(None, t.layout.d_in, t.layout.d_out, lora_rank) * max(t.layout.experts, 1)
        for t in targets.values()
    )


def matched_rank(targets: dict, lora_rank: int, nblocks: int, mode: str = "below") -> int:
    """`match_budget` on targets resolved already (at any rank): the BD-LoRA rank, a multiple of nblocks, closest
    to LoRA at `lora_rank` on the same targets."""
    if mode not in MATCH_MODES:
        raise BlockDiagLoraConfigError(f"match_budget: mode={mode!r}; use one of {MATCH_MODES}")
    lora = lora_params(targets, lora_rank)
    per_block_rank = sum(
        module_params(t.role, t.layout.d_in, t.layout.d_out, nblocks, t.nblocks) * max(t.layout.experts, 1)
        for t in targets.values()
    )
    low = max(1, math.floor(lora / per_block_rank)) * nblocks
    high = math.ceil(lora / per_block_rank) * nblocks
    if mode == "below":
        if per_block_rank > lora:
            raise BlockDiagLoraConfigError(
                f"match_budget: even BD-LoRA r={nblocks} (the smallest rank at nblocks={nblocks}) has "
                f"{per_block_rank:,} params, more than LoRA r={lora_rank}'s {lora:,}; match a larger LoRA rank"
            )
        return low
    if mode == "above":
        return high
    return low if abs(lora - per_block_rank * low // nblocks) <= abs(per_block_rank * high // nblocks - lora) else high


def budget_plan(model, lora_ranks, nblocks: int, target_modules=None, experts="tp") -> list[dict]:
    """Per LoRA rank: LoRA, BD-LoRA at the matched rank (largest at most LoRA's params) and at twice it.

    [{lora_rank, lora: {method, r, nblocks, params, ratio}, matched: {...}, double: {...}}], exact counts.
    """
    targets = list(target_modules or DEFAULT_TARGET_MODULES)
    plan = []
    for lora_rank in lora_ranks:
        lora = count_adapter_params(model, lora_baseline(model, lora_rank, nblocks, targets, experts))
        matched = match_budget(model, lora_rank, nblocks, mode="below", target_modules=targets, experts=experts)
        entry = {"lora_rank": lora_rank, "lora": dict(method="lora", r=lora_rank, nblocks=1, params=lora, ratio=1.0)}
        for budget, r in (("matched", matched), ("double", 2 * matched)):
            params = bdlora_params(model, r, nblocks, targets, experts)
            entry[budget] = dict(method="bdlora", r=r, nblocks=nblocks, params=params, ratio=params / lora)
        plan.append(entry)
    return plan


def bdlora_params(model, r: int, nblocks: int, targets, experts="tp") -> int:
    config = BlockDiagLoraConfig(r=r, nblocks=nblocks, target_modules=list(targets), experts=experts)
    return count_adapter_params(model, config)


def budget_table(model, lora_ranks, nblocks: int, target_modules=None, experts="tp") -> list[dict]:
    """Rows: LoRA at each rank; BD-LoRA at the matched rank, twice it, and the paper's 2x and 4x LoRA ranks."""
    rows = []
    for entry in budget_plan(model, lora_ranks, nblocks, target_modules, experts):
        lora_rank, lora = entry["lora_rank"], entry["lora"]["params"]
        rows.append(
            dict(lora_rank=lora_rank, method="lora", r=lora_rank, nblocks=1, params=lora, ratio=1.0, label="LoRA")
        )
        matched = entry["matched"]["r"]
        labels: dict[int, list[str]] = {matched: ["matched"], 2 * matched: ["2x matched"]}
        for factor in (2, 4):
            if divides(nblocks, factor * lora_rank):
                labels.setdefault(factor * lora_rank, []).append(f"paper {factor}x rank")
        for r in sorted(labels):
            params = bdlora_params(model, r, nblocks, target_modules or DEFAULT_TARGET_MODULES, experts)
            rows.append(
                dict(
                    lora_rank=lora_rank,
                    method="bdlora",
                    r=r,
                    nblocks=nblocks,
                    params=params,
                    ratio=round(params / lora, 4),
                    label=", ".join(labels[r]),
                )
            )
    return rows


def experts_note(model, nblocks: int, target_modules=None, experts="tp") -> str | None:
    """One line on how expert parameters are adapted (None for a model without adapted experts)."""
    config = BlockDiagLoraConfig(
        r=nblocks, nblocks=nblocks, target_modules=list(target_modules or DEFAULT_TARGET_MODULES), experts=experts
    )
    if config.experts == "none":
        has = any(p.ndim == 3 for p in model.parameters())
        return "experts: not adapted (--experts none)" if has else None
    layout = adapter_layout(model, config)
    kinds = sorted(
        {name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1] for name, e in layout.items() if e["experts"]}
    )
    if not kinds:
        return None
    count = max(e["experts"] for e in layout.values())
    if config.experts == "ep":
        return (
            f"experts: expert parallelism (whole experts per rank) - {kinds} x {count} experts take nblocks 1 "
            "(dense per-expert factors); attention and dense layers keep nblocks " + str(nblocks)
        )
    return f"experts: TP-sharded - {kinds} x {count} experts, block-diagonal per expert (nblocks {nblocks})"
