"""`bdlora check-serving ADAPTER --tp N`: can an engine serve this adapter at TP N, and with which command."""

from __future__ import annotations

import argparse
import json

from bdlora_train.core.helptext import DefaultsHelpFormatter


def format_serving(report: dict) -> str:
    engine = report["engine"]
    installed = f"{engine['engine']} {engine['version']}" if engine["engine"] else "no vLLM installed"
    lines = [
        f"check-serving {report['adapter']}  TP {report['tp']}  nblocks {report['nblocks']}  r {report['r']}  "
        f"max-lora-rank {report['max_lora_rank']}  route {report['route']}  ({installed}, "
        f"plugin {'active' if engine['active'] else 'inactive'})"
    ]
    for check in report["checks"]:
        lines.append(f"  [{check['status']:>4}] {check['check']}: {check['message']}")
    if report["ready"]:
        lines.append(f"ready: {report['command']}")
    elif report["command"]:
        lines.append("not ready as is; do what the [ fix] lines say, then:")
        lines += [f"  {fix}" for fix in report["fixes"]] + [f"  {report['command']}"]
    else:
        lines.append("not ready: see the failed checks above for the fix")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="bdlora check-serving",
        description="Can vLLM serve this adapter at TP N (with this package's plugin, or as the exact dense export), "
        "and with which command; exit 1 when not ready.",
    )
    parser.add_argument("adapter", help="adapter directory")
    parser.add_argument("--tp", type=int, required=True, help="tensor-parallel size to serve at")
    parser.add_argument(
        "--max-lora-rank",
        type=int,
        help="vLLM --max-lora-rank (default: the smallest allowed value >= the rank each GPU holds, r/TP)",
    )
    parser.add_argument(
        "--model",
        "--base",
        dest="model",
        help="base model spec / Hub id (default: the adapter's base_model_name_or_path)",
    )
    parser.add_argument(
        "--save-base",
        metavar="DIR",
        help="write the embedded base the adapter was trained on to DIR as a model directory vLLM loads (reused when "
        "there) and serve it from there",
    )
    parser.add_argument("--name", help="LoRA module name in --lora-modules (default: the adapter directory's name)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    from bdlora_train.serving.check import check_serving  # after parsing: `--help` loads no torch or PEFT

    report = check_serving(args.adapter, args.tp, args.max_lora_rank, args.model, args.name,
                           base_out=args.save_base)
    print(json.dumps(report, indent=2) if args.json else format_serving(report))
    return 0 if report["ready"] else 1
