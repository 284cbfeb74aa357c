#!/usr/bin/env python
"""GRPO step time on this CPU: the trainer generating its own rollouts vs rollouts in `vllm serve` at TP 3 with the
plugin, the adapter synced after every step (docs/rl.md). Per step: wall time, and with the server the sync (write +
load + unload), the rollout (the server's answer), the exactness check (the trainer's forward over the samples) and
the rest (rewards, GRPO's forward and backward, the optimizer: "train"); the bytes each sync moves against the base's
weight bytes a merged sync would move. Each mode is one `bdlora train` of the embedded model's GRPO recipe with the same
keys, one after another; the server is started with the command the run prints.

  .venv-vllm/bin/python scripts/bench_rl_rollouts.py --steps 4 --out eval/bench/rl_rollouts_cpu_tp3

Modes: `trainer` (the trainer generates), `server` (BD-LoRA r=12 nblocks 3, each rank its own blocks), `server-lora`
(the matched plain LoRA, r=8, through the same sync with vLLM's default sharding at the same TP 3: the run prints a
TP-1 command for a plain LoRA, which has no nblocks, and the bench adds `--tensor-parallel-size 3` to it).

`--server-pythonpath DIR` starts the server with another checkout's plugin first on its path (e.g. a worktree of the
commit before the grouped CPU LoRA ops, to measure what they do for rollouts); its rows are labelled with --label.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tools/ (the vLLM harness) lives next to the package, not in the wheel

RECIPE = REPO / "recipes" / "smollm2-135m" / "analogies" / "grpo.yaml"
# temperature 1.0: the recipe's value when eval/bench/rl_rollouts_cpu_tp3.md was measured (it samples at 0.7 since)
KEYS = ["per_device_train_batch_size=16", "num_generations=8", "max_completion_length=16", "logging_steps=1",
        "save_steps=0", "resume_from_checkpoint=false", "temperature=1.0"]
TP = 3
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
       "VLLM_CPU_KVCACHE_SPACE": "1"}
# vLLM's default CPU binding (auto) needs a NUMA node per rank; with nobind each rank would start one OpenMP thread
# per core, TP x oversubscribed (eval/bench/cpu_threads_tp3.md)
SERVER_THREADS = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // TP))}


def _env(extra: dict | None = None) -> dict:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, **ENV, "PATH": path, **(extra or {})}


def _train(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bdlora_train.cli", "train", str(RECIPE), *KEYS, *args], env=_env(),
                          capture_output=True, text=True, cwd=REPO, timeout=3600)


def _mean(values: list[float]) -> float:
    return round(statistics.mean(values), 3) if values else None


def _trainer_mode(model: str, out: Path, steps: int) -> dict:
    run = _train([f"model={model}", f"output_dir={out}", f"max_steps={steps}"])
    if run.returncode:
        raise SystemExit(f"bench_rl_rollouts: the trainer-generates run failed: {run.stderr[-2000:]}")
    m = json.loads((out / "metrics.json").read_text())
    return {"mode": "trainer generates", "step_seconds": m["step_seconds"], "mean_step_s": _mean(m["step_seconds"][1:]),
            "reward": [m["reward_first"], m["reward_last"]]}


LORA = ["method=lora", "lora_r=8"]  # the LoRA the matched-budget comparison sets against BD-LoRA r=12 nblocks 3


def _server_mode(model: str, out: Path, steps: int, label: str, pythonpath: str | None, lora: bool = False) -> dict:
    from tools.vllm_harness.server import free_port, models

    url = f"http://127.0.0.1:{free_port()}"
    args = [f"model={model}", f"output_dir={out}", f"rollout_server={url}", f"max_steps={steps}",
            *(LORA if lora else [])]
    first = _train(args)  # no server yet: the run refuses with the command that starts it
    line = next((ln for ln in first.stderr.splitlines() if "start it with: " in ln), None)
    if line is None:
        raise SystemExit(f"bench_rl_rollouts: expected the server command, got: {first.stderr[-2000:]}")
    command = line.split("start it with: ", 1)[1]
    if "--tensor-parallel-size" not in command:  # a plain LoRA: the run has no TP degree to print
        command = command.replace(" --enable-lora", f" --enable-lora --tensor-parallel-size {TP}")
    log = open(out.parent / f"{out.name}-server.log", "w")
    # cwd outside the checkout: `python -m` puts the working directory first on sys.path, before PYTHONPATH
    server = subprocess.Popen(["bash", "-c", command], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              cwd=out.parent,
                              env=_env({**SERVER_THREADS, **({"PYTHONPATH": pythonpath} if pythonpath else {})}))
    try:
        deadline = time.time() + 900
        while True:
            try:
                models(url)
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"bench_rl_rollouts: the server did not come up: {log.name}") from None
                time.sleep(3)
        run = _train(args)
        if run.returncode:
            raise SystemExit(f"bench_rl_rollouts: the server run failed: {run.stderr[-2000:]}")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait()
        log.close()
    m = json.loads((out / "metrics.json").read_text())
    rollout, syncs, step_s = m["rollout"]["steps"], m["rollout"]["syncs"], m["step_seconds"]
    sync_s = {s["step"]: s["seconds"] for s in syncs}
    parts = []
    for i, (r, total) in enumerate(zip(rollout, step_s, strict=True)):
        sync = sync_s.get(r["step"], 0.0)
        parts.append({"step": r["step"], "step_s": total, "sync_s": sync, "rollout_s": r["rollout_seconds"],
                      "check_s": r["check_seconds"],
                      "train_s": round(total - sync - r["rollout_seconds"] - r["check_seconds"], 4),
                      "completion_tokens": r["tokens"], "max_abs_logprob_diff": r["max_abs_logprob_diff"]})
    later = parts[1:]  # the first step also warms the server's adapter path
    return {"mode": label, "command": command, "server_env": SERVER_THREADS, "server_pythonpath": pythonpath,
            "steps": parts,
            "sync_bytes": [s["bytes"] for s in syncs],
            "mean_step_s": _mean([p["step_s"] for p in later]), "mean_sync_s": _mean([p["sync_s"] for p in later]),
            "mean_rollout_s": _mean([p["rollout_s"] for p in later]),
            "mean_check_s": _mean([p["check_s"] for p in later]), "mean_train_s": _mean([p["train_s"] for p in later]),
            "reward": [m["reward_first"], m["reward_last"]]}


def format_md(result: dict) -> str:
    lines = [f"# GRPO step time on a CPU: trainer generates vs `vllm serve` at TP {result['tp']}", "",
             *[f"`{c}`" for c in result["commands"]], "",
             f"{result['machine']}; the embedded SmolLM2-135M (float32), {result['recipe']} with "
             f"`{' '.join(KEYS)}`, {result['steps_per_mode']} steps per mode, means over steps 2..N (step 1 warms "
             "up). Base weights a merged sync would move every step: "
             f"{result['base_weight_bytes'] / 1e6:.1f} MB; the adapter each sync moves: "
             + "; ".join(f"{mode}: {b / 1e6:.2f} MB" for mode, b in result["sync_bytes"].items()) + ".", "",
             "| mode | step s | sync s | rollout s | check s | train s | largest log-prob gap | reward first -> last |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for row in result["modes"]:
        cells = [row.get(k) for k in ("mean_step_s", "mean_sync_s", "mean_rollout_s", "mean_check_s", "mean_train_s")]
        gap = max((s["max_abs_logprob_diff"] for s in row.get("steps", [])), default=None)
        lines.append(f"| {row['mode']} | " + " | ".join("" if c is None else f"{c:.2f}" for c in cells) +
                     f" | {'' if gap is None else f'{gap:.1e}'} | {row['reward'][0]:.3f} -> {row['reward'][1]:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-rl"))
    parser.add_argument("--server-pythonpath", default=None)
    parser.add_argument("--label", default="vllm serve (plugin: grouped CPU ops, one call per layer)")
    parser.add_argument("--modes", default="trainer,server,server-lora", help="trainer, server, server-lora "
                        "(comma-separated)")
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md (OUT.json is extended "
                        "when it exists: rows of other modes stay)")
    ns = parser.parse_args(argv)
    from tools.vllm_harness import fixtures as fx

    ns.workdir.mkdir(parents=True, exist_ok=True)
    model = str(fx.smollm2_dir(ns.workdir / "smollm2"))
    weights = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
    path = ns.out.with_suffix(".json")
    result = json.loads(path.read_text()) if path.exists() else {"modes": []}
    for mode in ns.modes.split(","):
        if mode == "trainer":
            row = _trainer_mode(model, ns.workdir / "gen", ns.steps)
        elif mode == "server-lora":
            row = _server_mode(model, ns.workdir / "srv-lora", ns.steps, "vllm serve, plain LoRA r=8 (vLLM's sharding)",
                               ns.server_pythonpath, lora=True)
        elif mode == "server":
            row = _server_mode(model, ns.workdir / "srv", ns.steps, ns.label, ns.server_pythonpath)
        else:
            raise SystemExit(f"bench_rl_rollouts: --modes {mode!r} is not one of trainer, server, server-lora")
        result["modes"] = [r for r in result["modes"] if r["mode"] != row["mode"]] + [row]
        print(json.dumps({k: v for k, v in row.items() if k != "steps"}), file=sys.stderr)
    server_rows = [r for r in result["modes"] if "sync_bytes" in r]
    command = "python scripts/bench_rl_rollouts.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    result["commands"] = [c for c in result.get("commands", []) if c != command] + [command]
    result.update(machine=f"{os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}", tp=TP,
                  recipe=str(RECIPE.relative_to(REPO)), steps_per_mode=ns.steps, base_weight_bytes=weights,
                  sync_bytes={r["mode"]: r["sync_bytes"][0] for r in server_rows})
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    ns.out.with_suffix(".md").write_text(format_md(result))
    print(format_md(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
