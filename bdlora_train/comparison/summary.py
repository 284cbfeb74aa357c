"""A sweep's records -> what its report and plots show: per (task, method, rank) the chosen setting's records,
one row per budget with mean ± std over seeds and the paired difference to LoRA, and the cost."""

from __future__ import annotations

import math
from collections import defaultdict

from bdlora_train.comparison import grid
from bdlora_train.tasks.metrics import binomial_stderr, mean_std

LABELS = {"lora": "LoRA", "matched": "BD-LoRA matched", "double": "BD-LoRA double"}
METHOD_LABELS = {"lora": "LoRA", "bdlora": "BD-LoRA", "peft-bdlora": "PEFT BD-LoRA"}


def row_label(budget: str, method: str) -> str:
    """ "LoRA", "BD-LoRA matched", "PEFT BD-LoRA double"."""
    return "LoRA" if budget == "lora" else f"{METHOD_LABELS[method]} {budget}"


def methods(meta: dict) -> list[str]:
    return meta.get("methods") or ["lora", "bdlora"]


def row_specs(meta: dict, entry: dict):
    """(budget, method, spec) of every row of one LoRA-rank entry of the plan, in table order."""
    if "lora" in methods(meta):
        yield "lora", "lora", entry["lora"]
    only = meta.get("method_budgets") or {}
    for budget in ("matched", "double"):
        for method in methods(meta):
            if method != "lora" and budget in only.get(method, ("matched", "double")):
                yield budget, method, {**entry[budget], "method": method}


def candidates(meta: dict, method: str) -> list[dict]:
    """The grid settings `method` trained (BD-only keys dropped for LoRA), in grid order; [{}] without a grid."""
    points = meta.get("grid_points") or [{}]
    out: list[dict] = []
    for point in points:
        own = grid.for_method(point, method)
        if own not in out:
            out.append(own)
    return out


def selection(results: dict) -> dict:
    """(task, method, r) -> {"records": {seed: record} of the chosen setting, "choice", "curve"}.

    Without a grid every record of the config is "chosen" and choice is None. With one, `curve` holds the
    validation statistics per grid setting over the tuning seeds (meta["grid_seeds"], default all) and `choice`
    the setting grid.choose picked from them: only `val_metrics` enter it, never the test `metrics`.
    """
    meta = results["meta"]
    by_setting: dict = defaultdict(lambda: defaultdict(dict))  # (task, method, r) -> setting label -> seed -> rec
    for rec in results["runs"]:
        by_setting[(rec["task"], rec["method"], rec["r"])][grid.label(rec.get("setting") or {})][rec["seed"]] = rec
    out = {}
    for key, settings in by_setting.items():
        task, method, _ = key
        if method == "base" or not meta.get("grid_points"):
            out[key] = {"records": settings.get("default", {}), "choice": None, "curve": []}
            continue
        tuning = meta.get("grid_seeds") or meta["seeds"]
        metric, n_seeds = meta["primary_metric"][task], len(tuning)
        curve = []
        for setting in candidates(meta, method):
            recs = settings.get(grid.label(setting), {})
            values = [recs[s]["val_metrics"][metric] for s in sorted(recs) if s in tuning and "val_metrics" in recs[s]]
            mean, std = mean_std(values)
            curve.append({"setting": setting, "label": grid.label(setting), "mean": mean, "std": std, "n": len(values)})
        choice = grid.choose(curve, n_seeds, meta["higher_is_better"][task])
        records = settings.get(choice["label"], {}) if choice else {}
        out[key] = {"records": records, "choice": choice, "curve": curve}
    return out


def runs_by_key(results: dict) -> dict:
    """(task, method, r) -> {seed: record} of the setting each config uses (the chosen one under a grid)."""
    return {key: sel["records"] for key, sel in selection(results).items()}


def model_label(meta: dict) -> str:
    """The model as a reader knows it: its name (the embedded spec: the checkpoint it ships) and the --model spec."""
    spec, name = str(meta["model"]), meta.get("model_name") or ""
    return f"{name} ({spec})" if name and name != spec else spec


def is_accuracy(metric: str) -> bool:
    """A percentage of test items answered right (the metrics carry "n", the items scored)."""
    return metric == "accuracy"


