"""results.json -> results.md (tables grouped by budget, mean ± std over seeds, BD-LoRA − LoRA delta) and
pareto.png (primary metric against trainable parameters, log2 x axis, one line per method, std error bars)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from bdlora_train.evaluation.metrics import mean_std
from bdlora_train.files import atomic_file, atomic_write_text

LABELS = {"lora": "LoRA", "matched": "BD-LoRA matched", "double": "BD-LoRA double"}


def _runs_by_key(results: dict) -> dict:
    """(task, method, r) -> {seed: record}."""
    table: dict = defaultdict(dict)
    for rec in results["runs"]:
        table[(rec["task"], rec["method"], rec["r"])][rec["seed"]] = rec
    return table


def _fmt(value: float, digits: int = 1) -> str:
    return "n/a" if value != value else f"{value:.{digits}f}"  # NaN check without math import


def summarize(results: dict) -> list[dict]:
    """One row per (task, LoRA rank, budget) with seed statistics of the task's primary metric."""
    meta, by_key = results["meta"], _runs_by_key(results)
    rows = []
    for task in meta["tasks"]:
        metric = meta["primary_metric"][task]
        for entry in meta["plan"]:
            lora_recs = by_key.get((task, "lora", entry["lora"]["r"]), {})
            for budget in ("lora", "matched", "double"):
                spec = entry[budget]
                recs = by_key.get((task, spec["method"], spec["r"]), {})
                values = [recs[s]["metrics"][metric] for s in sorted(recs)]
                mean, std = mean_std(values)
                # Paired by seed: the same seed means the same training data order for both methods.
                paired = [
                    recs[s]["metrics"][metric] - lora_recs[s]["metrics"][metric] for s in sorted(recs) if s in lora_recs
                ]
                dmean, dstd = mean_std(paired) if budget != "lora" else (float("nan"), float("nan"))
                avg = lambda key: mean_std([recs[s][key] for s in recs if recs[s].get(key) is not None])[0]  # noqa: E731
                rows.append(
                    dict(
                        task=task,
                        metric=metric,
                        lora_rank=entry["lora_rank"],
                        budget=budget,
                        method=spec["method"],
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
                        train_s=avg("train_wall_time_s"),
                        tok_s=avg("tokens_per_second"),
                        peak_mb=avg("peak_memory_mb"),
                        adapter_mb=avg("adapter_file_size_bytes") / 2**20,
                        eval_s=avg("eval_time_s"),
                    )
                )
    return rows


def markdown(results: dict) -> str:
    meta = results["meta"]
    rows = summarize(results)
    recipe = meta["recipe"]
    lines = [
        f"# LoRA vs BD-LoRA at matched parameter budgets — {meta['model']}",
        "",
        f"nblocks {meta['nblocks']}, seeds {meta['seeds']}, {recipe['max_steps']} steps, batch "
        f"{recipe['per_device_train_batch_size']}, lr {recipe['learning_rate']}, alpha ratio "
        f"{recipe.get('lora_alpha_ratio')}, "
        f"rsLoRA {recipe['use_rslora']}; identical recipe and data for every method.",
        f"Command: `{meta['command']}`",
    ]
    if "sweep_wall_time_s" in meta:
        lines.append(f"Sweep wall time (this invocation): {meta['sweep_wall_time_s'] / 60:.1f} min.")
    for task in meta["tasks"]:
        metric = meta["primary_metric"][task]
        better = "higher" if meta["higher_is_better"][task] else "lower"
        unit = " (%)" if metric == "accuracy" else ""
        lines += ["", f"## {task}: {metric}{unit}, {better} is better", ""]
        base = [r for r in results["runs"] if r["task"] == task and r["method"] == "base"]
        if base:
            lines += [f"Base model without adapter: {_fmt(base[0]['metrics'][metric], 2)}", ""]
        lines += [
            f"| budget (LoRA r) | method | r | nblocks | trainable params | x LoRA | {metric} mean ± std (seeds) | "
            "Δ vs LoRA (paired) | train s | tok/s | peak MB | adapter MB |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in (r for r in rows if r["task"] == task):
            delta = (
                ""
                if row["budget"] == "lora"
                else (f"{row['delta']:+.2f} ± {_fmt(row['delta_std'], 2)}" if row["n"] else "")
            )
            score = f"{_fmt(row['mean'], 2)} ± {_fmt(row['std'], 2)} ({row['n']})" if row["n"] else "not run yet"
            lines.append(
                f"| {row['lora_rank']} | {LABELS[row['budget']]} | {row['r']} | {row['nblocks']} | {row['params']:,} | "
                f"{row['ratio']:.2f} | {score} | {delta} | {_fmt(row['train_s'])} | {_fmt(row['tok_s'], 0)} | "
                f"{_fmt(row['peak_mb'], 0)} | {_fmt(row['adapter_mb'], 2)} |"
            )
        lines += _category_table(results, task)
    return "\n".join(lines) + "\n"


def _category_table(results: dict, task: str) -> list[str]:
    """Per-category accuracy (mean over seeds) for tasks that report categories."""
    by_config: dict = defaultdict(list)
    for rec in results["runs"]:
        if rec["task"] == task:
            label = "base" if rec["method"] == "base" else f"{'LoRA' if rec['method'] == 'lora' else 'BD'} r{rec['r']}"
            by_config[(rec["method"] != "base", rec.get("trainable_params", 0), rec["method"], label)].append(
                rec["metrics"]
            )
    cats = sorted({k.split("/", 1)[1] for ms in by_config.values() for m in ms for k in m if k.startswith("accuracy/")})
    if not cats:
        return []
    configs = sorted(by_config)
    lines = [
        "",
        f"Per category ({task}, accuracy %, mean over seeds):",
        "",
        "| category | " + " | ".join(c[3] for c in configs) + " |",
        "|---|" + "---:|" * len(configs),
    ]
    for cat in cats:
        cells = [_fmt(mean_std([m.get(f"accuracy/{cat}", float("nan")) for m in by_config[c]])[0]) for c in configs]
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    return lines


def plot(results: dict, path: Path) -> None:
    """pareto.png: a panel per task; LoRA and BD-LoRA lines over trainable params (log2), seed std as error bars."""
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
            for budget in ("lora", "matched", "double"):
                spec = entry[budget]
                recs = by_key.get((task, spec["method"], spec["r"]), {})
                if recs:
                    mean, std = mean_std(r["metrics"][metric] for r in recs.values())
                    points[spec["method"]][spec["r"]] = (spec["params"], mean, std)
        for method, style in (
            ("lora", dict(marker="o", color="tab:blue")),
            ("bdlora", dict(marker="s", color="tab:orange")),
        ):
            pts = sorted(points[method].items(), key=lambda kv: kv[1][0])
            if not pts:
                continue
            xs, ys, es = zip(*(p for _, p in pts))
            label = "LoRA" if method == "lora" else f"BD-LoRA (nblocks {meta['nblocks']})"
            ax.errorbar(xs, ys, yerr=es, capsize=4, label=label, **style)
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
        ax.set_title(f"{task} — {meta['model']} ({'higher' if meta['higher_is_better'][task] else 'lower'} is better)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def write_all(results: dict, out: Path) -> None:
    """results.json, results.md and pareto.png in `out`, each written to a temp file and renamed into place."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("results.json", json.dumps(results, indent=2, default=str) + "\n"),
        ("results.md", markdown(results)),
    ):
        atomic_write_text(out / name, text)
    plot(results, out / "pareto.png")
