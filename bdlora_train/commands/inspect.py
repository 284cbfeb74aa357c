"""`bdlora inspect ADAPTER`: roles, stored and dense shapes, params and servable TP degrees of a saved adapter."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from bdlora_train.core.helptext import DefaultsHelpFormatter


def export_commands(info: dict) -> list[tuple[str, str]]:
    """(command, what it gives) for the exports that serve the adapter at the TP degrees it cannot serve natively,
    with the adapter's path as given and an --out beside it that does not exist yet: runnable as printed. TP 1 needs
    none (no TP: the adapter serves as it is), so `--reblock 1` is never suggested."""
    if not info["use_bdlora"]:  # plain LoRA to PEFT (also with densely stored blocks): nothing to convert
        return []
    source = Path(info["path"])
    beside = source if source.name not in ("", ".", "..") else source.resolve()  # `inspect .`: name the directory
    commands = []
    for degree in info["tp_degrees"]:
        if degree not in (info["native_tp"], 1):
            out = _free_path(beside.with_name(f"{beside.name}-nb{degree}"))
            commands.append((f"--reblock {degree} --out {shlex.quote(str(out))}", f"TP {degree}: BD-LoRA, re-blocked"))
    out = _free_path(beside.with_name(f"{beside.name}-dense"))
    commands.append((f"--to dense-lora --out {shlex.quote(str(out))}", "any TP: the same adapter as plain LoRA"))
    return [(f"bdlora export {shlex.quote(str(source))} {args}", what) for args, what in commands]


def _free_path(path: Path) -> Path:
    """`path`, or `path-2`, `path-3`, ... when it exists: a printed --out that export will not refuse."""
    candidate, n = path, 2
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}-{n}"), n + 1
    return candidate


def format_description(info: dict) -> str:
    from bdlora_train.adapters.describe import module_table

    lines = [
        f"adapter: {info['path']}  base: {info['base_model']}",
        f"BD-LoRA: {info['bdlora']}  nblocks: {info['nblocks']}  trainable params: {info['total_params']:,}",
        "",
        *module_table(info),
        "",
    ]
    if not info["bdlora"]:
        lines.append("Plain LoRA adapter: servable at any TP degree (with S-LoRA style communication).")
        return "\n".join(lines)
    without_tp = " and without TP (TP 1) as it is" if info["native_tp"] != 1 else ""
    lines.append(f"Servable at TP {info['native_tp']} natively (zero extra collectives){without_tp}.")
    commands = export_commands(info)
    if commands:
        width = max(len(command) for command, _ in commands)
        lines.append("Other TP degrees after an exact export:")
        lines += [f"  {command:<{width}}  # {what}" for command, what in commands]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter, prog="bdlora inspect", description="Describe a saved (BD-)LoRA adapter."
    )
    parser.add_argument("adapter", help="adapter directory (adapter_config.json + adapter_model.safetensors)")
    parser.add_argument("--per-module", action="store_true", help="one row per module instead of per module kind")
    parser.add_argument(
        "--model",
        help="base model to check the factor shapes against: the adapter's base or a local copy of it (default: the "
        "adapter's base_model_name_or_path)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    from bdlora_train.adapters.describe import describe  # after parsing: `--help` loads no torch
    from bdlora_train.adapters.reader import read_adapter
    from bdlora_train.adapters.shapes import base_identity, base_model_for, verify_shapes
    from bdlora_train.core.errors import AdapterError

    adapter = read_adapter(args.adapter)
    if args.model:
        verdict, message = base_identity(adapter, args.model)
        if verdict == "other":
            raise AdapterError(f"inspect: --model {message}; drop --model, or pass that base or a local copy of it")
        if verdict == "unknown":
            print(f"bdlora inspect: note: --model {message}", file=sys.stderr)
    try:
        base = base_model_for(adapter, args.model)
    except AdapterError as err:  # the base is not available here: describe the file alone, and say so
        if args.model:
            raise
        print(f"bdlora inspect: note: shapes not checked against the base ({err})", file=sys.stderr)
    else:
        verify_shapes(adapter, base, given=args.model)
    info = describe(adapter, per_module=args.per_module)
    print(json.dumps(info, indent=2) if args.json else format_description(info))
    return 0
