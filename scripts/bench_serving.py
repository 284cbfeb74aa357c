#!/usr/bin/env python
"""Serving speed of BD-LoRA through the vLLM plugin vs the same adapters as dense LoRA in stock vLLM.

Modes (same prompts, same adapters, K concurrent adapters, every request greedy with a fixed output length):
  base          no adapter (measured in every engine: the paired reference)
  bdlora        BD-LoRA adapters through the plugin, --max-lora-rank = the per-rank rank r/TP
  dense         the dense-lora export of the same adapters, vLLM's default LoRA sharding, --max-lora-rank >= r
  dense-fs      the dense-lora export with --fully-sharded-loras (S-LoRA; --max-lora-rank must be divisible
                by TP, so it cannot run at TP 3)
  (dense and dense-fs run on stock vLLM: the plugin is not loaded, VLLM_PLUGINS=none)

Each mode with adapters is one engine (one process, started one after another); inside it the base batch and
the adapter batch run interleaved, the order rotated each repeat, so each repeat gives a paired ratio
adapter/base on the same engine, warm caches and the same machine load. Reported: per mode the median and
spread (min-max) over repeats of tokens/s and per-request latency (submit -> finished, all requests of a
batch submitted at once), and the median paired slowdown vs base.

CPU (committed numbers, eval/bench/serving_cpu_tp3.json):
  .venv-vllm/bin/python scripts/bench_serving.py --device cpu --tp 3 --out eval/bench/serving_cpu_tp3.json
GPU (Llama-3.1-8B shapes, random weights via load_format=dummy, bf16):
  python scripts/bench_serving.py --device cuda --model llama-3.1-8b-shapes --tp 2 --rank 32 \\
      --out eval/bench/serving_cuda_tp2.json   # likewise --tp 4 --rank 64, --tp 8 --rank 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tools/ (the vLLM engine harness) lives next to the package, not in the wheel

ALLOWED_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks (0.32)
MODES = ("bdlora", "dense", "dense-fs")


def _max_rank(r: int, multiple_of: int = 1) -> int | None:
    """The smallest --max-lora-rank vLLM accepts that holds rank r (and, for fully_sharded_loras, that TP
    divides: vLLM shards the buffer's rank dimension). None if there is none."""
    for m in ALLOWED_MAX_RANKS:
        if m >= r and m % multiple_of == 0:
            return m
    return None


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _engine(job: dict, workdir: Path, name: str, plugin: bool, device: str) -> dict:
    job_path, out_path, log_path = workdir / f"{name}.job.json", workdir / f"{name}.out.json", workdir / f"{name}.log"
    job_path.write_text(json.dumps(job))
    out_path.unlink(missing_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    if device == "cpu":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if not plugin:
        env["VLLM_PLUGINS"] = "none"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, "-m", "tools.vllm_harness.engine_job", str(job_path),
                               str(out_path)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    result = json.loads(out_path.read_text()) if out_path.exists() else {"error": "no result"}
    if proc.returncode or "error" in result:
        raise SystemExit(f"engine {name} failed: {result.get('error')}\n{log_path.read_text()[-3000:]}")
    print(f"[{name}] {time.perf_counter() - t0:.0f} s (load {result['load_seconds']:.0f} s)", flush=True)
    return result["steps"]["bench"]["samples"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", default="smollm2", help="smollm2 (embedded, real weights), llama-3.1-8b-shapes "
                   "(random weights, load_format=dummy) or an HF model dir")
    p.add_argument("--tp", type=int, default=3)
    p.add_argument("--rank", type=int, default=48, help="adapter rank r (the per-rank rank is r/TP)")
    p.add_argument("--nblocks", type=int, default=None, help="default: --tp")
    p.add_argument("--adapters", type=int, default=3, help="concurrent adapters")
    p.add_argument("--requests-per-adapter", type=int, default=4)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--workdir", default=None, help="models/adapters/logs (default: a temp dir)")
    p.add_argument("--out", default=None, help="write results JSON here (and a .md next to it)")
    p.add_argument("--summarize-only", action="store_true", help="start no engine: summarize the engine results "
                   "already in --workdir (modes without one are reported as not run)")
    args = p.parse_args(argv)

    from tools.vllm_harness import fixtures as fx

    nblocks = args.nblocks or args.tp
    if args.rank % args.tp or nblocks % args.tp:
        raise SystemExit(f"--rank {args.rank} and --nblocks {nblocks} must be divisible by --tp {args.tp}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-serving-"))
    workdir.mkdir(parents=True, exist_ok=True)
    smol = fx.smollm2_dir(workdir / "smollm2")
    llm_extra: dict = {}
    if args.model == "smollm2":
        model, dtype = smol, "float32" if args.device == "cpu" else "bfloat16"
    elif args.model == "llama-3.1-8b-shapes":
        model, dtype = fx.shapes_only_llama_dir(workdir / "llama-3.1-8b-shapes", smol), "bfloat16"
        llm_extra["load_format"] = "dummy"
    else:
        model, dtype = Path(args.model), "bfloat16" if args.device == "cuda" else "float32"
    bd, dense = [], []
    for k in range(args.adapters):
        a = fx.synthetic_adapter(model, workdir / f"bd-r{args.rank}-n{nblocks}-{k}", args.rank, nblocks, seed=k)
        d = fx.dense_export(a, workdir / f"dense-r{args.rank}-n{nblocks}-{k}")
        bd.append(str(a))
        dense.append(str(d))

    import random

    from transformers import AutoConfig, AutoTokenizer

    vocab = min(len(AutoTokenizer.from_pretrained(model)), AutoConfig.from_pretrained(model).vocab_size)

    rng = random.Random(0)
    n_req = args.adapters * args.requests_per_adapter
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(n_req)]

    def requests(paths):
        if paths is None:
            return [{"prompt_ids": pr, "adapter": None} for pr in prompts]
        return [{"prompt_ids": pr, "adapter": [f"a{i % len(paths)}", 1 + i % len(paths), paths[i % len(paths)]]}
                for i, pr in enumerate(prompts)]

    base_llm = dict(tensor_parallel_size=args.tp, dtype=dtype, enable_lora=True, max_loras=args.adapters + 1,
                    max_model_len=args.input_len + args.max_tokens + 16, max_num_seqs=max(n_req, 8),
                    enforce_eager=args.device == "cpu", **llm_extra)
    engines = {
        "bdlora": (dict(max_lora_rank=_max_rank(args.rank // args.tp)), bd, True),
        "dense": (dict(max_lora_rank=_max_rank(args.rank)), dense, False),
        "dense-fs": (dict(max_lora_rank=_max_rank(args.rank, args.tp), fully_sharded_loras=True), dense, False),
    }
    modes = [m for m in args.modes.split(",") if m]
    cli = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--summarize-only"]  # the measuring command
    results: dict = {"command": "python scripts/bench_serving.py " + " ".join(cli),
                     "device": args.device, "model": args.model, "tp": args.tp, "rank": args.rank,
                     "nblocks": nblocks, "adapters": args.adapters, "requests": n_req, "input_len": args.input_len,
                     "max_tokens": args.max_tokens, "repeats": args.repeats, "dtype": dtype, "modes": {}}
    import vllm  # noqa: F401 - version for the record

    results["vllm"] = vllm.__version__
    for mode in modes:
        extra, paths, plugin = engines[mode]
        if extra["max_lora_rank"] is None:
            why = f"not runnable: vLLM needs --max-lora-rank >= {args.rank} from {ALLOWED_MAX_RANKS}"
            if mode == "dense-fs":
                why += f" and divisible by TP {args.tp} (fully_sharded_loras shards the rank)"
            results["modes"][mode] = {"skipped": why}
            print(f"[{mode}] {why}", flush=True)
            continue
        job = {"model": str(model), "llm": {**base_llm, **extra},
               "steps": [{"kind": "bench", "name": "bench", "max_tokens": args.max_tokens, "repeats": args.repeats,
                          "warmup": 1, "groups": {"base": requests(None), mode: requests(paths)}}]}
        name = f"{mode}-tp{args.tp}"
        if args.summarize_only:
            done = workdir / f"{name}.out.json"
            if not done.exists():
                results["modes"][mode] = {"skipped": "not run (no engine result in --workdir)"}
                continue
            samples = json.loads(done.read_text())["steps"]["bench"]["samples"]
        else:
            samples = _engine(job, workdir, name, plugin, args.device)
        entry = {"max_lora_rank": extra["max_lora_rank"], "plugin": plugin,
                 "fully_sharded_loras": extra.get("fully_sharded_loras", False)}
        for label in ("base", mode):
            tps = [s["tokens"] / s["seconds"] for s in samples[label]]
            lat = [statistics.median(s["latency"]) for s in samples[label]]
            entry[label] = {"tokens_per_s": _stats(tps), "median_request_latency_s": _stats(lat)}
        ratio = [a["seconds"] / b["seconds"] for a, b in zip(samples[mode], samples["base"])]
        entry["slowdown_vs_base"] = _stats(ratio)
        results["modes"][mode] = entry
        print(json.dumps({mode: entry}, indent=1), flush=True)
    text = format_md(results)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
        out.with_suffix(".md").write_text(text)
    return 0


def format_md(r: dict) -> str:
    lines = [f"# Serving speed, {r['device']} TP {r['tp']}: {r['model']}, vLLM {r['vllm']}", "",
             f"`{r['command']}`", "",
             f"{r['adapters']} concurrent adapters, rank {r['rank']} (nblocks {r['nblocks']}), {r['requests']} "
             f"requests x {r['input_len']} prompt tokens -> {r['max_tokens']} generated, {r['dtype']}, "
             f"{r['repeats']} paired repeats (median, min-max).", "",
             "| mode | max-lora-rank | tokens/s (mode) | tokens/s (base, same engine) | request latency s | "
             "slowdown vs base |", "|---|---|---|---|---|---|"]

    def fmt(s, p=1):
        return f"{s['median']:.{p}f} ({s['min']:.{p}f}-{s['max']:.{p}f})"

    for mode, e in r["modes"].items():
        if "skipped" in e:
            lines.append(f"| {mode} | - | {e['skipped']} | | | |")
            continue
        lines.append(f"| {mode} | {e['max_lora_rank']} | {fmt(e[mode]['tokens_per_s'])} | "
                     f"{fmt(e['base']['tokens_per_s'])} | {fmt(e[mode]['median_request_latency_s'], 2)} | "
                     f"{fmt(e['slowdown_vs_base'], 3)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
