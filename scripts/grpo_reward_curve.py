"""The reward curve of a GRPO run (`objective: grpo`): per logged step, the mean reward of the sampled completions
(and each reward function's), read from the run's last checkpoint's trainer_state.json; writes reward_curve.json,
reward_curve.png and a copy of the run's metrics.json into --out.

    python scripts/grpo_reward_curve.py RUN_DIR --out eval/results/smollm2-135m-grpo-run
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path


def curve(run_dir: Path) -> dict:
    from bdlora_train.trainer.mixins import last_checkpoint

    checkpoint = last_checkpoint(run_dir)
    if checkpoint is None:
        raise SystemExit(f"grpo_reward_curve: {run_dir} holds no complete checkpoint; train with save_steps > 0")
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    steps = [e for e in history if "reward" in e]
    if not steps:
        raise SystemExit(f"grpo_reward_curve: {checkpoint} logged no reward: not a GRPO run")
    rewards = [e["reward"] for e in steps]
    k = max(1, min(5, len(rewards) // 2))
    return {
        "run_dir": str(run_dir),
        "checkpoint": checkpoint.name,
        "steps": [e["step"] for e in steps],
        "reward": rewards,
        "per_function": {key: [e[key] for e in steps] for key in steps[0] if key.startswith("rewards/")},
        f"mean_first_{k}": round(statistics.mean(rewards[:k]), 6),
        f"mean_last_{k}": round(statistics.mean(rewards[-k:]), 6),
    }


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(data["steps"], data["reward"], marker="o", markersize=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward of the sampled completions")
    ax.set_title(f"GRPO: {Path(data['run_dir']).name}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    ns = parser.parse_args(argv)
    data = curve(ns.run_dir)
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "reward_curve.json").write_text(json.dumps(data, indent=1) + "\n")
    plot(data, ns.out / "reward_curve.png")
    shutil.copyfile(ns.run_dir / "metrics.json", ns.out / "metrics.json")
    keys = [k for k in data if k.startswith("mean_")]
    print(f"grpo_reward_curve: {' | '.join(f'{k} {data[k]:.3f}' for k in keys)} -> {ns.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
