"""The perplexity-gap investigation table: every news-ppl run of the tuned sweep and the diagnostics, seed 0.

    python eval/results/smollm2-135m-tuned/diag/summary.py > eval/results/smollm2-135m-tuned/diag/summary.md

Reads the committed records (../news-ppl/records, */records) and prints, per change, each adapter's validation
and test perplexity and BD-LoRA's test difference to LoRA r=8 trained with the same learning rate. Keys that a
change leaves at their default are not shown. Only 80-step runs with all 30 test articles are listed.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
DIRS = [
    HERE.parent / "news-ppl" / "records",
    *sorted(p / "records" for p in HERE.iterdir() if (p / "records").is_dir()),
]


def load() -> list[dict]:
    out = []
    for d in DIRS:
        for path in sorted(d.glob("*.json")):
            rec = json.loads(path.read_text())
            recipe = rec["fingerprint"]["recipe"]
            if rec["method"] == "base" or rec.get("steps") != 80 or rec["fingerprint"].get("limit") is not None:
                continue
            setting = {**{k: recipe.get(k) for k in ("learning_rate", "bd_lr_ratio", "use_rslora") if k in recipe}}
            setting.update(rec.get("setting") or {})
            out.append({**rec, "full_setting": setting, "source": d.parent.name})
    return out


def main() -> None:
    recs = [r for r in load() if r["seed"] == 0]
    lora = {
        r["full_setting"]["learning_rate"]: r
        for r in recs
        if r["method"] == "lora" and not r["full_setting"].get("use_rslora")
    }
    rows = defaultdict(list)
    for r in recs:
        s = r["full_setting"]
        change = []
        if s.get("bd_lr_ratio", 1.0) != 1.0 and r["method"] != "lora":
            change.append(f"bd_lr_ratio={s['bd_lr_ratio']:g}")
        if s.get("use_rslora"):
            change.append("rsLoRA")
        rows[(s["learning_rate"], ", ".join(change) or "-")].append(r)
    print("| lr | change | adapter | val ppl | test ppl | test Δ vs LoRA r=8 (same lr) | source |")
    print("|---:|---|---|---:|---:|---:|---|")
    for (lr, change), group in sorted(rows.items()):
        for r in sorted(group, key=lambda r: (r["method"] != "lora", r["method"], r["r"])):
            ref = lora.get(lr)
            delta = r["metrics"]["perplexity"] - ref["metrics"]["perplexity"] if ref and r is not ref else None
            name = {"lora": "LoRA", "bdlora": "BD-LoRA", "peft-bdlora": "PEFT BD-LoRA"}[r["method"]] + f" r={r['r']}"
            val, test = r["val_metrics"]["perplexity"], r["metrics"]["perplexity"]
            print(
                f"| {lr:g} | {change} | {name} | {val:.3f} | {test:.3f} | "
                + (f"{delta:+.3f} ({100 * delta / ref['metrics']['perplexity']:+.2f} %)" if delta is not None else "")
                + f" | {r['source']} |"
            )


if __name__ == "__main__":
    main()
