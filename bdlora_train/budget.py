"""Adapter parameter counts and rank matching, so BD-LoRA and LoRA are compared at equal budgets.

Per module (d_in -> d_out, rank r, N blocks):  LoRA r(d_in + d_out);  block-diagonal B r(d_in + d_out/N);
block-diagonal A r(d_in/N + d_out). Counts read shapes only, so they work on meta-device models.
"""

from __future__ import annotations

import math

from peft import LoraConfig

from bdlora_train.config import BlockDiagLoraConfig
from bdlora_train.errors import BlockDiagLoraError
from bdlora_train.patterns import BD_A, BD_B, bdlora_nblocks, stock_roles
from bdlora_train.roles import DEFAULT_TARGET_MODULES, rank_for, resolve_roles

MODES = ("below", "nearest", "above")


def module_params(role: str | None, d_in: int, d_out: int, r: int, nblocks: int = 1) -> int:
    if role == BD_B:
        return r * d_in + r * d_out // nblocks
    if role == BD_A:
        return r * d_in // nblocks + r * d_out
    return r * (d_in + d_out)


def adapter_layout(model, peft_config) -> dict[str, dict]:
    """{module: {role, d_in, d_out, r, nblocks, params}} for a BlockDiagLoraConfig or any stock LoraConfig."""
    from peft.tuners.tuners_utils import check_target_module_exists

    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    if isinstance(peft_config, BlockDiagLoraConfig):
        roles = resolve_roles(model, peft_config, peft_config.nblocks, peft_config.roles)
        nblocks = peft_config.nblocks
    else:
        names = [
            n
            for n, _ in model.named_modules()
            if n and ".lora_" not in n and not n.endswith(".base_layer") and check_target_module_exists(peft_config, n)
        ]
        bd = peft_config.use_bdlora
        nblocks = bdlora_nblocks(bd)
        roles = stock_roles(names, bd) if bd else dict.fromkeys(names)
    layout = {}
    for name, role in roles.items():
        module = model.get_submodule(name)
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        r = rank_for(peft_config, name)
        d_in, d_out = base.in_features, base.out_features
        layout[name] = dict(
            role=role,
            d_in=d_in,
            d_out=d_out,
            r=r,
            nblocks=nblocks if role else 1,
            params=module_params(role, d_in, d_out, r, nblocks),
        )
    return layout


def count_adapter_params(model, peft_config) -> int:
    """Exact number of trainable adapter parameters `get_peft_model(model, peft_config)` would create."""
    total = sum(entry["params"] for entry in adapter_layout(model, peft_config).values())
    for name in peft_config.modules_to_save or []:
        total += sum(
            p.numel() for n, m in model.named_modules() if n == name or n.endswith("." + name) for p in m.parameters()
        )
    return total


def match_budget(model, lora_rank: int, nblocks: int, mode: str = "below", target_modules=None) -> int:
    """The BD-LoRA rank (a multiple of nblocks) whose parameter count is closest to LoRA at `lora_rank`.

    mode "below": the largest rank with at most LoRA's parameters; "above": the smallest with at least as
    many; "nearest": whichever of the two is closer.
    """
    if mode not in MODES:
        raise BlockDiagLoraError(f"match_budget: mode={mode!r}; use one of {MODES}")
    targets = list(target_modules or DEFAULT_TARGET_MODULES)
    lora = count_adapter_params(model, LoraConfig(r=lora_rank, target_modules=targets))
    per_block_rank = count_adapter_params(
        model, BlockDiagLoraConfig(r=nblocks, nblocks=nblocks, target_modules=targets)
    )
    low = max(1, math.floor(lora / per_block_rank)) * nblocks
    high = math.ceil(lora / per_block_rank) * nblocks
    if mode == "below":
        if per_block_rank > lora:
            raise BlockDiagLoraError(
                f"match_budget: even BD-LoRA r={nblocks} (the smallest rank at nblocks={nblocks}) has "
                f"{per_block_rank:,} params, more than LoRA r={lora_rank}'s {lora:,}; match a larger LoRA rank"
            )
        return low
    if mode == "above":
        return high
    return low if abs(lora - per_block_rank * low // nblocks) <= abs(per_block_rank * high // nblocks - lora) else high


def budget_plan(model, lora_ranks, nblocks: int, target_modules=None) -> list[dict]:
    """Per LoRA rank: LoRA, BD-LoRA at the matched rank (largest at most LoRA's params) and at twice it.

    [{lora_rank, lora: {method, r, nblocks, params, ratio}, matched: {...}, double: {...}}], exact counts.
    """
    targets = list(target_modules or DEFAULT_TARGET_MODULES)
    plan = []
    for lora_rank in lora_ranks:
        lora = count_adapter_params(model, LoraConfig(r=lora_rank, target_modules=targets))
        matched = match_budget(model, lora_rank, nblocks, mode="below", target_modules=targets)
        entry = {"lora_rank": lora_rank, "lora": dict(method="lora", r=lora_rank, nblocks=1, params=lora, ratio=1.0)}
        for budget, r in (("matched", matched), ("double", 2 * matched)):
            params = bdlora_params(model, r, nblocks, targets)
            entry[budget] = dict(method="bdlora", r=r, nblocks=nblocks, params=params, ratio=params / lora)
        plan.append(entry)
    return plan


def bdlora_params(model, r: int, nblocks: int, targets) -> int:
    return count_adapter_params(model, BlockDiagLoraConfig(r=r, nblocks=nblocks, target_modules=list(targets)))


def budget_table(model, lora_ranks, nblocks: int, target_modules=None) -> list[dict]:
    """Rows: LoRA at each rank; BD-LoRA at the matched rank, twice it, and the paper's 2x and 4x LoRA ranks."""
    rows = []
    for entry in budget_plan(model, lora_ranks, nblocks, target_modules):
        lora_rank, lora = entry["lora_rank"], entry["lora"]["params"]
        rows.append(
            dict(lora_rank=lora_rank, method="lora", r=lora_rank, nblocks=1, params=lora, ratio=1.0, label="LoRA")
        )
        matched = entry["matched"]["r"]
        labels: dict[int, list[str]] = {matched: ["matched"], 2 * matched: ["2x matched"]}
        for factor in (2, 4):
            if factor * lora_rank % nblocks == 0:
                labels.setdefault(factor * lora_rank, []).append(f"paper {factor}x rank")
        for r in sorted(labels):
            params = bdlora_params(model, r, nblocks, target_modules or DEFAULT_TARGET_MODULES)
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
