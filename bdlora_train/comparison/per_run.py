"""One sweep run: its recipe, what it reads, trains, scores and records, and what it leaves behind.

Reads: the first `train_rows(recipe)` rows of the task's training order for the run's seed — max_steps x
per-device batch x gradient accumulation x world size when training by steps — so a sweep of 80 steps tokenizes
1,280 rows, not the task's 18,813; every method reads the same rows for the same seed.
Leaves: record.json, adapter/, metrics.json and recipe.yaml; checkpoint-<step>/ dirs (written when the recipe has
save_steps > 0) resume an interrupted run and are deleted once the run's record is written.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

from bdlora_train.core import launch_env
from bdlora_train.recipe.methods import BD_METHODS, keys_not_read_by
from bdlora_train.train import rundir
from bdlora_train.trainer.mixins import complete_checkpoints

# How each run's training rows are chosen: part of the fingerprint, so runs that read other rows are never mixed.
TRAIN_DATA_RULE = "first max_steps*batch*accumulation*world_size rows of the task's order for the seed"


def train_rows(recipe, world_size: int | None = None) -> int | None:
    """How many training rows one run reads: max_steps x per-device batch x gradient accumulation x world size
    (plus the rows eval_fraction holds out of them), capped by max_train_samples; None when training by epochs
    (every row is read)."""
    world = world_size if world_size is not None else launch_env.world_size()
    if recipe.max_steps <= 0:
        return recipe.max_train_samples
    n = recipe.max_steps * recipe.per_device_train_batch_size * recipe.gradient_accumulation_steps * world
    if recipe.eval_fraction:  # train() holds max(1, round(len * f)) rows out for eval (data.split_eval)
        total = n
        while total - max(1, round(total * recipe.eval_fraction)) < n:
            total += 1
        n = total
    return n if recipe.max_train_samples is None else min(n, recipe.max_train_samples)


def select_train_rows(dataset, recipe):
    """The rows a run trains on: the first `train_rows(recipe)` of the task's order for the run's seed, so only they
    are tokenized and every method reads the same rows for the same seed (the Trainer then shuffles them with
    data_seed = seed, again the same for every method)."""
    n = train_rows(recipe)
    if n is None or n >= len(dataset):
        return dataset
    return dataset.select(range(n)) if hasattr(dataset, "select") else list(dataset)[:n]


def drop_checkpoints(run_dir: Path) -> None:
    """After a run's record.json is written: its checkpoint-<step>/ dirs (they resume an interrupted run, and the
    sweep never resumes a recorded one) and any staging leftovers of ours go; adapter/ and metrics stay."""
    for checkpoint in complete_checkpoints(run_dir):
        shutil.rmtree(checkpoint)
    rundir.remove_stale_staging(run_dir)


def adapter_file_size(adapter_dir: Path) -> int:
    return sum(f.stat().st_size for f in Path(adapter_dir).glob("adapter_model.*"))


@dataclasses.dataclass(frozen=True)
class Scoring:
    """How every run is scored: the task's evaluation (batch size, item limit, progress bars) and optional lm-eval."""

    batch_size: int = 32
    limit: int | None = None
    progress: bool = True
    lm_eval_tasks: tuple[str, ...] = ()
    lm_eval_include_path: str | None = None


def evaluate_run(task, model, tokenizer, scoring: Scoring, split: str = "test") -> tuple[dict, float]:
    start = time.perf_counter()
    kwargs = {"split": split} if split != "test" else {}  # plugin tasks written before splits take no `split`
    scores = task.evaluate(
        model, tokenizer, batch_size=scoring.batch_size, limit=scoring.limit, progress=scoring.progress, **kwargs
    )
    return scores, time.perf_counter() - start


def run_recipe_for(run, recipe, run_dir: Path):
    """The recipe of one run: the shared recipe, the run's grid setting, its method, rank and seed. Keys the method
    does not read (bd_lr_ratio, bd_a_init for LoRA; loraplus_lr_ratio for BD methods) are reset to their defaults."""
    from bdlora_train.recipe.schema import recipe_fields

    defaults = {f.name: f.default for f in recipe_fields()}
    reset = {k: defaults[k] for k in keys_not_read_by(run.method)}
    return recipe.replace(
        **reset,
        **dict(run.setting),
        method=run.method,
        lora_r=run.r,
        nblocks=run.nblocks if run.method in BD_METHODS else recipe.nblocks,
        match_budget_of_lora_rank=None,
        seed=run.seed,
        output_dir=str(run_dir),
        run_name=run.run_id,
        dataset=f"task:{run.task}",
    ).validate()


def do_run(
    run, task, base, tokenizer, recipe, out: Path, scoring: Scoring, fingerprint, validate: bool = False
) -> dict:
    from bdlora_train.train import train

    run_dir = out / "runs" / run.run_id
    record = {
        "run_id": run.run_id,
        "task": run.task,
        "method": run.method,
        "r": run.r,
        "nblocks": run.nblocks,
        "seed": run.seed,
        "setting": dict(run.setting),
        "fingerprint": fingerprint,
    }
    if run.method == "base":
        scores, eval_s = evaluate_run(task, base, tokenizer, scoring)
        if validate:
            record["val_metrics"], val_s = evaluate_run(task, base, tokenizer, scoring, split="validation")
            eval_s += val_s
        record.update(trainable_params=0, metrics=scores, eval_time_s=round(eval_s, 2))
        run_dir.mkdir(parents=True, exist_ok=True)
        return record
    run_recipe = run_recipe_for(run, recipe, run_dir)
    # train() deep-copies `base`, so every run starts from the same clean weights.
    rows = select_train_rows(task.train_dataset(seed=run.seed), run_recipe)
    result = train(run_recipe, model=base, tokenizer=tokenizer, train_dataset=rows)
    scores, eval_s = evaluate_run(task, result.model, tokenizer, scoring)
    if validate:  # the split the grid is chosen on; test scores are recorded too but never read by the choice
        record["val_metrics"], val_s = evaluate_run(task, result.model, tokenizer, scoring, split="validation")
        eval_s += val_s
    if scoring.lm_eval_tasks:
        from bdlora_train.comparison import lm_eval_bridge

        scores.update(
            lm_eval_bridge.evaluate(
                result.model,
                tokenizer,
                list(scoring.lm_eval_tasks),
                limit=scoring.limit,
                model_spec=recipe.model,
                adapter_dir=result.adapter_dir,
                include_path=scoring.lm_eval_include_path,
            )
        )
    m = result.metrics
    record.update(
        lora_alpha=m["lora_alpha"],
        bd_lr_ratio=m["bd_lr_ratio"],
        loraplus_lr_ratio=m["loraplus_lr_ratio"],
        trainable_params=m["trainable_params"],
        adapter_file_size_bytes=adapter_file_size(result.adapter_dir),
        train_wall_time_s=m["train_wall_time_s"],
        tokens_per_second=m["tokens_per_second"],
        peak_memory_mb=m["peak_memory_mb"],
        peak_memory_kind=m["peak_memory_kind"],
        final_loss=m["final_loss"],
        train_loss_mean=m["train_loss_mean"],
        steps=m["steps"],
        train_rows=len(rows),
        eval_time_s=round(eval_s, 2),
        metrics=scores,
        adapter_dir=str(result.adapter_dir),
    )
    del result
    return record
