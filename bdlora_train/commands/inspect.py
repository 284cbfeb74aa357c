"""`bdlora inspect ADAPTER`: roles, stored and dense shapes, params and servable TP degrees of a saved adapter."""

from __future__ import annotations

import argparse
import json
import sys

from bdlora_train.adapters.describe import describe, module_table
from bdlora_train.adapters.reader import read_adapter
from bdlora_train.adapters.shapes import base_model_for, verify_shapes
from bdlora_train.core.errors import AdapterError


def format_description(info: dict) -> str:
    lines = [
        f"adapter: {info['path']}  base: {info['base_model']}",
        f"BD-LoRA: {info['bdlora']}  nblocks: {info['nblocks']}  trainable params: {info['total_params']:,}",
        "",
        *module_table(info),
        "",
    ]
    if info["bdlora"]:
        native = info["native_tp"]
        others = [d for d in info["tp_degrees"] if d != native]
        lines.append(
            f"Servable at TP {native} natively (zero extra collectives); at TP {others} after "
            "`bdlora export ADAPTER --reblock D`; at any TP as plain LoRA after `bdlora export ADAPTER --to "
            "dense-lora`."
        )
    else:
        lines.append("Plain LoRA adapter: servable at any TP degree (with S-LoRA style communication).")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bdlora inspect", description="Describe a saved (BD-)LoRA adapter.")
    parser.add_argument("adapter", help="adapter directory (adapter_config.json + adapter_model.safetensors)")
    parser.add_argument("--per-module", action="store_true", help="one row per module instead of per module kind")
    parser.add_argument("--model", help="base model to check the factor shapes against (default: the adapter's base)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    adapter = read_adapter(args.adapter)
    try:
        base = base_model_for(adapter, args.model)
    except AdapterError as err:  # the base is not available here: describe the file alone, and say so
        if args.model:
            raise
        print(f"bdlora inspect: note: shapes not checked against the base ({err})", file=sys.stderr)
    else:
        verify_shapes(adapter, base)
    info = describe(adapter, per_module=args.per_module)
    print(json.dumps(info, indent=2) if args.json else format_description(info))
    return 0
