"""`bdlora budget`: LoRA vs BD-LoRA parameter budgets for a model, offline (meta device, no weights)."""

from __future__ import annotations

import argparse
import json

from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.core.helptext import DefaultsHelpFormatter


def format_table(rows: list[dict], model_name: str) -> str:
    lines = [
        f"Adapter budgets for {model_name}",
        "",
        "| method | label | r | nblocks | params | x LoRA |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['label']} | {row['r']} | {row['nblocks']} | {row['params']:,} | "
            f"{row['ratio']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter, prog="bdlora budget", description="LoRA vs BD-LoRA parameter budgets."
    )
    parser.add_argument("--model", default="embedded", help="embedded | tiny:<type> | dir | config.json | hub id")
    parser.add_argument(
        "--lora-ranks",
        "--lora-rank",
        dest="lora_ranks",
        type=int,
        nargs="+",
        default=[16],
        help="LoRA rank(s) to match",
    )
    parser.add_argument(
        "--nblocks",
        type=int,
        default=None,
        help="number of blocks = TP degree (default: the largest <= 8 that divides the heads and KV heads)",
    )
    parser.add_argument("--target-modules", nargs="+", default=None, help="default: the 7 attention/MLP projections")
    parser.add_argument(
        "--experts",
        choices=("tp", "ep", "none"),
        default="tp",
        help="MoE experts: tp (TP-sharded, block-diagonal per expert), ep (expert parallelism: nblocks 1), none",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    from bdlora_train.budget import budget_table, experts_note  # after parsing: `--help` loads no torch
    from bdlora_train.core.heads import choose_nblocks
    from bdlora_train.models import load_config, meta_model

    if any(r < 1 for r in args.lora_ranks) or (args.nblocks is not None and args.nblocks < 1):
        raise BlockDiagLoraConfigError(
            f"budget: --lora-ranks {args.lora_ranks} and --nblocks {args.nblocks} must be >= 1"
        )
    config = load_config(args.model)
    nblocks = choose_nblocks(config, args.nblocks)  # no TP degree here: explicit, else the heads' default
    model = meta_model(config)
    rows = budget_table(model, args.lora_ranks, nblocks, args.target_modules, args.experts)
    note = experts_note(model, nblocks, args.target_modules, args.experts)
    if args.json:
        print(json.dumps({"model": args.model, "nblocks": nblocks, "experts": note, "rows": rows}, indent=2))
    else:
        print(format_table(rows, f"{args.model} (nblocks={nblocks})"))
        if note:
            print(f"\n{note}")
    return 0
