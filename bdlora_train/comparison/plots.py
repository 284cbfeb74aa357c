"""The sweep's plots: pareto.png (metric over trainable parameters, one line per method) and val_curves.png (the
validation metric at every grid point, one line per adapter, the chosen point circled)."""

from __future__ import annotations

import textwrap
from collections import defaultdict
from pathlib import Path

from bdlora_train.comparison import grid
from bdlora_train.comparison.summary import (
    METHOD_LABELS,
    configs,
    methods,
    model_label,
    row_specs,
    runs_by_key,
    selection,
)
from bdlora_train.core.files import atomic_file
from bdlora_train.tasks.metrics import mean_std

STYLES = {
    "lora": dict(marker="o", color="tab:blue"),
    "bdlora": dict(marker="s", color="tab:orange"),
    "peft-bdlora": dict(marker="^", color="tab:green", linestyle="--"),
}


def pareto(results: dict, path: Path) -> None:
    """pareto.png: see pareto_figure."""
    import matplotlib.pyplot as plt

    fig = pareto_figure(results)
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=DPI, format="png")
    plt.close(fig)


DPI = 120


def pareto_figure(results: dict):
    """A panel per task; one line per method over trainable params (log2), seed std as error bars; the figure title
    names the model. Tick labels that would overlap are thinned and point labels are placed where they overlap
    nothing (legend entries list every rank, so a label with no free spot is left out without losing anything)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, by_key = results["meta"], runs_by_key(results)
    tasks = meta["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.8), squeeze=False, dpi=DPI)
    tuned = ", each tuned on validation" if meta.get("grid") else ""
    title = f"{model_label(meta)}: LoRA vs BD-LoRA at matched budgets{tuned}"
    wrap = int(11 * fig.get_figwidth())  # characters of a 10-point title per line: ~11 an inch
    fig.suptitle(textwrap.fill(title, wrap, break_on_hyphens=False), fontsize=10)
    labels = []  # (ax, [(text, x, y)], lora params) per panel, placed once the layout is final
    for ax, task in zip(axes[0], tasks):
        metric = meta["primary_metric"][task]
        points: dict = defaultdict(dict)  # method -> r -> (params, mean, std)
        for entry in meta["plan"]:
            for _, method, spec in row_specs(meta, entry):
                recs = by_key.get((task, method, spec["r"]), {})
                if recs:
                    mean, std = mean_std(r["metrics"][metric] for r in recs.values())
                    points[method][spec["r"]] = (spec["params"], mean, std)
        texts = []
        for method in methods(meta):
            pts = sorted(points[method].items(), key=lambda kv: kv[1][0])
            if not pts:
                continue
            xs, ys, es = zip(*(p for _, p in pts))
            ranks = ", ".join(str(r) for r, _ in pts)
            label = METHOD_LABELS[method] + (f" nblocks {meta['nblocks']}" if method != "lora" else "") + f": r={ranks}"
            ax.errorbar(xs, ys, yerr=es, capsize=4, label=label, **STYLES[method])
            texts += [(f"r={r}", x, y) for r, (x, y, _) in pts]
        base = [r for r in results["runs"] if r["task"] == task and r["method"] == "base"]
        if base:
            ax.axhline(base[0]["metrics"][metric], color="gray", linestyle="--", linewidth=1, label="base model")
        ax.set_xscale("log", base=2)
        xs_all = sorted({p[0] for pts in points.values() for p in pts.values()})
        if xs_all:  # ticks at the budgets themselves: with 2-5 points the powers of two alone say little
            ax.set_xticks(xs_all, [_params_text(x) for x in xs_all], fontsize=8)
            ax.minorticks_off()
        ax.margins(x=0.15, y=0.15)
        _metric_ylim(ax, metric)
        ax.set_xlabel("trainable adapter parameters")
        ax.set_ylabel(metric + (" (%)" if metric == "accuracy" else ""))
        ax.set_title(f"{task} ({'higher' if meta['higher_is_better'][task] else 'lower'} is better)", fontsize=9)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
        lora = {p[0] for p in points.get("lora", {}).values()}
        labels.append((ax, texts, lora))
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    for ax, texts, lora in labels:
        _thin_ticks(ax, renderer, first=lora)
    for ax, texts, _ in labels:
        _place_labels(ax, texts, renderer)
    return fig


def _metric_ylim(ax, metric: str) -> None:
    """An accuracy axis stays within [0, 100] and is never a zero-height span: all-equal scores (a tiny model's
    0.00 everywhere) get a 2-point window instead of matplotlib's +-0.05 around the value and negative ticks."""
    if metric != "accuracy":
        return
    low, high = ax.get_ylim()
    if high - low < 2.0:
        middle = (low + high) / 2
        low, high = middle - 1.0, middle + 1.0
    low, high = max(low, 0.0), min(high, 100.0)
    if high - low < 2.0:  # pushed against a bound: keep the 2-point window inside [0, 100]
        low, high = (0.0, 2.0) if low == 0.0 else (98.0, 100.0)
    ax.set_ylim(low, high)