def summarize(results: dict) -> list[dict]:
    """One row per (task, LoRA rank, budget, method) with seed statistics of the task's primary metric on test
    (under a grid: of the setting chosen on validation), and the paired difference to LoRA."""
    meta, sel = results["meta"], selection(results)
    rows = []
    for task in meta["tasks"]:
        metric = meta["primary_metric"][task]
        for entry in meta["plan"]:
            lora_recs = sel.get((task, "lora", entry["lora"]["r"]), {}).get("records", {})
            for budget, method, spec in row_specs(meta, entry):
                chosen = sel.get((task, method, spec["r"]), {"records": {}, "choice": None})
                recs = chosen["records"]
                values = [recs[s]["metrics"][metric] for s in sorted(recs)]
                mean, std = mean_std(values)
                # Paired by seed: the same seed means the same training data order for both methods.
                paired = [
                    recs[s]["metrics"][metric] - lora_recs[s]["metrics"][metric] for s in sorted(recs) if s in lora_recs
                ]
                dmean, dstd = mean_std(paired) if budget != "lora" else (float("nan"), float("nan"))
                avg = lambda key: mean_std([recs[s][key] for s in recs if recs[s].get(key) is not None])[0]  # noqa: E731
                items = mean_std([recs[s]["metrics"]["n"] for s in recs if "n" in recs[s]["metrics"]])[0]
                stderr = binomial_stderr(mean, round(items)) if is_accuracy(metric) and items == items else math.nan
                choice = chosen["choice"]
                rows.append(
                    dict(
                        task=task,
                        metric=metric,
                        lora_rank=entry["lora_rank"],
                        budget=budget,
                        method=method,
                        label=row_label(budget, method),
                        r=spec["r"],
                        nblocks=spec["nblocks"],
                        params=spec["params"],
                        ratio=spec["ratio"],
                        n=len(values),
                        mean=mean,
                        std=std,
                        delta=dmean,
                        delta_std=dstd,
                        values=values,
                        n_items=items,
                        stderr=stderr,
                        chosen=choice["label"] if choice else None,
                        val_mean=choice["mean"] if choice else float("nan"),
                        provisional=bool(choice and choice["provisional"]),
                        train_s=avg("train_wall_time_s"),
                        tok_s=avg("tokens_per_second"),
                        peak_mb=avg("peak_memory_mb"),
                        adapter_mb=avg("adapter_file_size_bytes") / 2**20,
                        eval_s=avg("eval_time_s"),
                    )
                )
    return rows


def cost(results: dict) -> dict:
    """Trained runs and their summed train / eval seconds (every grid point counts: that is what tuning costs)."""
    trained = [r for r in results["runs"] if r["method"] != "base"]
    return {
        "runs": len(trained),
        "planned": results["meta"].get("planned_runs"),
        "train_s": sum(r.get("train_wall_time_s") or 0.0 for r in trained),
        "eval_s": sum(r.get("eval_time_s") or 0.0 for r in results["runs"]),
    }


def configs(meta: dict):
    """(method, r) of every adapter in the plan, once each, in table order."""
    seen = []
    for entry in meta["plan"]:
        for _, method, spec in row_specs(meta, entry):
            if (method, spec["r"]) not in seen:
                seen.append((method, spec["r"]))
    return seen


def seed_stderr(row: dict) -> float:
    """The standard error of a row's mean over seeds: std / sqrt(n) with 2 seeds or more; with one seed the only
    noise measured is the test set's, the binomial SE (NaN where there is none, e.g. perplexity)."""
    if row["n"] >= 2:
        return row["std"] / math.sqrt(row["n"])
    return row["stderr"] if row["n"] == 1 else math.nan


def verdicts(results: dict, rows: list[dict]) -> list[dict]:
    """Per row, how it stands against the base model and, for a BD-LoRA row, against LoRA at its LoRA rank — the
    bar every matched-budget claim of the docs is held to, for any objective:

    - `over_base`: the gain over the base model's score (sign: better is positive); for an accuracy also in binomial
      SEs of the row's mean (`over_base_se`), and `learns` when that is at least 2;
    - matched budget (<= LoRA's parameters): `holds` when its mean >= LoRA's mean - LoRA's SE over seeds;
    - double budget: `holds` when its mean >= LoRA's mean (a larger adapter must not learn worse).
    """
    meta, out = results["meta"], []
    for row in rows:
        task = row["task"]
        if not row["n"]:
            continue
        sign = 1.0 if meta["higher_is_better"][task] else -1.0
        base = [r for r in results["runs"] if r["task"] == task and r["method"] == "base"]
        v = {"row": row, "se": seed_stderr(row), "over_base": math.nan, "over_base_se": math.nan, "learns": None}
        if base:
            v["over_base"] = sign * (row["mean"] - base[0]["metrics"][row["metric"]])
            if row["stderr"] == row["stderr"] and row["stderr"] > 0:
                v["over_base_se"] = v["over_base"] / row["stderr"]
                v["learns"] = v["over_base_se"] >= 2.0
        lora = next((r for r in rows if r["task"] == task and r["lora_rank"] == row["lora_rank"]
                     and r["budget"] == "lora" and r["n"]), None)
        if row["budget"] != "lora" and lora is not None:
            gap = sign * (row["mean"] - lora["mean"])
            v["vs_lora"] = gap
            v["lora_se"] = seed_stderr(lora)
            slack = v["lora_se"] if row["budget"] == "matched" and v["lora_se"] == v["lora_se"] else 0.0
            v["holds"] = gap >= -slack
        out.append(v)
    return out
