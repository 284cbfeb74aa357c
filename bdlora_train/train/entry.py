"""The `bdlora train RECIPE.yaml [key=value ...]` command line: fine-tune a LoRA or BD-LoRA adapter from a recipe.

It lives in train/ rather than commands/ because torchrun and accelerate launch run it as `python -m
bdlora_train.train` (train/__main__.py), and that entry point imports nothing above train/; commands/train.py is
the same function under `bdlora train`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys

from bdlora_train.core import launch_env


def _keys_help() -> str:
    from bdlora_train.core.helptext import spell
    from bdlora_train.recipe.schema import recipe_fields

    lines = ["recipe keys (YAML or key=value) with defaults:"]
    for f in recipe_fields():
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = f"[{', '.join(spell(v) for v in default)}]" if isinstance(default, (list, tuple)) else spell(default)
        lines.append(f"  {f.name} = {shown}  # {f.metadata['help']}")  # as a recipe writes it: null, true, [a, b]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bdlora train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Fine-tune a LoRA / BD-LoRA adapter from a recipe YAML; key=value arguments override it, "
        "e.g. `bdlora train recipes/tiny/bdlora.yaml output_dir=runs/x max_steps=5`.",
        epilog=_keys_help(),
    )
    parser.add_argument("args", nargs="*", metavar="RECIPE.yaml [key=value ...]")
    parser.add_argument("--print-recipe", action="store_true", help="print the resolved recipe as YAML and exit")
    parser.add_argument("--json", action="store_true", help="print metrics.json's content instead of the summary")
    return parser


def as_overrides(argv: list[str]) -> list[str]:
    """The `--key value` / `--key=value` / `--flag` options of `argv` that name a recipe key, written as the
    `key=value` arguments the command takes (`--max_steps 5` -> `max_steps=5`, `--packing` -> `packing=true`)."""
    from bdlora_train.recipe.schema import recipe_keys

    keys = set(recipe_keys())
    written, i = [], 0
    while i < len(argv):
        name, given, value = argv[i][2:].partition("=")
        key = name.replace("-", "_")
        if argv[i].startswith("--") and key in keys:
            following = argv[i + 1] if i + 1 < len(argv) else ""
            if given:
                pass
            elif following and not following.startswith("-") and "=" not in following:
                value, i = following, i + 1
            else:
                value = "true"  # a flag: a boolean key
            written.append(f"{key}={value}")
        i += 1
    return written


def main(argv=None) -> int:
    from bdlora_train.core.boundary import UsageError

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # no recipe and no key: never a default multi-hour run; say how to start one
        raise UsageError(
            "give a recipe YAML (and key=value overrides), e.g. `bdlora train recipes/tiny/bdlora.yaml "
            "output_dir=runs/x max_steps=5`; `bdlora train --help` lists every key"
        )
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        hint = as_overrides(argv)
        parser.error(
            f"unrecognized arguments: {' '.join(unknown)}; recipe keys are key=value arguments"
            + (f": write {' '.join(hint)}" if hint else "")
        )
    from bdlora_train.launch.checks import die_with_launcher
    from bdlora_train.recipe.load import load_recipe  # after parsing: `--help` loads no torch

    die_with_launcher()  # a rank of torchrun / accelerate launch stops when its launcher dies (kill -9 included)

    path = None
    overrides = list(ns.args)
    if overrides and "=" not in overrides[0]:
        path = overrides.pop(0)
    recipe = load_recipe(path, overrides)
    if ns.print_recipe:
        print(recipe.to_yaml(), end="")
        return 0
    check_launch(recipe)  # refusals before output_dir exists and before the training stack is imported
    from bdlora_train.train.run import train

    # stdout carries the summary line (or metrics.json) only: Trainer's progress log dicts go to stderr
    with contextlib.redirect_stdout(sys.stderr):
        result = train(recipe)
    if launch_env.is_main_process():  # under torchrun / accelerate launch: one report, not one per rank
        print(json.dumps(result.metrics, indent=2) if ns.json else summary_line(result.metrics), flush=True)
    return 0


def check_launch(recipe) -> None:
    """What a command-line run refuses before it creates output_dir or loads anything heavy: the recipe's own rules,
    a launcher that started one process instead of N, and under TP the process count. A wrong count is said after
    the model's TP rules (heads, nblocks, rank) pass, so the command it prints runs; only rank 0 reads the model for
    that (every rank sees the same WORLD_SIZE: the others refuse at once and wait, quiet, for the launcher to stop
    them: core/boundary.py)."""
    from bdlora_train.launch.checks import check_processes, check_single_process_launch
    from bdlora_train.train.run_plan import check_model_parallel

    recipe.validate()
    check_single_process_launch()
    if not recipe.model_parallel:
        return
    launched = launch_env.world_size()
    if launched != recipe.tp_size * recipe.fsdp_size * recipe.dp_replicate_size:
        if launch_env.is_main_process():
            check_model_parallel(recipe)
        check_processes(recipe)


def summary_line(m: dict) -> str:
    from bdlora_train.objectives import objective_named
    from bdlora_train.recipe.methods import BD_METHODS

    loss = objective_named(m.get("objective")).result_text(m)  # GRPO's loss says little; its reward does
    shape = f"r={m['r']} nblocks={m['nblocks']}" if m["method"] in BD_METHODS else f"r={m['r']}"
    return (
        f"bdlora train: {m['method']} {shape} | {m['trainable_params']:,} trainable | step {m['steps']} | "
        f"{m['steps_this_run']} steps in {m['train_wall_time_s']:.1f} s | {m['tokens_per_second'] or 0:,.0f} "
        f"tok/s | peak {m['peak_memory_mb']:,.0f} MB | "
        f"{loss} | world {m['world_size']} | adapter -> {m['adapter_dir']}"
    )
