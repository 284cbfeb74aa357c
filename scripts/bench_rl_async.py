#!/usr/bin/env python
"""Asynchronous GRPO on this CPU (docs/rl.md, "Asynchronous rollouts"): the embedded model's GRPO recipe with
rollouts in `vllm serve` at TP 1, the server pinned to one core and the trainer to another (`taskset`), at
max_staleness 0 (synchronous) and 1 (the server samples the next step's prompts while the trainer trains), each over
the same seeds. Per run: every step's wall time and where it went (the wait for the server's answer, the exactness
check's forward, the rest), the rollouts' version lag, the importance-sampling ratios, and the reward of every step.

  .venv-vllm/bin/python scripts/bench_rl_async.py --steps 30 --seeds 3 --out eval/bench/rl_async_cpu
  .venv/bin/python scripts/bench_rl_async.py --plot eval/bench/rl_async_cpu.json   # the figure (matplotlib)

The adapter is the matched plain LoRA (r=8, `method=lora`): a BD-LoRA adapter of the embedded model is served at
its nblocks = TP 3, and this bench is at TP 1. The server is started with the command the run prints (one start for
every run; each run unloads its versions when it ends). Writes OUT.json (every step of every run) and OUT.md; `--plot`
draws OUT.png (the mean reward per step over the seeds, each K) from OUT.json in an environment with matplotlib
(the vLLM environment has none).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tools/ (the vLLM harness) lives next to the package, not in the wheel

RECIPE = REPO / "recipes" / "smollm2-135m" / "analogies" / "grpo.yaml"
# temperature 1.0: the recipe's value when eval/bench/rl_async_cpu.md was measured (it samples at 0.7 since)
KEYS = ["method=lora", "lora_r=8", "cpu_threads=1", "logging_steps=1", "save_steps=0",
        "resume_from_checkpoint=false", "temperature=1.0"]
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
SERVER_CORE, TRAINER_CORE = "1", "0"


def _env() -> dict:
    return {**os.environ, **ENV, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def _train(args: list[str]) -> subprocess.CompletedProcess:
    cmd = ["taskset", "-c", TRAINER_CORE, sys.executable, "-m", "bdlora_train.cli", "train", str(RECIPE), *KEYS,
           *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, cwd=REPO, timeout=7200)


def _start_server(model: str, url: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    from tools.vllm_harness.server import models

    first = _train([f"model={model}", f"output_dir={workdir / 'probe'}", f"rollout_server={url}", "max_steps=1"])
    line = next((ln for ln in first.stderr.splitlines() if "start it with: " in ln), None)
    if line is None:
        raise SystemExit(f"bench_rl_async: expected the server command, got: {first.stderr[-2000:]}")
    command = line.split("start it with: ", 1)[1]
    log = open(workdir / "server.log", "w")
    # cwd outside the checkout: `python -m` puts the working directory first on sys.path
    server = subprocess.Popen(["taskset", "-c", SERVER_CORE, "bash", "-c", command], stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True, cwd=workdir, env=_env())
    deadline = time.time() + 900
    while True:
        try:
            models(url)
            return server, command
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                raise SystemExit(f"bench_rl_async: the server did not come up: {log.name}") from None
            time.sleep(3)


def _run(model: str, url: str, out: Path, staleness: int, seed: int, steps: int) -> dict:
    run = _train([f"model={model}", f"output_dir={out}", f"rollout_server={url}", f"max_staleness={staleness}",
                  f"seed={seed}", f"max_steps={steps}"])
    if run.returncode:
        raise SystemExit(f"bench_rl_async: the run K={staleness} seed {seed} failed: {run.stderr[-2000:]}")
    m = json.loads((out / "metrics.json").read_text())
    rollout = m["rollout"]
    sync = {s["step"]: s["seconds"] for s in rollout["syncs"]}
    steps_out = []
    for r, total, logged in zip(rollout["steps"], m["step_seconds"], m["per_step"], strict=True):
        ratios = r.get("importance_sampling") or {}
        steps_out.append({
            "step": r["step"], "step_s": total, "sync_s": sync.get(r["step"], 0.0), "wait_s": r["rollout_seconds"],
            "check_s": r["check_seconds"], "lag": r["lag"], "reward": logged["reward"],
            "max_abs_logprob_diff": r["max_abs_logprob_diff"], "mean_abs_logprob_diff": r["mean_abs_logprob_diff"],
            "ratio_mean": ratios.get("mean"), "ratio_min": ratios.get("min"), "ratio_max": ratios.get("max"),
            "ratio_outside": ratios.get("outside_fraction")})
    later = steps_out[1:]  # the first step samples synchronously in both modes and warms the server
    return {"max_staleness": staleness, "seed": seed, "steps": steps_out,
            "mean_step_s": statistics.mean(s["step_s"] for s in later),
            "mean_wait_s": statistics.mean(s["wait_s"] for s in later),
            "mean_check_s": statistics.mean(s["check_s"] for s in later),
            "reward_last5": statistics.mean(s["reward"] for s in steps_out[-5:])}


def _mean_se(values: list[float]) -> str:
    mean = statistics.mean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return f"{mean:.3f} ± {se:.3f}"


def format_md(result: dict) -> str:
    lines = ["# Asynchronous GRPO on a CPU: max_staleness 0 vs 1, `vllm serve` at TP 1", "",
             f"`{result['command']}`", "",
             f"{result['machine']}; the embedded SmolLM2-135M (float32), {result['recipe']} with `{' '.join(KEYS)}`, "
             f"{result['steps']} steps per run, seeds {result['seeds']}; the server on core {SERVER_CORE} "
             f"(`taskset -c {SERVER_CORE}`, one thread), the trainer on core {TRAINER_CORE}. Server command (the one "
             f"the run prints): `{result['server_command']}`.", "",
             "Step times are means over steps 2..N (the first step samples synchronously in both modes). `wait s`: "
             "the trainer waiting for the server's answer; `check s`: the exactness check's forward.", "",
             "| max_staleness | seed | step s | wait s | check s | lag of steps 2..N | largest gap | reward, last 5 "
             "steps | ratio min..max |", "|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for run in result["runs"]:
        later = run["steps"][1:]
        lags = sorted({s["lag"] for s in later})
        lows = [s["ratio_min"] for s in run["steps"] if s["ratio_min"] is not None]
        highs = [s["ratio_max"] for s in run["steps"] if s["ratio_max"] is not None]
        ratio = f"{min(lows):.3f}..{max(highs):.3f}" if lows else ""
        gap = max(s["max_abs_logprob_diff"] for s in run["steps"])
        lines.append(f"| {run['max_staleness']} | {run['seed']} | {run['mean_step_s']:.2f} | {run['mean_wait_s']:.2f}"
                     f" | {run['mean_check_s']:.2f} | {lags} | {gap:.1e} | {run['reward_last5']:.3f} | {ratio} |")
    lines += ["", "| max_staleness | step s (mean ± SE over seeds) | reward, last 5 steps (mean ± SE) |",
              "|---:|---:|---:|"]
    for k in sorted({r["max_staleness"] for r in result["runs"]}):
        runs = [r for r in result["runs"] if r["max_staleness"] == k]
        lines.append(f"| {k} | {_mean_se([r['mean_step_s'] for r in runs])} | "
                     f"{_mean_se([r['reward_last5'] for r in runs])} |")
    sync = {r["seed"]: r["mean_step_s"] for r in result["runs"] if r["max_staleness"] == 0}
    ratios = [sync[r["seed"]] / r["mean_step_s"] for r in result["runs"] if r["max_staleness"] == 1
              and r["seed"] in sync]
    if ratios:
        lines += ["", f"Step time K=0 / K=1, per seed: {', '.join(f'{x:.2f}x' for x in ratios)}."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k in sorted({r["max_staleness"] for r in result["runs"]}):
        runs = [r for r in result["runs"] if r["max_staleness"] == k]
        steps = [s["step"] + 1 for s in runs[0]["steps"]]
        per_step = list(zip(*[[s["reward"] for s in r["steps"]] for r in runs], strict=True))
        mean = [statistics.mean(v) for v in per_step]
        ax.plot(steps, mean, label=f"max_staleness {k} (mean of {len(runs)} seeds)")
        ax.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step], alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward of the step's completions")
    ax.set_title("GRPO, SmolLM2-135M, rollouts in vllm serve at TP 1 (band: the seeds' range)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-rl-async"))
    parser.add_argument("--out", type=Path, help="writes OUT.json and OUT.md")
    parser.add_argument("--plot", type=Path, help="draws the figure of this OUT.json into OUT.png, and runs nothing")
    ns = parser.parse_args(argv)
    if ns.plot is not None:
        plot(json.loads(ns.plot.read_text()), ns.plot.with_suffix(".png"))
        return 0
    if ns.out is None:
        parser.error("--out is required to run the bench")
    from tools.vllm_harness import fixtures as fx
    from tools.vllm_harness.server import free_port

    ns.workdir.mkdir(parents=True, exist_ok=True)
    model = str(fx.smollm2_dir(ns.workdir / "smollm2"))
    url = f"http://127.0.0.1:{free_port()}"
    server, server_command = _start_server(model, url, ns.workdir)
    runs = []
    try:
        for seed in range(ns.seeds):
            for k in ns.staleness:  # side by side: each seed's two runs one after the other
                runs.append(_run(model, url, ns.workdir / f"k{k}-s{seed}", k, seed, ns.steps))
                print(json.dumps({x: v for x, v in runs[-1].items() if x != "steps"}), file=sys.stderr, flush=True)
    finally:
        os.killpg(server.pid, 15)
        server.wait()
    command = ".venv-vllm/bin/python scripts/bench_rl_async.py " + " ".join(shlex.quote(a) for a in
                                                                           (argv or sys.argv[1:]))
    result = {"command": command, "server_command": server_command,
              "machine": f"{os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}",
              "recipe": str(RECIPE.relative_to(REPO)), "steps": ns.steps, "seeds": list(range(ns.seeds)),
              "runs": runs}
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    ns.out.with_suffix(".md").write_text(format_md(result))
    print(format_md(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
