"""A sweep's records in --out: each finished run's record.json, written atomically, and the fingerprint of the shared
settings every run in one --out must have been made with (a re-run resumes only runs that match it)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from bdlora_train.comparison import grid
from bdlora_train.core.errors import CompareError
from bdlora_train.core.files import atomic_write_text

# Keys the sweep sets per run (grid.FIXED_KEYS but `model`, which is shared); everything else of the recipe is shared
# and must match on resume.
PER_RUN_KEYS = tuple(key for key in grid.FIXED_KEYS if key != "model")


def write_json_atomic(path: Path, data) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def shared_recipe_fingerprint(recipe, grid_keys=()) -> dict:
    """The recipe fields every run shares: two sweeps may only mix in one --out when these are equal (lora_alpha
    too, unless lora_alpha_ratio derives it from each run's rank)."""
    fields = recipe.flat()
    return {k: v for k, v in without_derived(fields).items() if k not in PER_RUN_KEYS and k not in grid_keys}


def without_derived(recipe_fields: dict) -> dict:
    """`recipe_fields` less the keys each run derives: lora_alpha when lora_alpha_ratio sets it from the rank.
    Applied to stored fingerprints too, which kept lora_alpha before this rule existed."""
    derived = ("lora_alpha",) if recipe_fields.get("lora_alpha_ratio") is not None else ()
    return {k: v for k, v in recipe_fields.items() if k not in derived}


def base_fingerprint(fingerprint: dict) -> dict:
    """What the base model's zero-shot score depends on: no training key, only how the base is loaded (its
    quantization) and how it is scored; a sweep that changes the steps still reuses the base score it has."""
    from bdlora_train.quant.keys import QuantKeys

    quant = {f.name for f in dataclasses.fields(QuantKeys)}
    kept = {k: v for k, v in fingerprint.items() if k not in ("recipe", "train_data")}
    return {**kept, "recipe": {k: v for k, v in fingerprint.get("recipe", {}).items() if k in quant}}


def load_records(out: Path, fingerprint: dict) -> dict:
    """Finished runs in --out; refuses to mix runs made with other shared settings into one table."""
    records = {}
    for path in sorted((out / "runs").glob("*/record.json")):
        record = json.loads(path.read_text())
        if "splits" not in (record.get("fingerprint") or {}):
            raise CompareError(
                f"compare: {path.parent} was made before tasks had a validation split (its training data differs); "
                "use a new --out or delete that run"
            )
        if "train_data" not in record["fingerprint"]:
            raise CompareError(
                f"compare: {path.parent} was made before each run trained on only the rows it reads (it read other "
                "rows of the task); use a new --out or delete that run"
            )
        old = record.get("fingerprint") or {}
        old = {**old, "recipe": without_derived(old["recipe"])} if "recipe" in old else old
        if record.get("method") == "base":  # never trained: only how it is loaded and scored must match
            old, now = base_fingerprint(old), base_fingerprint(fingerprint)
        else:
            now = fingerprint
        diff = _diff(old, now)
        if diff:
            raise CompareError(
                f"compare: {path.parent} was made with other settings ({diff}); use a new --out or delete that run"
            )
        records[record["run_id"]] = record
    return records


def _diff(old: dict, new: dict, prefix: str = "") -> str:
    """The first shared setting that differs; keys the old record lacks (added to the code since) are skipped."""
    for key in sorted(old):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            inner = _diff(a, b, f"{prefix}{key}.")
            if inner:
                return inner
        elif a != b:
            return f"{prefix}{key}: {a!r} then, {b!r} now"
    return ""
