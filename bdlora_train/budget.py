"""Adapter parameter counts and rank matching, so BD-LoRA and LoRA are compared at equal budgets.

Per module (d_in -> d_out, rank r, N blocks):  LoRA r(d_in + d_out);  block-diagonal B r(d_in + d_out/N);
block-diagonal A r(d_in/N + d_out). Counts read shapes only, so they work on meta-device models.
"""

from __future__ import annotations

import argparse
import json
import math

from peft import LoraConfig

from bdlora_train.config import BlockDiagLoraConfig
from bdlora_train.roles import BD_A, BD_B, DEFAULT_TARGET_MODULES, BlockDiagLoraError, resolve_roles, stock_roles

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
    from peft.utils.other import get_pattern_key

    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    if isinstance(peft_config, BlockDiagLoraConfig):
        roles = resolve_roles(model, peft_config, peft_config.nblocks, peft_config.roles)
        nblocks = peft_config.nblocks
    else:
        names = [
            n for n, _ in model.named_modules()
            if n and ".lora_" not in n and not n.endswith(".base_layer") and check_target_module_exists(peft_config, n)
        ]
        bd = peft_config.use_bdlora
        nblocks = (bd["nblocks"] if isinstance(bd, dict) else bd.nblocks) if bd else 1
        roles = stock_roles(names, bd) if bd else dict.fromkeys(names)
    layout = {}
    rank_pattern = peft_config.rank_pattern or {}
    for name, role in roles.items():
        module = model.get_submodule(name)
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), name), peft_config.r) if rank_pattern else peft_config.r
        d_in, d_out = base.in_features, base.out_features
        layout[name] = dict(role=role, d_in=d_in, d_out=d_out, r=r, nblocks=nblocks if role else 1,
                            params=module_params(role, d_in, d_out, r, nblocks))
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
    per_block_rank = count_adapter_params(model, BlockDiagLoraConfig(r=nblocks, nblocks=nblocks, target_modules=targets))
    low = max(1, math.floor(lora / per_block_rank)) * nblocks
    high = math.ceil(lora / per_block_rank) * nblocks
    if mode == "below":
        if per_block_rank > lora:
            raise BlockDiagLoraError(
                f"match_budget: even r={nblocks} has {per_block_rank} params > LoRA r={lora_rank}'s {lora}; use mode='above'"
            )
        return low
    if mode == "above":
        return high
    return low if abs(lora - per_block_rank * low // nblocks) <= abs(per_block_rank * high // nblocks - lora) else high


def budget_table(model, lora_ranks, nblocks: int, target_modules=None) -> list[dict]:
    """Rows: LoRA at each rank; BD-LoRA at the matched rank, twice it, and the paper's 2x and 4x LoRA ranks."""
    targets = list(target_modules or DEFAULT_TARGET_MODULES)
    rows = []
    for lora_rank in lora_ranks:
        lora = count_adapter_params(model, LoraConfig(r=lora_rank, target_modules=targets))
        rows.append(dict(lora_rank=lora_rank, method="lora", r=lora_rank, nblocks=1, params=lora, ratio=1.0, label="LoRA"))
        matched = match_budget(model, lora_rank, nblocks, "below", targets)
        labels: dict[int, list[str]] = {matched: ["matched"], 2 * matched: ["2x matched"]}
        for factor in (2, 4):
            if factor * lora_rank % nblocks == 0:
                labels.setdefault(factor * lora_rank, []).append(f"paper {factor}x rank")
        for r in sorted(labels):
            params = count_adapter_params(model, BlockDiagLoraConfig(r=r, nblocks=nblocks, target_modules=targets))
            rows.append(dict(lora_rank=lora_rank, method="bdlora", r=r, nblocks=nblocks, params=params,
                             ratio=round(params / lora, 4), label=", ".join(labels[r])))
    return rows


def format_table(rows: list[dict], model_name: str) -> str:
    lines = [f"Adapter budgets for {model_name}", "", "| method | label | r | nblocks | params | x LoRA |", "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['label']} | {row['r']} | {row['nblocks']} | {row['params']:,} | {row['ratio']:.2f} |"
        )
    return "\n".join(lines)


def cli(argv=None) -> int:
    from bdlora_train.models import load_config, meta_model

    parser = argparse.ArgumentParser(prog="bdlora budget", description="LoRA vs BD-LoRA parameter budgets.")
    parser.add_argument("--model", default="embedded", help="embedded | tiny:<type> | dir | config.json | hub id")
    parser.add_argument("--lora-rank", type=int, nargs="+", default=[16], help="LoRA rank(s) to match")
    parser.add_argument("--nblocks", type=int, default=None, help="number of blocks = TP degree (default: 3 for embedded, else 8)")
    parser.add_argument("--target-modules", nargs="+", default=None, help="default: the 7 attention/MLP projections")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    nblocks = args.nblocks or (3 if args.model == "embedded" else 8)
    model = meta_model(load_config(args.model))
    rows = budget_table(model, args.lora_rank, nblocks, args.target_modules)
    if args.json:
        print(json.dumps({"model": args.model, "nblocks": nblocks, "rows": rows}, indent=2))
    else:
        print(format_table(rows, f"{args.model} (nblocks={nblocks})"))
    return 0
