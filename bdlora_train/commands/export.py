"""`bdlora export ADAPTER --to dense-lora|merged | --reblock N --out DIR`: exact conversions of an adapter."""

from __future__ import annotations

import argparse
import json

from bdlora_train.core.helptext import DefaultsHelpFormatter


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter, prog="bdlora export", description="Exact exports of a BD-LoRA adapter."
    )
    parser.add_argument("adapter", help="adapter directory (adapter_config.json + adapter_model.safetensors)")
    which = parser.add_mutually_exclusive_group(required=True)
    # the kinds are checked by `export()` (bdlora_train.export.EXPORTS), so `--help` need not import it
    which.add_argument(
        "--to",
        metavar="{dense-lora,merged}",
        help="dense-lora: plain LoRA for any engine; merged: a full model (--to or --reblock is required)",
    )
    which.add_argument(
        "--reblock", type=int, metavar="N", help="nblocks k*N -> N (for serving at TP N; --to or --reblock is required)"
    )
    parser.add_argument("--out", required=True, help="output directory (written atomically; never inside the adapter)")
    parser.add_argument(
        "--model",
        "--base",
        dest="model",
        help="base model spec for --to merged (default: the adapter's base_model_name_or_path)",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    parser.add_argument("--json", action="store_true", help="print JSON: {adapter, export, out}")
    args = parser.parse_args(argv)
    from bdlora_train.export import export  # after parsing: `--help` loads no torch

    out = export(args.adapter, args.out, to=args.to, reblock_to=args.reblock, base=args.model, force=args.force)
    what = f"nblocks {args.reblock}" if args.reblock else args.to
    if args.json:
        print(json.dumps({"adapter": args.adapter, "export": what, "out": str(out)}))
    else:
        print(f"wrote {what} export of {args.adapter} to {out}")
    return 0
