"""The verdict tables of this directory's sweeps: BD-LoRA vs LoRA at matched budgets, at the toolkit defaults and at
each method's validation-best setting, 3 seeds, paired by seed. Reads the records run.sh copied next to this file
(<task>/tuned/results.json, <task>/defaults/records/*.json) and writes verdict.md and verdict.json here.

    .venv/bin/python eval/results/smollm2-135m-quality/verdict.py

Defaults: lr 1e-3, LoRA plain, BD-LoRA at bd_lr_ratio 1 and at auto; seed 0 of them is tuned/'s lr=1e-3 grid point
(LoRA at loraplus_lr_ratio 1), seeds 1-2 come from defaults/. Tuned: the setting `bdlora compare` chose per adapter
on validation (seed 0), its test scores on seeds 0-2. The choice is the toolkit's own (evaluation.summary.selection).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repository, for bdlora_train

from bdlora_train.comparison.summary import selection  # noqa: E402
from bdlora_train.tasks.metrics import binomial_stderr, mean_std  # noqa: E402

TASKS = {"analogies": ("accuracy", True), "news-ppl": ("perplexity", False)}
SEEDS = (0, 1, 2)
# (label, BD-LoRA rank, LoRA rank) at the paper's budgets
PAIRS = [("0.90x LoRA r=8", 12, 8), ("1.79x LoRA r=8", 24, 8), ("0.90x LoRA r=16", 24, 16)]
DEFAULT_LR = 1e-3
GRID_POINTS = [
    {"learning_rate": lr, "loraplus_lr_ratio": lp, "bd_lr_ratio": bd}
    for lr in (1e-3, 3e-3)
    for lp in (1.0, 3.0)
    for bd in (1.0, "auto")
]


def _records(path: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(path.glob("*.json"))]


def defaults(task: str) -> dict:
    """(method, r, bd_lr_ratio or None) -> {seed: record} at the toolkit defaults."""
    out: dict = {}
    for rec in _records(HERE / task / "tuned" / "records"):
        s = rec.get("setting") or {}
        if rec["seed"] != 0 or rec["method"] == "base" or s.get("learning_rate") != DEFAULT_LR:
            continue
        if rec["method"] == "lora" and s.get("loraplus_lr_ratio") == 1.0:
            out.setdefault(("lora", rec["r"], None), {})[0] = rec
        elif rec["method"] == "bdlora":
            out.setdefault(("bdlora", rec["r"], s["bd_lr_ratio"]), {})[0] = rec
    for rec in _records(HERE / task / "defaults" / "records"):
        if rec["method"] == "base":
            continue
        ratio = (rec.get("setting") or {}).get("bd_lr_ratio") if rec["method"] == "bdlora" else None
        out.setdefault((rec["method"], rec["r"], ratio), {})[rec["seed"]] = rec
    return out


def tuned(task: str) -> tuple[dict, dict]:
    """(method, r) -> {seed: record} of the setting chosen on validation, and (method, r) -> its label."""
    path = HERE / task / "tuned" / "results.json"
    if not path.is_file():
        return {}, {}
    results = json.loads(path.read_text())
    results["runs"] = _records(HERE / task / "tuned" / "records")  # every copied record, also those of later sweeps
    # the grid of run.sh's TUNED, chosen on seed 0 (whatever the last sweep's own meta says: run.sh trains some
    # points first with a smaller grid)
    results["meta"].update(grid_points=GRID_POINTS, grid_seeds=[0], seeds=list(SEEDS))
    sel = selection(results)
    recs = {(m, r): v["records"] for (t, m, r), v in sel.items() if t == task and m != "base"}
    labels = {
        (m, r): v["choice"]["label"] + (" (provisional: grid incomplete)" if v["choice"]["provisional"] else "")
        for (t, m, r), v in sel.items()
        if t == task and v["choice"]
    }
    return recs, labels


def _stats(recs: dict, metric: str, higher: bool) -> dict:
    values = [recs[s]["metrics"][metric] for s in SEEDS if s in recs]
    mean, std = mean_std(values)
    items = [recs[s]["metrics"].get("n") for s in SEEDS if s in recs]
    se = binomial_stderr(mean, items[0]) if higher and items and items[0] else math.nan
    return {"n": len(values), "mean": mean, "std": std, "values": values, "binomial_se": se}


def _paired(bd: dict, lora: dict, metric: str, relative: bool) -> dict:
    seeds = [s for s in SEEDS if s in bd and s in lora]
    diffs = []
    for s in seeds:
        b, a = bd[s]["metrics"][metric], lora[s]["metrics"][metric]
        diffs.append(100 * (b - a) / a if relative else b - a)
    mean, std = mean_std(diffs)
    return {"seeds": seeds, "mean": mean, "std": std, "values": diffs}


def verdict() -> dict:
    out = {}
    for task, (metric, higher) in TASKS.items():
        d = defaults(task)
        t, labels = tuned(task)
        rows = []
        for label, bd_r, lora_r in PAIRS:
            lora_def, lora_tuned = d.get(("lora", lora_r, None), {}), t.get(("lora", lora_r), {})
            conditions = {
                "defaults, bd_lr_ratio 1": (d.get(("bdlora", bd_r, 1.0), {}), lora_def),
                "defaults, bd_lr_ratio auto": (d.get(("bdlora", bd_r, "auto"), {}), lora_def),
                "tuned (each at its best on validation)": (t.get(("bdlora", bd_r), {}), lora_tuned),
            }
            for condition, (bd, lora) in conditions.items():
                if not bd or not lora:
                    continue
                rows.append(
                    {
                        "budget": label,
                        "bd_r": bd_r,
                        "lora_r": lora_r,
                        "condition": condition,
                        "bd": _stats(bd, metric, higher),
                        "lora": _stats(lora, metric, higher),
                        "bd_setting": labels.get(("bdlora", bd_r)) if condition.startswith("tuned") else None,
                        "lora_setting": labels.get(("lora", lora_r)) if condition.startswith("tuned") else None,
                        "delta": _paired(bd, lora, metric, relative=False),
                        "delta_pct": _paired(bd, lora, metric, relative=True),
                    }
                )
        runs = [
            r for sub in ("tuned", "defaults") for r in _records(HERE / task / sub / "records") if r["method"] != "base"
        ]
        out[task] = {
            "metric": metric,
            "higher_is_better": higher,
            "rows": rows,
            "chosen": {f"{m} r={r}": v for (m, r), v in sorted(labels.items())},
            "cost": {
                "trained_runs": len(runs),
                "train_min": sum(r.get("train_wall_time_s") or 0 for r in runs) / 60,
                "eval_min": sum(r.get("eval_time_s") or 0 for r in runs) / 60,
            },
        }
    return out


def _pm(s: dict, digits: int) -> str:
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f} ({s['n']})" if s["n"] else "n/a"


def markdown(v: dict) -> str:
    lines = [
        "# Verdict: BD-LoRA vs LoRA at matched budgets, SmolLM2-135M, nblocks 3",
        "",
        "Mean ± std over seeds (n); Δ = BD-LoRA − LoRA paired by seed (mean ± std of the per-seed differences);",
        "for perplexity also in % of LoRA's (negative: BD-LoRA better). Accuracy: binomial SE of one run, points.",
        "Generated by `verdict.py` from the records in this directory.",
    ]
    for task, t in v.items():
        digits = 2
        unit = "points" if t["higher_is_better"] else "ppl"
        lines += [
            "",
            f"## {task}: {t['metric']} ({'higher' if t['higher_is_better'] else 'lower'} is better)",
            "",
            f"| budget | condition | LoRA | BD-LoRA | Δ ({unit}) |"
            + (" Δ % |" if not t["higher_is_better"] else " SE |"),
            "|---|---|---:|---:|---:|---:|",
        ]
        for row in t["rows"]:
            cond = row["condition"]
            if row["bd_setting"]:
                cond += f" — LoRA: {row['lora_setting']}; BD: {row['bd_setting']}"
            last = (
                f"{row['delta_pct']['mean']:+.2f} ± {row['delta_pct']['std']:.2f}"
                if not t["higher_is_better"]
                else f"{row['bd']['binomial_se']:.2f}"
            )
            lines.append(
                f"| {row['budget']}: BD r={row['bd_r']} vs LoRA r={row['lora_r']} | {cond} | "
                f"{_pm(row['lora'], digits)} | {_pm(row['bd'], digits)} | "
                f"{row['delta']['mean']:+.2f} ± {row['delta']['std']:.2f} | {last} |"
            )
        c = t["cost"]
        lines += [
            "",
            f"Chosen on validation: {', '.join(f'{k}: {lab}' for k, lab in t['chosen'].items()) or 'n/a'}.",
            f"Cost: {c['trained_runs']} trained runs, {c['train_min']:.0f} min training and {c['eval_min']:.0f} min "
            "evaluation summed over runs.",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    result = verdict()
    (HERE / "verdict.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (HERE / "verdict.md").write_text(markdown(result))
    print(markdown(result))
