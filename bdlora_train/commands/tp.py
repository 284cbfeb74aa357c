"""`bdlora tp-check` and `bdlora bench-tp`: shard an adapter over N ranks, count collectives, time the forward."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from bdlora_train.core.degrees import check_rank
from bdlora_train.core.errors import TPError
from bdlora_train.core.files import atomic_write_text
from bdlora_train.core.helptext import DefaultsHelpFormatter


def format_check(result: dict) -> str:
    from bdlora_train.tp_diagnostics import (
        TOLERANCE,  # imports torch: only once there is a result, so `--help` stays fast
    )

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


def format_train_check(result: dict) -> str:
    lines = [
        f"model {result['model']}  world size {result['world_size']}"
        + (f" (experts by expert parallelism, ep_size {result['ep_size']})" if result.get("ep_size", 1) > 1 else "")
        + "  one training step (forward + backward), "
        f"batch {result['batch']} x {result['tokens']} tokens  "
        f"BD-LoRA r {result['r_bd']} (nblocks {result['nblocks']}) vs LoRA r {result['r_lora']}",
        "",
        "| mode | adapter params | collectives / step | bytes / step | extra over the frozen base | "
        "gradient rel. err vs unsharded | optimizer step collectives |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    labels = (("base", "frozen base"), ("bdlora", "BD-LoRA"), ("lora", "LoRA (PEFT layout)"))
    for mode, label in labels:
        row = result[mode]
        if mode == "base":
            lines.append(f"| {label} | - | {row['collectives']} | {row['bytes']:,} | - | - | - |")
            continue
        lines.append(
            f"| {label} | {row['params']:,} | {row['collectives']} | {row['bytes']:,} | "
            f"{row['extra_collectives']:+d} ({row['extra_bytes']:+,} bytes) | {row['grad_rel_err']:.2e} | "
            f"{row['optimizer']['collectives']} |"
        )
    verdict = "OK" if result["ok"] else "FAILED"
    worst = max(result["bdlora"]["grad_rel_err"], result["lora"]["grad_rel_err"])
    lines += [
        "",
        f"{verdict}: BD-LoRA adds {result['bdlora']['extra_collectives']} collectives per training step, plain LoRA "
        f"{result['lora']['extra_collectives']}; gradients equal the unsharded model's to "
        f"{worst:.1e} (tolerance {result['tolerance']:g})",
    ]
    return "\n".join(lines)


def format_traffic(result: dict) -> str:
    lines = [
        f"{result['model']} at TP {result['tp']}: {result['tokens']} tokens per step, LoRA r {result['r_lora']}, "
        f"BD-LoRA r {result['r_bd']} (nblocks {result['tp']}), {result['layers']} adapted projections"
        + (
            f" ({result['expert_params']} of them expert parameters, {result['experts']} experts each)"
            if result.get("expert_params")
            else ""
        )
        + (
            f"; {result['replicated']} of them whole on every rank (transformers' plan leaves them unsharded): "
            "no traffic"
            if result.get("replicated")
            else ""
        ),
        "",
        "| | collectives / step | bytes / step |",
        "|---|---:|---:|",
    ]
    for key, label in (
        ("base", "frozen base (its own, adapted projections)"),
        ("lora", "LoRA adds"),
        ("bdlora", "BD-LoRA adds"),
    ):
        lines.append(f"| {label} | {result[key]['collectives']:,} | {result[key]['bytes']:,} |")
    return "\n".join(lines)


def check_main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="bdlora tp-check",
        description="Shard a BD-LoRA adapter over N gloo ranks, compare with the unsharded PEFT model and count "
        "collectives (base, BD-LoRA, S-LoRA); with --train, one training step of BD-LoRA and plain LoRA under TP.",
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
    parser.add_argument(
        "--train",
        action="store_true",
        help="a training step (forward + backward) under TP: BD-LoRA vs plain LoRA vs the frozen base, counted, "
        "gradients checked against the unsharded model",
    )
    parser.add_argument("--rank", type=int, default=8, help="--train: LoRA rank; BD-LoRA gets the rank of equal params")
    parser.add_argument(
        "--ep",
        action="store_true",
        help="with --train on a MoE --model: its experts split by whole experts over the --tp ranks (ep_size = tp, "
        "transformers' EP plan), attention by TP",
    )
    parser.add_argument(
        "--traffic",
        action="store_true",
        help="with --train: no ranks, the per-step collectives and bytes worked out from --model's config",
    )
    _add_device(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    from bdlora_train.tp_diagnostics import tp_check  # after parsing: `--help` loads no torch
    from bdlora_train.tp_diagnostics.train_check import train_check, training_traffic

    if args.tokens < 1:
        raise TPError(f"tp-check: --tokens {args.tokens}; use a positive count")
    if args.train:
        if args.adapter:
            raise TPError("tp-check --train: trains a random adapter on --model; drop the adapter argument")
        if args.traffic and args.ep:
            raise TPError("tp-check --train --traffic: works out TP's traffic only; drop --ep")
        if args.traffic:
            result = training_traffic(args.base or "tiny:llama", args.tp, args.rank, args.tokens)
            print(json.dumps(result, indent=2) if args.json else format_traffic(result))
            return 0
        result = train_check(args.tp, args.base or "tiny:llama", args.rank, args.tokens, args.device, args.ep)
        print(json.dumps(result, indent=2) if args.json else format_train_check(result))
        return 0 if result["ok"] else 1
    if args.traffic or args.ep:
        raise TPError(f"tp-check: --{'traffic' if args.traffic else 'ep'} goes with --train")
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
    own_base = ", ".join(f"{row['slora_base_ms']:.2f}" for row in result["rows"])
    lines.append(
        "base: the training runtime's model with its adapter off (BD-LoRA's code path); S-LoRA / base divides by the "
        f"S-LoRA model's own sharded base ({own_base} ms), whose PyTorch TP hooks the runtime's layers do not run"
    )
    caveat = noise_caveat(result, "forwards")
    return "\n".join(lines + ([caveat] if caveat else []))


FEW_REPEATS = 5  # fewer timed runs than this: a median says little
WIDE_SPREAD = 1.25  # a median this many times the fastest run's time: the machine was busy


def noise_caveat(result: dict, what: str) -> str | None:
    """One line under a bench table whose ratios may be noise: too few repeats, or medians far above the minima."""
    repeats = result["repeats"]
    if repeats < FEW_REPEATS:
        return (
            f"caveat: each time is the median of only {repeats} timed {what}, so a ratio can be noise; re-run with "
            f"--repeats {FEW_REPEATS} or more before reading a difference into it"
        )
    spreads = [
        (row[f"{mode}_ms"] / row[f"{mode}_min_ms"], row["tokens"], mode)
        for row in result["rows"]
        for mode in ("base", "bdlora", "slora", "lora")
        if row.get(f"{mode}_min_ms")
    ]
    if spreads and max(spreads)[0] > WIDE_SPREAD:
        worst, tokens, mode = max(spreads)
        return (
            f"caveat: the timings spread widely ({mode} at {tokens} tokens: median {worst:.2f}x its fastest run), so "
            "a ratio can be noise; re-run on an idle machine or with more --repeats"
        )
    return None


def format_train_bench(result: dict) -> str:
    params, floor = result["params"], result["flop_floor"]
    lines = [
        f"bench-tp --train: {result['model']}  world size {result['world_size']}  BD-LoRA r {result['r_bd']} "
        f"({params['bdlora']:,} params) vs LoRA r {result['r_lora']} ({params['lora']:,})  "
        f"{result['dtype']}  lora_dropout {result['lora_dropout']}  {result['threads_per_rank']} thread(s) per rank  "
        f"median (min) of {result['repeats']} "
        "interleaved steps  "
        f"torch {result['torch']}  {result['cpu_count']} CPUs, load average {result['load_average']}",
        f"FLOP floor (1 + the adapter's FLOPs / the base's, per rank, adapted projections): BD-LoRA "
        f"{floor['bdlora']:.3f}, LoRA {floor['lora']:.3f}",
        "",
        "| tokens | base ms | BD-LoRA ms | BD / base | LoRA ms | LoRA / base | BD / LoRA | CPU BD / base | "
        "CPU LoRA / base | peak MiB per rank base / BD / LoRA | collectives base / BD / LoRA | "
        "optimizer ms BD / LoRA, fused (adamw) | with fused optimizer BD / base, LoRA / base |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['tokens']} | {row['base_ms']:.1f} ({row['base_min_ms']:.1f}) | "
            f"{row['bdlora_ms']:.1f} ({row['bdlora_min_ms']:.1f}) | {row['bdlora_ratio']:.3f} | "
            f"{row['lora_ms']:.1f} ({row['lora_min_ms']:.1f}) | {row['lora_ratio']:.3f} | "
            f"{row['bdlora_vs_lora']:.3f} | "
            f"{row['bdlora_cpu_ratio']:.3f} | {row['lora_cpu_ratio']:.3f} | "
            f"{row['base_peak_mib']:.1f} / {row['bdlora_peak_mib']:.1f} / {row['lora_peak_mib']:.1f} | "
            f"{row['base_collectives']} / {row['bdlora_collectives']} / {row['lora_collectives']} | "
            f"{row['bdlora_fused_ms']:.1f} / {row['lora_fused_ms']:.1f} "
            f"({row['bdlora_adamw_ms']:.1f} / {row['lora_adamw_ms']:.1f}) | "
            f"{row['bdlora_fused_step_ratio']:.3f}, {row['lora_fused_step_ratio']:.3f} |"
        )
    lines += [
        "",
        "optimizer: gradient clipping to norm 1 and one AdamW step after each adapter's backward (not in the step "
        "times); fused = optim adamw_torch_fused, adamw = optim adamw_torch (torch's pick: foreach on CUDA, a loop "
        "on CPU)",
    ]
    caveat = noise_caveat(result, "training steps")
    return "\n".join(lines + ([caveat] if caveat else []))


def bench_main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
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
        help="'bench' (random Llama, hidden 1024, MLP 2816, 4 layers), 'bench-8b' (Llama-3.1-8B's layer widths, "
        "2 layers; --train only) or a model spec",
    )
    parser.add_argument(
        "--rank",
        type=int,
        default=16,
        help="adapter rank r (a multiple of --tp); --train: LoRA's rank (BD-LoRA: equal params)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards (steps) per mode and token count")
    parser.add_argument(
        "--train",
        action="store_true",
        help="time a training step (forward + backward): base vs BD-LoRA vs plain LoRA, with peak memory per rank, "
        "the FLOP floor and each adapter's optimizer step",
    )
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "bf16-autocast"),
        default="fp32",
        help="--train: the model's dtype; bf16-autocast: a bf16 base, fp32 adapter weights, the forward under bf16 "
        "autocast (a recipe with a bf16 base and bf16: true)",
    )
    parser.add_argument(
        "--lora-dropout", type=float, default=0.0, help="--train: the adapters' lora_dropout (the recipes' 0.05)"
    )
    _add_device(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--out", help="also write the JSON result to this file (atomically; default: none)")
    args = parser.parse_args(argv)
    from bdlora_train.tp_diagnostics import bench_tp  # after parsing: `--help` loads no torch
    from bdlora_train.tp_diagnostics.train_check import bench_train

    train_only = [
        option
        for option, given in (
            (f"--dtype {args.dtype}", args.dtype != "fp32"),
            (f"--lora-dropout {args.lora_dropout}", args.lora_dropout != 0),
            ("--model bench-8b", args.base == "bench-8b"),
        )
        if given
    ]
    if train_only and not args.train:
        raise TPError(
            f"bench-tp: {train_only[0]} times a training step; add --train (the forward benchmark runs in fp32)"
        )
    if args.train:
        result = bench_train(
            args.tp,
            args.tokens,
            args.base,
            args.rank,
            args.repeats,
            device=args.device,
            dtype=args.dtype,
            lora_dropout=args.lora_dropout,
        )
        print(json.dumps(result, indent=2) if args.json else format_train_bench(result))
    else:
        check_rank(args.rank, args.tp, "bench-tp", key="--rank", blocks="--tp", error=TPError)
        result = bench_tp(args.tp, args.tokens, args.base, args.rank, args.repeats, device=args.device)
        print(json.dumps(result, indent=2) if args.json else format_bench(result))
    if args.out:
        result["command"] = shlex.join(["bdlora", "bench-tp", *(sys.argv[1:] if argv is None else argv)])
        atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
    return 0


def _add_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu: gloo ranks (default); cuda: NCCL, one GPU per rank (not yet run on GPUs)",
    )
