"""results.json -> results.md (tables grouped by budget, mean ± std over seeds, the binomial standard error of an
accuracy, BD-LoRA − LoRA delta); `write_all` writes it with results.json and the plots (plots.py)."""

from __future__ import annotations

import json
from pathlib import Path

from bdlora_train.comparison import grid, plots
from bdlora_train.comparison.summary import (
    METHOD_LABELS,
    configs,
    cost,
    is_accuracy,
    model_label,
    runs_by_key,
    selection,
    summarize,
    verdicts,
)
from bdlora_train.core.files import atomic_write_text
from bdlora_train.tasks.metrics import mean_std


def _fmt(value: float, digits: int = 1) -> str:
    return "n/a" if value != value else f"{value:.{digits}f}"  # NaN check without math import


def duration(seconds: float) -> str:
    """A time a reader can compare: "2.4 s", "3.5 min", "1.2 h" (never "0.0 min" for a run of seconds)."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def markdown(results: dict) -> str:
    """results.md: the header (recipe, grid, command, cost), then per task its table, grid curve and categories."""
    rows = summarize(results)
    lines = _header(results, rows)
    for task in results["meta"]["tasks"]:
        lines += _task_table(results, [r for r in rows if r["task"] == task], task)
        if results["meta"].get("grid"):
            lines += _curve_table(results, task)
        lines += _category_table(results, task)
    return "\n".join(lines) + "\n"


def _header(results: dict, rows: list[dict]) -> list[str]:
    meta = results["meta"]
    recipe = meta["recipe"]
    axes = meta.get("grid") or []
    tuned = ", ".join(f"{k} ∈ {{{', '.join(grid.value_text(v) for v in vals)}}}" for k, vals in axes)
    bd_lr_ratio = recipe.get("bd_lr_ratio", 1.0)  # results written before the key existed trained at 1
    shared = (
        f"lr {recipe['learning_rate']}, {alpha_text(recipe)}, rsLoRA {recipe['use_rslora']}, "
        f"bd_lr_ratio {'auto = nblocks' if bd_lr_ratio == 'auto' else bd_lr_ratio} (BD), "
        f"loraplus_lr_ratio {recipe.get('loraplus_lr_ratio', 1.0)} (LoRA)"
    )
    tuning_seeds = meta.get("grid_seeds") or meta["seeds"]
    if axes:
        how = (
            f" (except the grid); same data for every method. Grid: {tuned}. Each method and budget uses the "
            f"setting with the best validation mean over seeds {tuning_seeds} (validation: items carved from the "
            "training data, disjoint from test); the test scores below are that setting's only"
            + (", and the other seeds trained that setting alone." if len(tuning_seeds) < len(meta["seeds"]) else ".")
        )
    else:
        how = "; identical recipe and data for every method."
    lines = [
        f"# LoRA vs BD-LoRA at matched parameter budgets — {model_label(meta)}",
        "",
        f"nblocks {meta['nblocks']}, seeds {meta['seeds']}, {recipe['max_steps']} steps, batch "
        f"{recipe['per_device_train_batch_size']}, {shared}{how}",
        f"Command: `{meta['command']}`",
    ]
    if "sweep_wall_time_s" in meta:
        lines.append(f"Sweep wall time (this invocation): {duration(meta['sweep_wall_time_s'])}.")
    c = cost(results)
    planned = f" of {c['planned']} planned" if c["planned"] else ""
    lines.append(
        f"Cost: {c['runs']} trained runs{planned}; summed over runs {duration(c['train_s'])} training and "
        f"{duration(c['eval_s'])} evaluation."
    )
    if any(r["provisional"] for r in rows):
        lines.append("Choices marked * are provisional: not every grid point has every seed yet.")
    return lines


def alpha_text(recipe: dict) -> str:
    """How the sweep set lora_alpha: a ratio of each run's rank, or one fixed value for every run."""
    ratio = recipe.get("lora_alpha_ratio")
    return f"alpha ratio {ratio}" if ratio is not None else f"lora_alpha {recipe.get('lora_alpha')} (fixed)"


def _task_table(results: dict, rows: list[dict], task: str) -> list[str]:
    """One task's table: a row per budget and method, mean ± std over seeds, paired Δ vs LoRA, cost columns."""
    meta = results["meta"]
    axes = meta.get("grid") or []
    metric = meta["primary_metric"][task]
    better = "higher" if meta["higher_is_better"][task] else "lower"
    unit = " (%)" if metric == "accuracy" else ""
    lines = ["", f"## {task}: {metric}{unit}, {better} is better", ""]
    base = [r for r in results["runs"] if r["task"] == task and r["method"] == "base"]
    if base:
        lines += [f"Base model without adapter: {_fmt(base[0]['metrics'][metric], 2)}", ""]
    tuned_cols = "chosen on validation | validation mean | " if axes else ""
    se = is_accuracy(metric)
    lines += [
        f"| budget (LoRA r) | method | r | nblocks | trainable params | x LoRA | {tuned_cols}"
        f"{metric} mean ± std (seeds) | "
        + ("binomial SE (test items) | " if se else "")
        + "Δ vs LoRA (paired) | train s | tok/s | peak MB | adapter MB |",
        "|---|---|---:|---:|---:|---:|"
        + ("---|---:|" if axes else "")
        + "---:|"
        + ("---:|" if se else "")
        + "---:|---:|---:|---:|---:|",
    ]
    lines += [_row_line(row, bool(axes), se) for row in rows]
    lines += _verdict_lines(results, rows)
    if se:
        lines += [
            "",
            "Binomial SE: the standard error sqrt(p(1−p)/n) of one run's accuracy p (the mean over seeds) on its n "
            "test items, in points: how much the finite test set alone moves a score (0 at p = 0 or 100%, where "
            "the formula says nothing). ± std is the spread over seeds; every run is scored on the same test "
            "items.",
        ]
    return lines


