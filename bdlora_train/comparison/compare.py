"""`bdlora compare`: LoRA vs BD-LoRA at matched parameter budgets, trained and scored the same way.

For every LoRA rank r it plans three adapters — LoRA at r, BD-LoRA at the largest rank with at most LoRA's
parameters ("matched", ≈0.86x in the paper) and BD-LoRA at twice that rank ("double", ≈1.7x) — over N seeds,
with one base recipe (same data, steps, learning rate, alpha ratio) for all of them. Each run goes through
`bdlora_train.train.train` (the one training loop) on a copy of a base model loaded once, then the task scores
the trained model in memory. A run that two budgets share (BD-LoRA 24 is both "double" of LoRA 8 and "matched"
of LoRA 16 on SmolLM2) is trained once.

With a grid (`--lr-grid 3e-4 1e-3 3e-3`, `--grid KEY=v1,v2`), every method x budget x seed trains every grid
point and is scored on the task's validation split (carved from the training data, tasks.py) as well as on test;
grid.choose picks each method's setting per budget on the validation mean over seeds, and the report shows only
the chosen setting's test scores. Methods: "lora", the toolkit's "bdlora", and "peft-bdlora" (stock PEFT's layer).

Each run trains on the first max_steps x batch x gradient accumulation x world size rows of the task's training
order for its seed (all rows when training by epochs): only those are tokenized, and every method gets the same rows
for the same seed (`train_rows`).

Output in --out: runs/<run_id>/record.json per finished run (the sweep skips these when re-run: an interrupted
sweep resumes; a run's checkpoint-<step>/ dirs, if the recipe saves any, serve to resume that run and are deleted
once its record is written), results.json (every record + meta), results.md (tables), pareto.png (plot), and with a grid
val_curves.png (validation metric per grid point and method).

Here: the sweep (`Sweep`, `run_sweep`) and its shared recipe; the runs it plans are in comparison/planning.py, its
records in --out and the settings they must share in comparison/records.py.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import time
from pathlib import Path

from bdlora_train.comparison import grid, per_run, report
from bdlora_train.comparison.per_run import TRAIN_DATA_RULE, drop_checkpoints
from bdlora_train.comparison.planning import DEFAULT_METHODS, Run, plan_runs
from bdlora_train.comparison.records import load_records, shared_recipe_fingerprint, write_json_atomic
from bdlora_train.comparison.summary import selection
from bdlora_train.core.errors import CompareError
from bdlora_train.recipe.methods import LORA_ONLY_KEYS
from bdlora_train.tasks.registry import get_task

# The base recipe when --recipe is not given: the calibration that took SmolLM2-135M from 11% to ~80% on the
# analogies task (batch 16, lr 1e-3, warm-up then linear decay, alpha = 2r, the 7 projections; docs/compare.md).
# Identical for every method.
DEFAULT_RECIPE = dict(
    lora_alpha_ratio=2.0,
    lora_dropout=0.0,
    per_device_train_batch_size=16,
    learning_rate=1e-3,
    lr_scheduler_type="linear",
    warmup_ratio=0.1,
    max_seq_length=128,
    max_steps=80,
    save_steps=0,
    logging_steps=10,
    report_to="none",
)


def build_recipe(path: str | None, model_spec: str | None, steps: int | None, overrides, point=()):
    """The shared Recipe: --recipe YAML (or DEFAULT_RECIPE), then --set overrides, --steps, --model and a grid
    point, each layer replacing the keys of the ones before (a key twice within --set is still an error).

    LoRA's own keys (loraplus_lr_ratio) are checked under method=lora: the shared recipe's method is BD-LoRA's, and
    each run's recipe keeps them for LoRA only (per_run.run_recipe_for)."""
    from bdlora_train.recipe.text import parse_overrides
    from bdlora_train.train import load_recipe

    layered = {} if path else {k: str(v) for k, v in DEFAULT_RECIPE.items()}
    layered.update(parse_overrides(overrides))
    if steps is not None:
        layered["max_steps"] = str(steps)
    if model_spec is not None:
        layered["model"] = model_spec
    layered.update(parse_overrides(point))
    lora_only = {k: layered.pop(k) for k in LORA_ONLY_KEYS if k in layered}
    recipe = load_recipe(path, [f"{k}={v}" for k, v in layered.items()])
    if lora_only:
        lora = load_recipe(None, ["method=lora", *(f"{k}={v}" for k, v in lora_only.items())])
        recipe = recipe.replace(**{k: getattr(lora, k) for k in lora_only})
    return recipe