def _params_text(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e5 else f"{x:,.0f}"


def _overlaps(box, boxes, pad: float = 1.0) -> bool:
    return any(
        box.x0 < b.x1 + pad and b.x0 < box.x1 + pad and box.y0 < b.y1 + pad and b.y0 < box.y1 + pad for b in boxes
    )


def _thin_ticks(ax, renderer, first=()) -> None:
    """Keep the x tick labels (budgets) that overlap no kept one, LoRA's budgets first, then left to right."""
    ticks = list(ax.get_xticks())
    if len(ticks) < 2:
        return
    ax.figure.draw_without_rendering()
    boxes = {t: lab.get_window_extent(renderer) for t, lab in zip(ticks, ax.get_xticklabels())}
    kept: list = []
    for tick in sorted(ticks, key=lambda t: (t not in first, t)):
        if not _overlaps(boxes[tick], [boxes[k] for k in kept], pad=3.0):
            kept.append(tick)
    kept.sort()
    ax.set_xticks(kept, [_params_text(x) for x in kept], fontsize=8)
    ax.minorticks_off()


# Candidate label offsets in points, nearest first: right/left of the marker, above/below, then further out.
_OFFSETS = [(dx * k, dy * k) for k in (1, 2, 3, 4) for dx, dy in ((6, 3), (6, -3), (-6, 3), (-6, -3), (0, 6), (0, -6))]


def _place_labels(ax, texts, renderer) -> None:
    """Each "r=..." label at the first offset where it stays inside the axes and overlaps no other label, no tick
    label and no marker. A small greedy search: matplotlib places annotations only where told, and the usual helper
    (adjustText) is not a dependency and does not promise zero overlap either."""
    ax.figure.draw_without_rendering()
    frame = ax.get_window_extent(renderer)
    to_px = ax.transData.transform
    marker = 3.5 * ax.figure.dpi / 72  # half a marker's width (markersize 6 points, plus its edge), in pixels
    from matplotlib.transforms import Bbox

    obstacles = [Bbox.from_extents(*(to_px((x, y)) - marker), *(to_px((x, y)) + marker)) for _, x, y in texts]
    obstacles += [t.get_window_extent(renderer) for t in ax.get_xticklabels() + ax.get_yticklabels() if t.get_text()]
    placed = []
    for text, x, y in texts:
        for dx, dy in _OFFSETS:
            ann = ax.annotate(
                text,
                (x, y),
                textcoords="offset points",
                xytext=(dx, dy),
                fontsize=8,
                ha="left" if dx > 0 else "right" if dx < 0 else "center",
                va="bottom" if dy > 0 else "top",
            )
            box = ann.get_window_extent(renderer)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not _overlaps(box, placed + obstacles):
                placed.append(box)
                break
            ann.remove()


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
    fig, axes = plt.subplots(1, len(meta["tasks"]), figsize=(5.0 * len(meta["tasks"]), 3.8), squeeze=False)
    title = f"{model_label(meta)}: validation metric per grid point"
    fig.suptitle(textwrap.fill(title, int(11 * fig.get_figwidth()), break_on_hyphens=False), fontsize=10)
    for ax, task in zip(axes[0], meta["tasks"]):
        for i, (method, r) in enumerate(configs(meta)):
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
        _metric_ylim(ax, meta["primary_metric"][task])
        ax.set_ylabel(f"validation {meta['primary_metric'][task]}")
        ax.set_title(f"{task}: validation (circled: chosen)", fontsize=9)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a panel with nothing measured yet has nothing to list
            ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
