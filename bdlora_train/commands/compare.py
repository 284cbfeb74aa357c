"""`bdlora compare`: LoRA vs BD-LoRA at matched parameter budgets, trained and scored the same way."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from bdlora_train.core.errors import CompareError
from bdlora_train.core.helptext import DefaultsHelpFormatter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="bdlora compare",
        description="Train LoRA and BD-LoRA at matched parameter budgets over seeds, evaluate, and write "
        "results.json, results.md and pareto.png. Re-running the same command resumes.",
    )
    _what_to_compare(p)
    _how_to_train(p)
    _how_to_score(p)
    _output(p)
    return p


def _what_to_compare(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="embedded | tiny:<type> | dir | hub id (default: the recipe's, else embedded)"
    )
    p.add_argument(
        "--task",
        nargs="+",
        default=["analogies"],
        help="analogies | news-ppl | arithmetic | task.yaml | task.py | org/dataset",
    )
    p.add_argument(
        "--lora-ranks",
        nargs="+",
        type=int,
        default=[8, 16],
        help="LoRA ranks; each gets a matched and a double BD-LoRA",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=["lora", "bdlora"],
        help="methods to train: lora (the reference: without it the table has no deltas), bdlora (the toolkit's "
        "layer), peft-bdlora (stock PEFT's BD-LoRA layer and init); METHOD=matched trains that method at the "
        "matched budget only",
    )
    p.add_argument("--seeds", type=int, default=3, help="number of seeds (0..N-1)")
    p.add_argument("--seed-offset", type=int, default=0, help="first seed")
    p.add_argument(
        "--nblocks",
        type=int,
        default=None,
        help="BD-LoRA blocks = serving TP degree (default: the largest of 8, 6, 4, 3, 2, 1 dividing the heads "
        "and KV heads)",
    )


def _how_to_train(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lr-grid",
        nargs="+",
        default=None,
        metavar="LR",
        help="learning rates to try; each method and budget keeps the one with the best validation mean over seeds "
        "(same as --grid learning_rate=a,b,c; default: the recipe's learning_rate only)",
    )
    p.add_argument(
        "--grid",
        nargs="+",
        default=[],
        metavar="KEY=V1,V2",
        help="recipe keys to try, e.g. lora_alpha_ratio=1,2 use_rslora=false,true loraplus_lr_ratio=1,3 "
        "bd_lr_ratio=1,auto (all combinations of the keys each method reads); chosen on the validation split like "
        "--lr-grid",
    )
    p.add_argument(
        "--grid-seeds",
        type=int,
        default=None,
        metavar="K",
        help="train the grid on the first K seeds only and choose on them; the other seeds train each adapter's "
        "chosen setting (default: every seed trains the whole grid)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="training steps per run (default: the recipe's; 80 without --recipe)"
    )
    p.add_argument(
        "--recipe", default=None, help="base recipe YAML shared by every run (default: built-in calibration recipe)"
    )
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides applied to every run")


def _how_to_score(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--task-option", nargs="*", default=[], metavar="KEY=VALUE", help="task options, e.g. test_per_category=40"
    )
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help="evaluate at most N test items per category (and lm-eval limit) (default: all)",
    )
    p.add_argument("--eval-batch-size", type=int, default=32, help="test items scored per forward")
    p.add_argument(
        "--threads",
        default=None,
        help="torch threads per run: N, or 'auto' (1 while other jobs load the CPU) (default: torch's own)",
    )
    p.add_argument(
        "--lm-eval-tasks",
        nargs="*",
        default=None,
        help="also score each adapter with lm-evaluation-harness tasks (default: none)",
    )
    p.add_argument(
        "--lm-eval-include-path", default=None, help="a folder of your own lm-eval task YAMLs (default: none)"
    )
    p.add_argument("--no-base", action="store_true", help="skip the zero-shot score of the base model")


def _output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/compare", help="output directory (re-run to resume)")
    p.add_argument("--dry-run", action="store_true", help="print the budget plan and exit")
    p.add_argument(
        "--report-only", action="store_true", help="rebuild results.md and pareto.png from --out/results.json"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "--json",
        action="store_true",
        help="print results.json's content (with --dry-run: the plan, runs empty) on stdout instead of the table; "
        "messages go to stderr",
    )


def sweep_of(args: argparse.Namespace, argv: list[str]):
    """The typed sweep (`comparison.compare.Sweep`) the command line asks for."""
    from bdlora_train.comparison.compare import Sweep
    from bdlora_train.comparison.per_run import Scoring

    return Sweep(
        out=args.out,
        tasks=tuple(args.task),
        lora_ranks=tuple(args.lora_ranks),
        methods=tuple(args.methods),
        seeds=args.seeds,
        seed_offset=args.seed_offset,
        model=args.model,
        recipe=args.recipe,
        overrides=tuple(args.set),
        steps=args.steps,
        nblocks=args.nblocks,
        lr_grid=tuple(args.lr_grid) if args.lr_grid else None,
        grid=tuple(args.grid),
        grid_seeds=args.grid_seeds,
        task_options=tuple(args.task_option),
        threads=args.threads,
        with_base=not args.no_base,
        dry_run=args.dry_run,
        scoring=Scoring(
            batch_size=args.eval_batch_size,
            limit=args.limit,
            progress=not args.quiet,
            lm_eval_tasks=tuple(args.lm_eval_tasks or ()),
            lm_eval_include_path=args.lm_eval_include_path,
        ),
        command="bdlora compare " + " ".join(argv),
    )


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.seeds < 1:
        raise CompareError(f"compare: --seeds {args.seeds}; use 1 or more")
    if any(r < 1 for r in args.lora_ranks):
        raise CompareError(f"compare: --lora-ranks {args.lora_ranks}; ranks must be >= 1")
    if args.lm_eval_tasks:
        from bdlora_train.comparison import lm_eval_bridge

        lm_eval_bridge.require()
    with quiet_progress() if args.quiet else contextlib.nullcontext():
        return _run(args, argv)


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    from bdlora_train.comparison import report  # here, not at the top: `--help` loads no torch
    from bdlora_train.comparison.compare import run_sweep

    if args.report_only:
        path = Path(args.out) / "results.json"
        if not path.is_file():
            raise CompareError(f"compare: {path} not found; run the sweep first or point --out at a sweep directory")
        results = json.loads(path.read_text())
    else:
        # stdout carries the table (or results.json) only: Trainer's log dicts go to stderr
        with contextlib.redirect_stdout(sys.stderr):
            results = run_sweep(sweep_of(args, argv))
        if args.dry_run:
            if args.json:
                print(json.dumps(results, indent=2, default=str))
            return 0
    report.write_all(results, Path(args.out))
    print(json.dumps(results, indent=2, default=str) if args.json else report.markdown(results), flush=True)
    print(f"bdlora compare: wrote {Path(args.out) / 'results.json'}, results.md, pareto.png", file=sys.stderr)
    return 0


@contextlib.contextmanager
def quiet_progress():
    """--quiet: no progress bar of any library for the block (datasets' loading and map bars, transformers' and so
    the Trainer's, which `train()` drops while transformers' switch is off); the sweep's own bar is off too."""
    import datasets
    from transformers.utils import logging as hf_logging

    was = datasets.is_progress_bar_enabled(), hf_logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was[0]:
            datasets.enable_progress_bars()
        if was[1]:
            hf_logging.enable_progress_bar()
