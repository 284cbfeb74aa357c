"""`bdlora tp-check` and `bdlora bench-tp`: shard an adapter over N ranks, count collectives, time the forward."""

from __future__ import annotations

import argparse
import json

from bdlora_train.core.errors import TPError
from bdlora_train.core.files import atomic_write_text
from bdlora_train.tp import TOLERANCE, bench_tp, tp_check


def format_check(result: dict) -> str:
    lines = [
        f"model {result['model']}  adapter {result['adapter']}  nblocks {result['nblocks']}  r {result['r']}  "
        f"world size {result['world_size']}  tokens {result['tokens']} x 2",
        "",
        "| sharding | collectives / forward | bytes / forward | ops | rel. err vs unsharded |",
        "|---|---:|---:|---|---:|",
    ]
    for mode, label in (("base", "base model"), ("bdlora", "BD-LoRA"), ("slora", "S-LoRA")):
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(result[f"{mode}_ops"].items())) or "-"
        lines.append(
            f"| {label} | {result[f'{mode}_collectives']} | {result[f'{mode}_bytes']:,} | {ops} | "
            f"{result[f'{mode}_rel_err']:.2e} |"
        )
    verdict = "OK" if result["ok"] else "FAILED"
    if result.get("experts"):
        lines += ["", f"experts: {result['experts']}"]
    lines += [
        "",
        f"{verdict}: BD-LoRA adds {result['bdlora_collectives'] - result['base_collectives']} collectives, "
        f"S-LoRA adds {result['slora_collectives'] - result['base_collectives']}; "
        f"max rel. err {result['max_rel_err']:.2e} (tolerance {TOLERANCE:g}); "
        f"adapter changes the logits by {result['adapter_effect']:.2e}",
    ]
    return "\n".join(lines)


def check_main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="bdlora tp-check",
        description="Shard a BD-LoRA adapter over N gloo ranks, "
        "compare with the unsharded PEFT model and count collectives (base, BD-LoRA, S-LoRA).",
    )
    parser.add_argument(
        "adapter", nargs="?", help="adapter directory; omitted: a tiny random Llama with a random BD-LoRA adapter"
    )
    parser.add_argument("--tp", type=int, required=True, help="number of ranks (TP degree)")
    parser.add_argument(
        "--model",
        "--base",
        dest="base",
        help="base model spec (default: the adapter's base_model_name_or_path, or tiny:llama)",
    )
    parser.add_argument("--tokens", type=int, default=16, help="tokens per sequence (batch of 2)")
    _add_device(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        raise TPError(f"tp-check: --tokens {args.tokens}; use a positive count")
    result = tp_check(args.adapter, args.tp, args.base, args.tokens, device=args.device)[0]
    print(json.dumps(result, indent=2) if args.json else format_check(result))
    return 0 if result["ok"] else 1


def format_bench(result: dict) -> str:
    lines = [
        f"bench-tp: {result['model']}  world size {result['world_size']}  r {result['r']}  "
        f"{result['threads_per_rank']} thread(s) per rank  median of {result['repeats']}  torch {result['torch']}  "
        f"{result['cpu_count']} CPUs, load average {result['load_average']}",
        "",
        "| tokens | base ms | BD-LoRA ms | BD-LoRA / base | S-LoRA ms | S-LoRA / base | min ms base / BD / S "
        "| CPU ms base / BD / S | CPU BD / base | CPU S / base | collectives base / BD / S |",
        "|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['tokens']} | {row['base_ms']:.2f} | {row['bdlora_ms']:.2f} | {row['bdlora_ratio']:.3f} | "
            f"{row['slora_ms']:.2f} | {row['slora_ratio']:.3f} | {row['base_min_ms']:.1f} / "
            f"{row['bdlora_min_ms']:.1f} / "
            f"{row['slora_min_ms']:.1f} | {row['base_cpu_ms']:.1f} / {row['bdlora_cpu_ms']:.1f} / "
            f"{row['slora_cpu_ms']:.1f} | "
            f"{row['bdlora_cpu_ratio']:.3f} | {row['slora_cpu_ratio']:.3f} | "
            f"{row['base_collectives']} / {row['bdlora_collectives']} / {row['slora_collectives']} |"
        )
    return "\n".join(lines)


def bench_main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="bdlora bench-tp",
        description="TP forward latency: base vs BD-LoRA vs S-LoRA sharding, medians and ratios to base.",
    )
    parser.add_argument("--tp", type=int, default=2, help="number of ranks (TP degree)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 256, 2048], help="token counts (batch 1)")
    parser.add_argument(
        "--model",
        "--base",
        dest="base",
        default="bench",
        help="'bench' (random Llama, hidden 1024, MLP 2816, 4 layers) or a model spec",
    )
    parser.add_argument("--rank", type=int, default=16, help="adapter rank r (a multiple of --tp)")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per mode and token count")
    _add_device(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--out", help="also write the JSON result to this file (atomically)")
    args = parser.parse_args(argv)
    if args.rank % args.tp:
        raise TPError(f"bench-tp: --rank {args.rank} is not a multiple of --tp {args.tp}")
    result = bench_tp(args.tp, args.tokens, args.base, args.rank, args.repeats, device=args.device)
    print(json.dumps(result, indent=2) if args.json else format_bench(result))
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
    return 0


def _add_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu: gloo ranks (default); cuda: NCCL, one GPU per rank (not yet run on GPUs)",
    )
