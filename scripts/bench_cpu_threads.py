#!/usr/bin/env python
"""vLLM's CPU build at TP > 1 on a machine with fewer NUMA nodes than ranks: `VLLM_CPU_OMP_THREADS_BIND=nobind`
(vLLM's default binding wants a NUMA node per rank and stops at start-up without) with and without
`OMP_NUM_THREADS` = cores / TP. Without it every rank starts one OpenMP thread per core, TP times more threads than
cores (docs/serving-vllm.md, "On vLLM's CPU build"; check-serving's `threads` check). One server per setting, the
embedded SmolLM2-135M in float32 at TP 3, the base model only (no adapter), N concurrent requests of 16 sampled
tokens, timed twice after one warm-up round.

  .venv-vllm/bin/python scripts/bench_cpu_threads.py --out eval/bench/cpu_threads_tp3
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tools/ (the vLLM harness) lives next to the package, not in the wheel

TP, TOKENS = 3, 16


def _round(url: str, model: str, requests: int) -> float:
    from tools.vllm_harness.server import post

    def one(i: int) -> None:
        body = {"model": model, "prompt": f"Question {i}: the capital of France is", "max_tokens": TOKENS,
                "min_tokens": TOKENS, "temperature": 1.0, "seed": i}
        status, text = post(f"{url}/v1/completions", body)
        if status != 200:
            raise SystemExit(f"bench_cpu_threads: the server answered {status}: {text[:500]}")

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(requests) as pool:
        list(pool.map(one, range(requests)))
    return time.perf_counter() - t0


def measure(model: str, threads: str | None, requests: int, workdir: Path) -> dict:
    from tools.vllm_harness.server import serving

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    command = (f"{sys.executable} -m vllm.entrypoints.openai.api_server --model {model} --tensor-parallel-size {TP} "
               "--dtype float32")
    label = f"OMP_NUM_THREADS={threads}" if threads else "OMP_NUM_THREADS unset"
    with serving(command, workdir / f"server-{threads or 'unset'}.log", env=env) as url:
        _round(url, model, requests)  # warm-up
        seconds = [round(_round(url, model, requests), 3) for _ in range(2)]
    return {"setting": label, "seconds": seconds, "tokens_per_s": round(requests * TOKENS / min(seconds), 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-cpu-threads"))
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    ns = parser.parse_args(argv)
    from tools.vllm_harness import fixtures as fx

    ns.workdir.mkdir(parents=True, exist_ok=True)
    model = str(fx.smollm2_dir(ns.workdir / "smollm2"))
    cores = os.cpu_count() or 1
    rows = [measure(model, str(max(1, cores // TP)), ns.requests, ns.workdir),
            measure(model, None, ns.requests, ns.workdir)]
    result = {"command": "python scripts/bench_cpu_threads.py " + " ".join(argv or sys.argv[1:]),
              "machine": f"{cores} CPU cores, {time.strftime('%Y-%m-%d')}", "tp": TP, "requests": ns.requests,
              "tokens_per_request": TOKENS, "rows": rows,
              "slowdown_unset": round(min(rows[1]["seconds"]) / min(rows[0]["seconds"]), 2)}
    lines = [f"# vLLM's CPU build at TP {TP}: OpenMP threads per rank", "", f"`{result['command']}`", "",
             f"{result['machine']}; the embedded SmolLM2-135M (float32), base model, "
             f"`VLLM_CPU_OMP_THREADS_BIND=nobind`, {ns.requests} concurrent requests x {TOKENS} sampled tokens, two "
             "timed rounds after a warm-up.", "", "| setting | seconds per round | output tokens/s (best round) |",
             "|---|---|---:|"]
    lines += [f"| {r['setting']} | {', '.join(f'{s:.2f}' for s in r['seconds'])} | {r['tokens_per_s']:.1f} |"
              for r in rows]
    lines += ["", f"Without OMP_NUM_THREADS the same rounds take {result['slowdown_unset']}x as long."]
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    ns.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
