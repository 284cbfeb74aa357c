"""Hyper-parameter grids for `bdlora compare` and the choice of each method's setting on the validation split.

    axes = parse_grid(["lora_alpha_ratio=1,2"], lr_grid=["3e-4", "1e-3"])   # [(key, [raw values]), ...]
    points(axes)                  # the cartesian product: [(("learning_rate", "3e-4"), ("lora_alpha_ratio", "1")), ...]
    choose(stats, candidates, n_seeds, higher_is_better)   # the best setting on validation, mean over seeds

The choice reads validation scores only: a record's test metrics never enter it (tests/comparison/test_compare.py
trains a
task whose validation and test disagree and checks the choice follows validation). It is made per method and
budget on the MEAN over seeds, so seed noise cannot pick a lucky setting for one method and not for another.
"""

from __future__ import annotations

import itertools
import re

from bdlora_train.core.errors import CompareError
from bdlora_train.recipe.methods import BD_METHODS, keys_not_read_by

METHODS = ("lora", *BD_METHODS)
BUDGETS = ("lora", "matched", "double")

# Keys the sweep sets per run (method, rank, seed, paths): never a grid axis.
FIXED_KEYS = (
    "method",
    "lora_r",
    "nblocks",
    "match_budget_of_lora_rank",
    "seed",
    "output_dir",
    "run_name",
    "dataset",
    "resume_from_checkpoint",
    "push_to_hub",
    "hub_model_id",
    "model",
)


def parse_grid(items, lr_grid=None) -> list[tuple[str, list[str]]]:
    """`--grid KEY=v1,v2 ...` and `--lr-grid v1 v2 ...` (= learning_rate=v1,v2) as [(key, [raw value, ...])]."""
    from bdlora_train.recipe.schema import recipe_keys

    axes: list[tuple[str, list[str]]] = []
    if lr_grid:
        axes.append(("learning_rate", [str(v) for v in lr_grid]))
    for item in items or []:
        if "=" not in item:
            raise CompareError(f"compare: --grid '{item}' is not KEY=v1,v2 (e.g. --grid lora_alpha_ratio=1,2)")
        key, raw = (part.strip() for part in item.split("=", 1))
        values = [v.strip() for v in raw.split(",") if v.strip()]
        if key not in recipe_keys():
            raise CompareError(f"compare: --grid {key}: not a recipe key (see `bdlora train --help`)")
        if key in FIXED_KEYS:
            raise CompareError(f"compare: --grid {key}: the sweep sets it per run; grid another recipe key")
        if not values:
            raise CompareError(f"compare: --grid {key}= has no values; give at least one, e.g. {key}=a,b")
        if any(k == key for k, _ in axes):
            raise CompareError(f"compare: grid key {key} given twice (--lr-grid is learning_rate); merge the values")
        if len(set(values)) != len(values):
            raise CompareError(f"compare: --grid {key}={raw} repeats a value")
        axes.append((key, values))
    return axes


def points(axes) -> list[tuple[tuple[str, str], ...]]:
    """Every combination of the axes' values, in the order given (the first axis varies slowest); [()] for none."""
    if not axes:
        return [()]
    keys = [k for k, _ in axes]
    return [tuple(zip(keys, combo)) for combo in itertools.product(*(values for _, values in axes))]


def for_method(setting: dict, method: str) -> dict:
    """The part of a grid setting that applies to `method`: keys only block-diagonal methods read (bd_lr_ratio,
    bd_a_init) are dropped for LoRA and LoRA's own (loraplus_lr_ratio) for BD methods, so each method trains once per
    distinct setting of the keys it reads, and `--grid loraplus_lr_ratio=1,3 bd_lr_ratio=1,auto` gives each method
    its own factor-ratio axis."""
    ignored = keys_not_read_by(method) if method != "base" else ()
    return {k: v for k, v in setting.items() if k not in ignored}


def value_text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def label(setting: dict) -> str:
    """ "learning_rate=0.001 lora_alpha_ratio=2"; "default" for the empty setting."""
    return " ".join(f"{k}={value_text(v)}" for k, v in setting.items()) or "default"


def run_suffix(setting: dict) -> str:
    """The run-id suffix of a setting ("" for none): file-name safe, one per setting."""
    if not setting:
        return ""
    return "-" + re.sub(r"[^A-Za-z0-9_.=-]+", "_", "-".join(f"{k}={value_text(v)}" for k, v in setting.items()))


def is_numeric_axis(points: list[dict]) -> bool:
    """One grid key whose values are all numbers (e.g. learning_rate): plotted on a value axis, shown sorted."""
    keys = {k for p in points for k in p}
    return len(keys) == 1 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for p in points for v in p.values()
    )


def display_order(points: list[dict]) -> list[dict]:
    """Grid points for tables and plots: sorted by value on a single numeric axis, else in grid order."""
    return sorted(points, key=lambda p: next(iter(p.values()))) if is_numeric_axis(points) else list(points)


def choose(stats: list[dict], n_seeds: int, higher_is_better: bool) -> dict | None:
    """The best of `stats` ([{setting, mean, n, ...}] in grid order, validation metric over seeds) or None.

    Only settings measured on every seed compete; while none is (a sweep cut short), those with the most seeds do
    and the choice is marked provisional. Ties go to the earlier setting in grid order. Returns the chosen entry
    with `provisional` set.
    """
    measured = [s for s in stats if s["n"] > 0]
    if not measured:
        return None
    most = max(s["n"] for s in measured)
    pool = [s for s in measured if s["n"] == most]
    best = pool[0]
    for s in pool[1:]:
        if (s["mean"] > best["mean"]) if higher_is_better else (s["mean"] < best["mean"]):
            best = s
    provisional = most < n_seeds or len(pool) < len(stats)
    return {**best, "provisional": provisional}


def parse_methods(items) -> tuple[tuple[str, ...], dict]:
    """--methods: names, each optionally limited to some BD budgets ("peft-bdlora=matched"); (names, budgets)."""
    names, budgets = [], {}
    for item in items:
        name, _, only = item.partition("=")
        if name not in METHODS:
            raise CompareError(f"compare: --methods {name}: unknown; use some of {' '.join(METHODS)}")
        if only:
            chosen = [b for b in only.split(",") if b]
            if name == "lora" or any(b not in BUDGETS[1:] for b in chosen) or not chosen:
                raise CompareError(
                    f"compare: --methods {item}: a BD method takes budgets from {' '.join(BUDGETS[1:])} "
                    "(e.g. peft-bdlora=matched)"
                )
            budgets[name] = chosen
        names.append(name)
    return tuple(dict.fromkeys(names)), budgets


def typed_settings(axes, make_recipe) -> list[tuple]:
    """Each grid point as ((key, value), ...) with values typed and validated as the recipe reads them
    (`make_recipe(["key=value", ...])` builds the sweep's recipe with those overrides)."""
    settings = []
    for point in points(axes):
        if not point:
            return [()]
        point_recipe = make_recipe([f"{k}={v}" for k, v in point])
        values = tuple((k, getattr(point_recipe, k)) for k, _ in point)
        for key, value in values:
            if isinstance(value, (list, dict)):
                raise CompareError(f"compare: --grid {key}: only single values can be grid points, not {value!r}")
        settings.append(values)
    if len(set(settings)) != len(settings):
        raise CompareError(f"compare: grid {[(k, v) for k, v in axes]} has two values that read the same")
    return settings