def _verdict_lines(results: dict, rows: list[dict]) -> list[str]:
    """The verdict (summary.verdicts): each row's mean ± SE over seeds, its gain over the base model and, for
    BD-LoRA, whether it meets its budget's bar against LoRA."""
    found = verdicts(results, rows)
    if not found:
        return []
    lines = ["", "Verdict (mean ± SE over seeds: std / √seeds, with one seed the binomial SE; matched budget: at "
             "least LoRA's mean − 1 SE; double budget: at least LoRA's mean):", ""]
    for v in found:
        row = v["row"]
        text = f"- {row['label']} r={row['r']} ({row['ratio']:.2f}x): {_fmt(row['mean'], 2)} ± {_fmt(v['se'], 2)}"
        if v["over_base"] == v["over_base"]:
            text += f"; {v['over_base']:+.2f} over the base"
            if v["learns"] is not None:
                learns = "learns" if v["learns"] else "not 2 SE above the base"
                text += f" = {v['over_base_se']:.1f} binomial SE ({learns})"
        if "holds" in v:
            bar = "LoRA − 1 SE" if row["budget"] == "matched" else "LoRA"
            text += f"; {v['vs_lora']:+.2f} vs LoRA: {'holds' if v['holds'] else 'below'} (bar: {bar})"
        lines.append(text)
    return lines


def _row_line(row: dict, tuned: bool, se: bool) -> str:
    delta = (
        ""
        if row["budget"] == "lora" or row["delta"] != row["delta"]
        else (f"{row['delta']:+.2f} ± {_fmt(row['delta_std'], 2)}" if row["n"] else "")
    )
    score = f"{_fmt(row['mean'], 2)} ± {_fmt(row['std'], 2)} ({row['n']})" if row["n"] else "not run yet"
    if se:
        items = f" ({row['n_items']:.0f})" if row["n_items"] == row["n_items"] else ""
        score += f" | {_fmt(row['stderr'], 2)}{items}" if row["n"] else " | "
    choice = ""
    if tuned:
        mark = "*" if row["provisional"] else ""
        choice = f"{row['chosen'] or 'not run yet'}{mark} | {_fmt(row['val_mean'], 2)} | "
    return (
        f"| {row['lora_rank']} | {row['label']} | {row['r']} | {row['nblocks']} | {row['params']:,} | "
        f"{row['ratio']:.2f} | {choice}{score} | {delta} | {_fmt(row['train_s'])} | {_fmt(row['tok_s'], 0)} | "
        f"{_fmt(row['peak_mb'], 0)} | {_fmt(row['adapter_mb'], 2)} |"
    )


def _curve_table(results: dict, task: str) -> list[str]:
    """Validation metric (mean ± std over seeds) at every grid setting, per adapter; the chosen one in bold."""
    meta, sel = results["meta"], selection(results)
    points = grid.display_order(meta["grid_points"])
    lines = [
        "",
        f"Validation {meta['primary_metric'][task]} per grid setting (mean ± std over the tuning seeds; **chosen**):",
        "",
        "| adapter | " + " | ".join(grid.label(p) for p in points) + " |",
        "|---|" + "---:|" * len(points),
    ]
    for method, r in configs(meta):
        entry = sel.get((task, method, r))
        if not entry:
            continue
        by_label = {c["label"]: c for c in entry["curve"]}
        chosen = entry["choice"]["label"] if entry["choice"] else None
        cells = []
        for point in points:
            c = by_label.get(grid.label(grid.for_method(point, method)))
            if not c or not c["n"]:
                cells.append("")
                continue
            text = f"{_fmt(c['mean'], 2)} ± {_fmt(c['std'], 2)}" + (
                f" ({c['n']})" if c["n"] < len(meta.get("grid_seeds") or meta["seeds"]) else ""
            )
            cells.append(f"**{text}**" if c["label"] == chosen else text)
        lines.append(f"| {METHOD_LABELS[method]} r={r} | " + " | ".join(cells) + " |")
    return lines


def _category_table(results: dict, task: str) -> list[str]:
    """Per-category accuracy (mean over seeds, the chosen setting under a grid) for tasks with categories."""
    chosen = runs_by_key(results)
    columns = []  # (label, [metrics of each seed]) in the main table's order: base, then LoRA, matched, double
    for method, r in [("base", 0), *configs(results["meta"])]:
        recs = chosen.get((task, method, r), {})
        if recs:
            label = "base" if method == "base" else f"{METHOD_LABELS[method]} r={r}"
            columns.append((label, [rec["metrics"] for rec in recs.values()]))
    cats = sorted({k.split("/", 1)[1] for _, ms in columns for m in ms for k in m if k.startswith("accuracy/")})
    if not cats:
        return []
    lines = [
        "",
        f"Per category ({task}, accuracy %, mean over seeds):",
        "",
        "| category | " + " | ".join(label for label, _ in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for cat in cats:
        cells = [_fmt(mean_std([m.get(f"accuracy/{cat}", float("nan")) for m in ms])[0]) for _, ms in columns]
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    return lines


def write_all(results: dict, out: Path) -> None:
    """results.json, results.md, pareto.png (and val_curves.png with a grid) in `out`, each written to a temp
    file and renamed into place."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("results.json", json.dumps(results, indent=2, default=str) + "\n"),
        ("results.md", markdown(results)),
    ):
        atomic_write_text(out / name, text)
    plots.pareto(results, out / "pareto.png")
    if results["meta"].get("grid_points"):
        plots.val_curves(results, out / "val_curves.png")