def pick_threads(spec: str) -> int:
    """A thread count, or for "auto" all cores when the machine is idle and 1 when other jobs are running.

    Measured on a shared 2-core machine: with other jobs busy, a matmul ran 2x slower on two OpenMP threads
    than on one (threads spin at barriers while the other core is taken), so "auto" backs off to one.
    """
    cores = os.cpu_count() or 1
    if spec != "auto":
        if not spec.isdigit() or int(spec) < 1:
            raise CompareError(f"compare: --threads {spec}; use a positive integer or 'auto'")
        return int(spec)
    import torch

    others = os.getloadavg()[0] - torch.get_num_threads()  # the 1-minute load minus this process's own threads
    return cores if others < 0.5 else 1


@dataclasses.dataclass(frozen=True)
class Sweep:
    """Everything one `bdlora compare` sweep is asked to do (its CLI options, typed)."""

    out: str = "runs/compare"
    tasks: tuple[str, ...] = ("analogies",)
    lora_ranks: tuple[int, ...] = (8, 16)
    methods: tuple[str, ...] = DEFAULT_METHODS
    seeds: int = 3
    seed_offset: int = 0
    model: str | None = None  # default: the recipe's
    recipe: str | None = None  # default: DEFAULT_RECIPE
    overrides: tuple[str, ...] = ()  # --set key=value
    steps: int | None = None
    nblocks: int | None = None
    lr_grid: tuple[str, ...] | None = None
    grid: tuple[str, ...] = ()  # --grid key=v1,v2
    grid_seeds: int | None = None
    task_options: tuple[str, ...] = ()  # --task-option key=value
    threads: str | None = None  # N or "auto"
    with_base: bool = True
    dry_run: bool = False
    scoring: per_run.Scoring = per_run.Scoring()
    command: str = "bdlora compare"

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.seed_offset, self.seed_offset + self.seeds))

    def recipe_at(self, point=()):
        """The shared recipe, at a grid point."""
        return build_recipe(self.recipe, self.model, self.steps, self.overrides, point)


@dataclasses.dataclass
class _Plan:
    """What a sweep resolved before loading the model: recipe, tasks, grid and the fingerprint runs must share."""

    recipe: object
    tasks: dict
    methods: tuple
    budgets: dict
    axes: list
    settings: list
    grid_seeds: list[int]
    task_options: dict
    fingerprint: dict


def _resolve(sweep: Sweep) -> _Plan:
    """Recipe, tasks, methods and grid of a sweep, each checked; no model is loaded yet."""
    recipe = sweep.recipe_at()
    seeds = sweep.seed_list
    methods, budgets = grid.parse_methods(sweep.methods or DEFAULT_METHODS)
    axes = grid.parse_grid(list(sweep.grid), list(sweep.lr_grid) if sweep.lr_grid else None)
    settings = grid.typed_settings(axes, sweep.recipe_at)
    grid_seeds = seeds[: sweep.grid_seeds] if axes and sweep.grid_seeds else seeds
    if axes and sweep.grid_seeds is not None and not 1 <= sweep.grid_seeds <= len(seeds):
        raise CompareError(f"compare: --grid-seeds {sweep.grid_seeds}; use 1..{len(seeds)} (the number of --seeds)")
    task_options = dict(_parse_option(o) for o in sweep.task_options)
    tasks = {task.name: task for task in (get_task(spec, **task_options) for spec in sweep.tasks)}
    if axes:
        for name, task in tasks.items():
            if "validation" not in getattr(task, "splits", ()):
                raise CompareError(
                    f"compare: task {name} has no validation split, so a grid cannot be chosen on it; give it one "
                    "(validation_fraction in a task YAML, validation_rows= for a GenerationTask) or drop --grid"
                )
    scoring = sweep.scoring
    fingerprint = {
        "model": recipe.model,
        "recipe": shared_recipe_fingerprint(recipe, [k for k, _ in axes]),
        "task_options": task_options,
        "splits": {name: _split_sizes(task) for name, task in tasks.items()},
        "train_data": TRAIN_DATA_RULE,
        "limit": scoring.limit,
        "lm_eval_tasks": list(scoring.lm_eval_tasks),
        "lm_eval_include_path": scoring.lm_eval_include_path,
    }
    return _Plan(recipe, tasks, methods, budgets, axes, settings, grid_seeds, task_options, fingerprint)


