"""Plots what explains GRPO runs going right or wrong, step by step, from each run's metrics.json (`per_step`, written
by every `objective: grpo` run: rl/diagnostics.py): the mean reward, the share of prompt groups without advantage,
the KL to the base model, the policy's entropy, and the update norm of the B and A factors (dense and block-diagonal
summed). Writes diagnostics.png and diagnostics.json (the series plotted) into --out.

    python scripts/grpo_diagnostics.py --run LABEL RUN_DIR [--run LABEL RUN_DIR ...] --out DIR

A RUN_DIR is a `bdlora train` output_dir or a `bdlora compare` run directory (<out>/runs/<run id>/).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

PANELS = (  # (title, the series of one run)
    ("mean reward", lambda s: s.get("reward")),
    ("groups with zero advantage", lambda s: s.get("frac_reward_zero_std")),
    ("KL(policy || base), nats/token", lambda s: s.get("kl_to_base")),
    ("entropy, nats/token", lambda s: s.get("entropy")),
    ("update norm of B (dense + BD)", lambda s: _norm(s, "lora_B")),
    ("update norm of A (dense + BD)", lambda s: _norm(s, "lora_A")),
)


def _norm(step: dict, factor: str) -> float | None:
    norms = step.get("update_norm") or {}
    parts = [norms[k] for k in (factor, f"{factor}_bd") if k in norms]
    return math.sqrt(sum(v * v for v in parts)) if parts else None


def series(run_dir: Path) -> dict:
    path = run_dir / "metrics.json"
    if not path.is_file():
        raise SystemExit(f"grpo_diagnostics: {path} not found; give a finished GRPO run's output_dir")
    metrics = json.loads(path.read_text())
    steps = metrics.get("per_step")
    if not steps:
        raise SystemExit(f"grpo_diagnostics: {path} has no per_step record: not a GRPO run of this version")
    return {
        "run_dir": str(run_dir),
        "method": metrics.get("method"),
        "r": metrics.get("r"),
        "lora_alpha": metrics.get("lora_alpha"),
        "steps": [s["step"] for s in steps],
        **{title: [fn(s) for s in steps] for title, fn in PANELS},
        "warnings": metrics.get("grpo_warnings", []),
    }


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, (title, _) in zip(axes.flat, PANELS, strict=True):
        for label, run in runs.items():
            points = [(x, y) for x, y in zip(run["steps"], run[title], strict=True) if y is not None]
            if points:
                ax.plot(*zip(*points, strict=True), label=label, linewidth=1.4)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if "KL" in title or "update" in title:
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", nargs=2, action="append", required=True, metavar=("LABEL", "RUN_DIR"))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    runs = {label: series(Path(path)) for label, path in args.run}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnostics.json").write_text(json.dumps({"command": "python scripts/grpo_diagnostics.py "
                                                      + " ".join(argv), "runs": runs}, indent=1) + "\n")
    plot(runs, out / "diagnostics.png")
    print(f"grpo_diagnostics: wrote {out / 'diagnostics.png'} and diagnostics.json ({len(runs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
