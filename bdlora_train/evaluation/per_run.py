"""What one sweep run reads and what it leaves behind.

Reads: the first `train_rows(recipe)` rows of the task's training order for the run's seed — max_steps x
per-device batch x gradient accumulation x world size when training by steps — so a sweep of 80 steps tokenizes
1,280 rows, not the task's 18,813; every method reads the same rows for the same seed.
Leaves: record.json, adapter/, metrics.json and recipe.yaml; checkpoint-<step>/ dirs (written when the recipe has
save_steps > 0) resume an interrupted run and are deleted once the run's record is written.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from bdlora_train.train import rundir
from bdlora_train.train.trainer import complete_checkpoints

# How each run's training rows are chosen: part of the fingerprint, so runs that read other rows are never mixed.
TRAIN_DATA_RULE = "first max_steps*batch*accumulation*world_size rows of the task's order for the seed"


def train_rows(recipe, world_size: int | None = None) -> int | None:
    """How many training rows one run reads: max_steps x per-device batch x gradient accumulation x world size
    (plus the rows eval_fraction holds out of them), capped by max_train_samples; None when training by epochs
    (every row is read)."""
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
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