def _meta(sweep: Sweep, resolved: _Plan, base, nblocks: int, plan: list, runs: list[Run]) -> dict:
    """results.json's "meta": what the sweep planned and with which recipe, splits and library versions."""
    import torch

    tasks, settings, axes = resolved.tasks, resolved.settings, resolved.axes
    later = [s for s in sweep.seed_list if s not in resolved.grid_seeds]
    adapters = {(r.task, r.method, r.r) for r in runs if r.method != "base"}
    return {
        "command": sweep.command,
        "model": resolved.recipe.model,
        "model_name": getattr(base, "name_or_path", None) or resolved.recipe.model,  # e.g. the embedded model's id
        "tasks": list(tasks),
        "lora_ranks": list(sweep.lora_ranks),
        "seeds": sweep.seed_list,
        "nblocks": nblocks,
        "plan": plan,
        "methods": list(resolved.methods),
        "method_budgets": resolved.budgets,
        "grid_seeds": resolved.grid_seeds,
        "grid": [[k, list(dict.fromkeys(dict(p)[k] for p in settings))] for k, _ in axes],
        "grid_points": [dict(p) for p in settings] if axes else [],
        "splits": resolved.fingerprint["splits"],
        "train_data": TRAIN_DATA_RULE,
        "planned_runs": sum(r.method != "base" for r in runs) + len(later) * len(adapters),
        "recipe": resolved.recipe.flat(),
        "task_options": resolved.task_options,
        "limit": sweep.scoring.limit,
        "primary_metric": {n: t.primary_metric for n, t in tasks.items()},
        "higher_is_better": {n: t.higher_is_better for n, t in tasks.items()},
        "versions": _versions(),
        "torch_threads": torch.get_num_threads(),
    }


