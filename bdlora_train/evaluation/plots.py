"""The sweep's plots: pareto.png (metric over trainable parameters, one line per method) and val_curves.png (the
validation metric at every grid point, one line per adapter, the chosen point circled)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from bdlora_train.evaluation import grid
from bdlora_train.evaluation.metrics import mean_std
from bdlora_train.evaluation.report import (
    METHOD_LABELS,
    STYLES,
    _configs,
    _methods,
    _row_specs,
    _runs_by_key,
    selection,
)
from bdlora_train.files import atomic_file


def pareto(results: dict, path: Path) -> None:
    """pareto.png: a panel per task; one line per method over trainable params (log2), seed std as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, by_key = results["meta"], _runs_by_key(results)
    tasks = meta["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        metric = meta["primary_metric"][task]
        points: dict = defaultdict(dict)  # method -> r -> (params, mean, std)
        for entry in meta["plan"]:
            for _, method, spec in _row_specs(meta, entry):
                recs = by_key.get((task, method, spec["r"]), {})
                if recs:
                    mean, std = mean_std(r["metrics"][metric] for r in recs.values())
                    points[method][spec["r"]] = (spec["params"], mean, std)
        for method in _methods(meta):
            pts = sorted(points[method].items(), key=lambda kv: kv[1][0])
            if not pts:
                continue
            xs, ys, es = zip(*(p for _, p in pts))
            label = METHOD_LABELS[method] + (f" (nblocks {meta['nblocks']})" if method != "lora" else "")
            ax.errorbar(xs, ys, yerr=es, capsize=4, label=label, **STYLES[method])
            for r, (x, y, _) in pts:
                ax.annotate(f"r={r}", (x, y), textcoords="offset points", xytext=(4, 6), fontsize=8)
        base = [r for r in results["runs"] if r["task"] == task and r["method"] == "base"]
        if base:
            ax.axhline(base[0]["metrics"][metric], color="gray", linestyle="--", linewidth=1, label="base model")
        ax.set_xscale("log", base=2)
        xs_all = sorted({p[0] for pts in points.values() for p in pts.values()})
        if xs_all:  # ticks at the budgets themselves: with 2-5 points the powers of two alone say little
            ax.set_xticks(xs_all, [f"{x / 1e6:.2f}M" if x >= 1e5 else f"{x:,}" for x in xs_all], fontsize=8)
            ax.minorticks_off()
        ax.margins(x=0.12, y=0.12)
        ax.set_xlabel("trainable adapter parameters")
        ax.set_ylabel(metric + (" (%)" if metric == "accuracy" else ""))
        tuned = " — tuned on validation" if meta.get("grid") else ""
        ax.set_title(
            f"{task} — {meta['model']} ({'higher' if meta['higher_is_better'][task] else 'lower'} is better){tuned}",
            fontsize=9,
        )
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def val_curves(results: dict, path: Path) -> None:
    """val_curves.png: per task, the validation metric at every grid setting, one line per adapter, the chosen
    setting circled. A single numeric axis (e.g. learning_rate) is the x axis (log scale when it spans >= 10x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, sel = results["meta"], selection(results)
    points = grid.display_order(meta["grid_points"])
    keys = [k for k, _ in meta["grid"]]
    numeric = grid.is_numeric_axis(points)
    fig, axes = plt.subplots(1, len(meta["tasks"]), figsize=(5.0 * len(meta["tasks"]), 3.6), squeeze=False)
    for ax, task in zip(axes[0], meta["tasks"]):
        for i, (method, r) in enumerate(_configs(meta)):
            entry = sel.get((task, method, r))
            if not entry:
                continue
            by_label = {c["label"]: c for c in entry["curve"]}
            xs, ys, es, chosen = [], [], [], None
            for j, point in enumerate(points):
                c = by_label.get(grid.label(grid.for_method(point, method)))
                if c and c["n"]:
                    x = point[keys[0]] if numeric else j
                    xs.append(x)
                    ys.append(c["mean"])
                    es.append(c["std"])
                    if entry["choice"] and c["label"] == entry["choice"]["label"]:
                        chosen = (x, c["mean"])
            if not xs:
                continue
            style = {**STYLES[method], "alpha": 1.0 if i % 2 == 0 else 0.6}
            ax.errorbar(xs, ys, yerr=es, capsize=3, label=f"{METHOD_LABELS[method]} r={r}", **style)
            if chosen:
                ax.plot(*chosen, marker="o", markersize=13, fillstyle="none", color="black", linestyle="none")
        if numeric:
            values = [p[keys[0]] for p in points]
            if min(values) > 0 and max(values) / min(values) >= 10:
                ax.set_xscale("log")
            ax.set_xticks(values, [grid.value_text(v) for v in values], fontsize=8)
            ax.minorticks_off()
            ax.set_xlabel(keys[0])
        else:
            ax.set_xticks(range(len(points)), [grid.label(p) for p in points], fontsize=7, rotation=20, ha="right")
        ax.set_ylabel(f"validation {meta['primary_metric'][task]}")
        ax.set_title(f"{task}: validation (circled: chosen)", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
