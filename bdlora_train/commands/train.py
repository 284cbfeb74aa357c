"""`bdlora train RECIPE.yaml [key=value ...]`: fine-tune a LoRA or BD-LoRA adapter from a recipe.

Also runs as `python -m bdlora_train.train` under `torchrun` / `accelerate launch` (DDP, DeepSpeed, FSDP).
"""

from __future__ import annotations

import argparse
import dataclasses

import yaml

from bdlora_train.train import load_recipe, train
from bdlora_train.train.recipe import Recipe


def _keys_help() -> str:
    lines = ["recipe keys (YAML or key=value) with defaults:"]
    for f in dataclasses.fields(Recipe):
        lines.append(f"  {f.name} = {f.default!r}  # {f.metadata['help']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="bdlora train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Fine-tune a LoRA / BD-LoRA adapter from a recipe YAML; key=value arguments override it.",
        epilog=_keys_help(),
    )
    parser.add_argument("args", nargs="*", metavar="RECIPE.yaml [key=value ...]")
    parser.add_argument("--print-recipe", action="store_true", help="print the resolved recipe as YAML and exit")
    ns = parser.parse_args(argv)
    path = None
    overrides = list(ns.args)
    if overrides and "=" not in overrides[0]:
        path = overrides.pop(0)
    recipe = load_recipe(path, overrides)
    if ns.print_recipe:
        print(yaml.safe_dump(dataclasses.asdict(recipe), sort_keys=False), end="")
        return 0
    train(recipe)
    return 0