def run_sweep(sweep: Sweep) -> dict:
    """Train and score every planned run not already recorded in `sweep.out`; returns the results dict."""
    import torch

    from bdlora_train.budget import budget_plan
    from bdlora_train.core.heads import choose_nblocks
    from bdlora_train.models import load_model
    from bdlora_train.quant.quantized import quantization_config

    out = Path(sweep.out)
    resolved = _resolve(sweep)
    recipe, tasks, settings = resolved.recipe, resolved.tasks, resolved.settings
    print(f"bdlora compare: loading {recipe.model} once", file=sys.stderr, flush=True)
    base, tokenizer = load_model(recipe.model, seed=0, quantization=quantization_config(recipe.quant_keys))
    explicit = sweep.nblocks if sweep.nblocks is not None else recipe.nblocks  # --nblocks wins over the recipe's
    nblocks = choose_nblocks(base.config, explicit, recipe.tp_size)  # the precedence `bdlora train` uses
    plan = budget_plan(base, sweep.lora_ranks, nblocks, recipe.targets)
    plan_args = dict(methods=resolved.methods, settings=settings, budgets=resolved.budgets)
    runs = plan_runs(list(tasks), plan, resolved.grid_seeds, with_base=sweep.with_base, **plan_args)
    meta = _meta(sweep, resolved, base, nblocks, plan, runs)
    planned = f"{meta['planned_runs']} runs planned" + (" and the base model's score" if sweep.with_base else "")
    _print_plan(plan, recipe.model, nblocks, planned, resolved.methods, settings if resolved.axes else [])
    if sweep.dry_run:
        return {"meta": meta, "runs": []}
    try:  # only now: a sweep refused above leaves no empty --out behind
        (out / "runs").mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CompareError(
            f"compare: --out {out} cannot be created ({err.strerror}); choose another directory"
        ) from None

    records = load_records(out, resolved.fingerprint)
    sweep_start = time.perf_counter()

    def results_now() -> dict:
        return {
            "meta": {**meta, "sweep_wall_time_s": time.perf_counter() - sweep_start},
            "runs": list(records.values()),
        }

    def execute(todo: list[Run]) -> None:
        bar = _bar(todo, not sweep.scoring.progress)
        for run in bar:
            if hasattr(bar, "set_description"):
                bar.set_description(run.run_id)
            if run.run_id in records:
                continue
            if sweep.threads is not None:
                torch.set_num_threads(pick_threads(sweep.threads))
            records[run.run_id] = per_run.do_run(
                run,
                tasks[run.task],
                base,
                tokenizer,
                recipe,
                out,
                sweep.scoring,
                resolved.fingerprint,
                validate=bool(resolved.axes),
            )
            write_json_atomic(out / "runs" / run.run_id / "record.json", records[run.run_id])
            drop_checkpoints(out / "runs" / run.run_id)  # the run is recorded: nothing will resume from them
            report.write_all(results_now(), out)  # after every run, so a partial sweep already has its tables
            gc.collect()

    execute(runs)
    later = [s for s in sweep.seed_list if s not in resolved.grid_seeds]
    if later:  # --grid-seeds: the remaining seeds train each adapter's setting chosen on the tuning seeds only
        chosen = {
            key: sel["choice"]["setting"]
            for key, sel in selection(results_now()).items()
            if sel["choice"] is not None and key[1] != "base"
        }
        execute(plan_runs(list(tasks), plan, later, False, only=chosen, **plan_args))
    results = results_now()
    report.write_all(results, out)
    return results


def _split_sizes(task) -> dict | None:
    sizes = getattr(task, "split_sizes", None)
    try:
        return sizes() if sizes else None
    except NotImplementedError:
        return None


def _parse_option(item: str) -> tuple[str, object]:
    import yaml

    if "=" not in item:
        raise CompareError(f"compare: --task-option '{item}' is not key=value (e.g. test_per_category=40)")
    key, raw = item.split("=", 1)
    return key.strip(), yaml.safe_load(raw)


def _versions() -> dict:
    import peft
    import torch
    import transformers

    return {"torch": torch.__version__, "peft": peft.__version__, "transformers": transformers.__version__}


def _bar(runs, quiet: bool):
    if quiet:
        return runs
    from tqdm.auto import tqdm

    return tqdm(runs, desc="compare", unit="run", file=sys.stderr)


def _print_plan(plan, model_spec, nblocks, runs: str, methods=DEFAULT_METHODS, settings=()) -> None:
    """The plan on stderr; `runs` counts trained runs as results.md's "trained runs of N planned" does."""
    lines = [f"bdlora compare: {model_spec}, nblocks {nblocks}, methods {' '.join(methods)}, {runs}"]
    if settings:
        lines.append(f"  grid ({len(settings)} points): " + "; ".join(grid.label(dict(p)) for p in settings))
    for entry in plan:
        lora = entry["lora"]
        parts = [f"LoRA r={lora['r']} ({lora['params']:,})"]
        for budget in ("matched", "double"):
            spec = entry[budget]
            parts.append(f"BD-LoRA {budget} r={spec['r']} ({spec['params']:,}, {spec['ratio']:.2f}x)")
        lines.append("  " + " | ".join(parts))
    print("\n".join(lines), file=sys.stderr, flush=True)
