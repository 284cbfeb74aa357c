"""Helpers shared by the engine tests and their fixtures (a module of its own: `conftest` is ambiguous)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.vllm_harness import fixtures as fx

REPO = Path(__file__).resolve().parents[2]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 6
ENGINE_TIMEOUT_S = 600
TOL = 1e-3  # max |Δ log-prob| in nats, fp32 (why: tests/vllm/test_engine.py docstring)
MEASURED: dict = {}  # printed at the end of the session (conftest.pytest_terminal_summary)

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # 2 shared cores: no pinning (auto binding wants a NUMA node per rank)
    # ...and so each rank would start an OpenMP thread per core: TP x oversubscribed, many times slower at TP 3 here
    # (eval/bench/cpu_threads_tp3.md). The servers the tests start run at TP 2 or 3; run_engine sets it per job's TP.
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB per worker
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc(probe functions), test only
    "PYTHONPATH": str(REPO),  # the workers import tools.vllm_harness.probe (collective_rpc pickles by reference)
}


def run_engine(workdir: Path, name: str, job: dict, plugin: bool = True) -> dict:
    """Run one engine job in a subprocess; return its result dict (engine errors fail the test with the log)."""
    job_path, out_path, log_path = (workdir / f"{name}.{ext}" for ext in ("job.json", "out.json", "log"))
    job_path.write_text(json.dumps(job, indent=1))
    out_path.unlink(missing_ok=True)
    env = {**os.environ, **ENGINE_ENV}
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // job.get("llm", {}).get("tensor_parallel_size", 1)))
    if not plugin:
        env["VLLM_PLUGINS"] = "none"  # vLLM loads only the general plugins named here: stock vLLM
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, "-m", "tools.vllm_harness.engine_job", str(job_path),
                               str(out_path)], env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=ENGINE_TIMEOUT_S, cwd=REPO)
    wall = time.perf_counter() - t0
    result = json.loads(out_path.read_text()) if out_path.exists() else {"error": "no result file"}
    if proc.returncode or "error" in result:
        tail = log_path.read_text()[-4000:]
        pytest.fail(f"engine job {name} failed (rc {proc.returncode}): {result.get('error')}\n--- log tail ---\n{tail}")
    result["wall_seconds"] = wall
    result["log"] = log_path.read_text()
    print(f"[engine {name}] load {result['load_seconds']:.0f} s, total {wall:.0f} s")
    return result


def with_references(workdir, name, model, adapters, referenced) -> dict:
    """HF (+PEFT) fp32 greedy tokens and log-probs, cached as JSON (keys missing from the cache are added)."""
    path = workdir / f"{name}-reference.json"
    ids = fx.prompt_ids(model, PROMPTS)
    refs = json.loads(path.read_text()) if path.exists() else {}
    missing = [key for key in ["base", *referenced] if key not in refs]
    for key in missing:
        refs[key] = fx.reference_greedy(model, None if key == "base" else adapters[key], ids, MAX_TOKENS)
    if missing:
        fx.write_json(path, refs)
    return {"model": str(model), "adapters": {k: str(v) for k, v in adapters.items()}, "ids": ids, "refs": refs}


def lora(assets: dict, key: str, lora_id: int):
    return [key, lora_id, assets["adapters"][key]]


def mixed_requests(assets: dict, adapters: list) -> list[dict]:
    """Every prompt with every adapter (None = base), all in one batch."""
    return [{"prompt_ids": ids, "adapter": a, "key": (a[0] if a else "base"), "prompt": i}
            for a in adapters for i, ids in enumerate(assets["ids"])]


def by_key(step: dict, requests: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for req, res in zip(requests, step["results"]):
        out.setdefault(req["key"], []).append(res)
    return out


def max_diff(got: list[dict], ref: list[dict], label: str) -> float:
    worst = 0.0
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert g["tokens"] == r["tokens"], f"{label} prompt {i}: greedy tokens {g['tokens']} != {r['tokens']}"
        worst = max(worst, max(abs(x - y) for x, y in zip(g["logprobs"], r["logprobs"], strict=True)))
    return worst

