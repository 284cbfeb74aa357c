#!/usr/bin/env python
"""Serving speed with vLLM's own tools: BD-LoRA through the plugin vs the same adapters' dense export in vLLM's
default LoRA sharding vs the dense export with --fully-sharded-loras (S-LoRA), plus the frozen base.

Each mode is one `vllm serve` (vLLM's OpenAI-compatible server, started one after another), measured by
`vllm bench serve` (random prompts, --lora-modules with K adapters, --lora-assignment round-robin, --ignore-eos):
  base        the base model, no --enable-lora (the frozen base)
  bdlora      K BD-LoRA adapters through the plugin, --max-lora-rank = the per-rank rank r/TP
  dense       their dense-lora exports (`bdlora export --to dense-lora`), vLLM's default sharding,
              --max-lora-rank >= r
  dense-fs    the dense exports with --fully-sharded-loras (S-LoRA; --max-lora-rank divisible by TP)
Every LoRA mode runs with the plugin loaded, so on vLLM's CPU build all three run its CPU LoRA ops and differ only in
how the adapters are sharded (for plain LoRA adapters the plugin changes nothing else); base runs stock vLLM
(VLLM_PLUGINS=none).
Paired and interleaved: inside every LoRA server, after one untimed run of each, base-model runs and adapter runs
alternate (order swapped each repeat), so each repeat gives a ratio adapter/base on the same server, warm, under the
same machine load; with --rounds > 1 every server is started again per round, the mode order rotated. Reported per
mode: median and min-max over runs of output tokens/s and of the median request latency (vLLM's e2el), the paired
ratio to base, and the ratios between modes of the base-normalised throughput. Raw `vllm bench serve` results stay
in --workdir.

CPU (committed: eval/bench/serving_cpu_tp2.{json,md}), vLLM's CPU build at TP 2 (all three modes run there; TP 3
cannot run --fully-sharded-loras), random weights of a SmolLM2-like Llama with 8 heads:
  .venv-vllm/bin/python scripts/bench_serving.py --device cpu --model smollm2-tp2-shape --tp 2 --rank 32 \\
      --out eval/bench/serving_cpu_tp2.json
GPU (H200; Llama-3.1-8B shapes, random weights via --load-format dummy, bf16), one GPU now and a node:
  python scripts/bench_serving.py --device cuda --model llama-3.1-8b-shapes --tp 1 --rank 16 \\
      --num-prompts 256 --out eval/bench/serving_cuda_tp1.json
  python scripts/bench_serving.py --device cuda --model llama-3.1-8b-shapes --tp 8 --rank 128 \\
      --num-prompts 1024 --out eval/bench/serving_cuda_tp8.json
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
sys.path.insert(0, str(REPO))  # tools/ (the vLLM harness) lives next to the package, not in the wheel

SERVING_ROUTES = ("base", "bdlora", "dense", "dense-fs")
SMOLLM2_TP2 = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, vocab_size=49152, max_position_embeddings=2048,
                   rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _vllm(device: str) -> list[str]:
    """vLLM's CLI: the console script on CUDA builds, the same CLI through tools/vllm_harness/cli.py on the CPU
    build (whose `vllm` script dies at start)."""
    return ["vllm"] if device == "cuda" else [sys.executable, "-m", "tools.vllm_harness.cli"]


def _env(device: str, plugin: bool, tp: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    if device == "cpu":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # nobind: without it each rank starts a thread per core, TP x oversubscribed (eval/bench/cpu_threads_tp3.md)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // tp)))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if not plugin:
        env["VLLM_PLUGINS"] = "none"  # stock vLLM: no general plugin loaded
    return env


def _bench(args, model: str, name: str, loras: list[str], out: Path, env: dict) -> dict:
    """One `vllm bench serve` run against the server at args.url; its saved result."""
    command = [*_vllm(args.device), "bench", "serve", "--backend", "vllm", "--base-url", args.url, "--model", model,
               "--tokenizer", model, "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts), "--ignore-eos",
               "--seed", "0", "--num-warmups", "0", "--save-result", "--result-dir", str(out.parent),
               "--result-filename", out.name, "--percentile-metrics", "ttft,tpot,itl,e2el"]
    if loras:
        command += ["--lora-modules", *loras, "--lora-assignment", "round-robin"]
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, timeout=3600)
    if proc.returncode or not out.exists():
        raise SystemExit(f"vllm bench serve failed ({name}): {out.with_suffix('.log').read_text()[-3000:]}")
    return json.loads(out.read_text())


def _server_command(args, model: str, mode: str, paths: dict, extra: list[str]) -> str:
    launcher = "vllm serve" if args.device == "cuda" else f"{sys.executable} -m tools.vllm_harness.cli serve"
    parts = [launcher, model, "--tensor-parallel-size", str(args.tp), "--max-model-len",
             str(args.input_len + args.output_len + 16), "--max-num-seqs", str(args.num_prompts), *extra]
    if mode != "base":
        rank = args.rank // args.tp if mode == "bdlora" else args.rank
        parts += ["--enable-lora", "--max-loras", str(args.adapters + 1), "--max-lora-rank", str(_max_rank(rank)),
                  "--lora-modules", *(f"a{k}={p}" for k, p in enumerate(paths[mode]))]
        if mode == "dense-fs":
            parts.append("--fully-sharded-loras")
    return " ".join(parts)


def _max_rank(r: int) -> int:
    from bdlora_train.serving.engines import vllm_max_lora_rank

    return vllm_max_lora_rank(r)


def _metrics(result: dict) -> dict:
    return {"tokens_per_s": result["output_throughput"], "median_latency_s": result["median_e2el_ms"] / 1000,
            "median_ttft_s": result["median_ttft_ms"] / 1000, "median_tpot_s": result["median_tpot_ms"] / 1000,
            "completed": result["completed"]}


def run(args) -> dict:
    from tools.vllm_harness import fixtures as fx
    from tools.vllm_harness.server import serving

    nblocks = args.nblocks or args.tp
    if args.rank % nblocks or nblocks % args.tp:
        raise SystemExit(f"--rank {args.rank} must be divisible by --nblocks {nblocks}, and nblocks by --tp {args.tp}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-serving-"))
    workdir.mkdir(parents=True, exist_ok=True)
    smol = fx.smollm2_dir(workdir / "smollm2")
    extra: list[str] = []
    if args.model == "smollm2":
        model = smol
    elif args.model in ("llama-3.1-8b-shapes", "smollm2-tp2-shape"):
        dims = fx.LLAMA_3_1_8B if args.model == "llama-3.1-8b-shapes" else SMOLLM2_TP2
        model = fx.shapes_only_llama_dir(workdir / args.model, smol, dims)
        extra += ["--load-format", "dummy"]
    else:
        model = Path(args.model)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    extra += ["--dtype", dtype]
    paths: dict = {"bdlora": [], "dense": []}
    for k in range(args.adapters):
        a = fx.synthetic_adapter(model, workdir / f"bd-r{args.rank}-n{nblocks}-{k}", args.rank, nblocks, seed=k)
        paths["bdlora"].append(str(a))
        paths["dense"].append(str(fx.dense_export(a, workdir / f"dense-r{args.rank}-n{nblocks}-{k}")))
    paths["dense-fs"] = paths["dense"]
    modes = [m for m in args.modes.split(",") if m]
    load_before = os.getloadavg()  # the machine's load (1, 5, 15 min) as the bench starts and ends, for the record
    runs: dict = {m: {"base": [], m: []} if m != "base" else {"base": []} for m in modes}
    for rnd in range(args.rounds):
        order = modes[rnd % len(modes):] + modes[: rnd % len(modes)]
        for mode in order:
            tag = f"{mode}-tp{args.tp}-round{rnd}"
            command = _server_command(args, str(model), mode, paths, extra)
            env = _env(args.device, plugin=mode != "base", tp=args.tp)
            if args.summarize_only:
                done = sorted(workdir.glob(f"{tag}-*.json"))
                for file in done:
                    label = file.stem[len(tag) + 1:].split("-", 1)[1]  # {tag}-rep{k}-{label}; labels hold "-"
                    runs[mode][label].append(_metrics(json.loads(file.read_text())))
                continue
            t0 = time.perf_counter()
            with serving(command, workdir / f"{tag}.server.log", env=env) as url:
                args.url = url
                print(f"[{tag}] server up in {time.perf_counter() - t0:.0f} s: {command}", flush=True)
                loras = [f"a{k}" for k in range(args.adapters)]
                # one untimed run per label first: a server's first requests load the adapters from disk and
                # allocate, which would bill whichever label runs first (named outside --summarize-only's glob)
                for label in ["base"] if mode == "base" else ["base", mode]:
                    _bench(args, str(model), tag, loras if label != "base" else [],
                           workdir / f"{tag}.warmup-{label}.json", env)
                for rep in range(args.repeats):
                    labels = ["base"] if mode == "base" else (["base", mode] if rep % 2 == 0 else [mode, "base"])
                    for label in labels:
                        out = workdir / f"{tag}-rep{rep}-{label}.json"
                        result = _bench(args, str(model), tag, loras if label != "base" else [], out, env)
                        runs[mode][label].append(_metrics(result))
                        print(f"[{tag}] rep {rep} {label}: {runs[mode][label][-1]}", flush=True)
    results = summarize(args, runs, nblocks, model)
    if not args.summarize_only:
        results["load_average"] = {"start": list(load_before), "end": list(os.getloadavg())}
    return results


def summarize(args, runs: dict, nblocks: int, model) -> dict:
    import vllm  # noqa: F401 - the version, for the record

    results: dict = {"command": "python scripts/bench_serving.py " + " ".join(args.argv), "vllm": vllm.__version__,
                     "device": args.device, "model": args.model, "tp": args.tp, "rank": args.rank, "nblocks": nblocks,
                     "adapters": args.adapters, "num_prompts": args.num_prompts, "input_len": args.input_len,
                     "output_len": args.output_len, "repeats": args.repeats, "rounds": args.rounds,
                     "machine": f"{os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}",
                     "server_env": {k: v for k, v in _env(args.device, True, args.tp).items()
                                    if k.startswith(("VLLM_CPU", "OMP_"))}, "modes": {}}
    normalized = {}
    for mode, by_label in runs.items():
        entry = {label: {k: _stats([r[k] for r in rs]) for k in ("tokens_per_s", "median_latency_s",
                                                                     "median_ttft_s", "median_tpot_s")}
                 for label, rs in by_label.items() if rs}
        if mode != "base" and by_label.get(mode):
            ratios = [m["tokens_per_s"] / b["tokens_per_s"] for m, b in zip(by_label[mode], by_label["base"])]
            entry["throughput_vs_base_same_server"] = _stats(ratios)
            normalized[mode] = ratios
        entry["max_lora_rank"] = None if mode == "base" else _max_rank(args.rank // args.tp if mode == "bdlora"
                                                                         else args.rank)
        results["modes"][mode] = entry
    if "bdlora" in normalized:
        results["bdlora_vs"] = {
            other: _stats([b / o for b in normalized["bdlora"] for o in normalized[other]])
            for other in normalized if other != "bdlora"}
    return results


def _scaled(stats: dict, factor: float) -> dict:
    return {k: v * factor if k != "n" else v for k, v in stats.items()}


def format_md(r: dict) -> str:
    def fmt(s, p=1):
        return f"{s['median']:.{p}f} ({s['min']:.{p}f}-{s['max']:.{p}f})"

    lines = [f"# Serving speed, {r['device']} TP {r['tp']}: {r['model']}, vLLM {r['vllm']}", "",
             f"`{r['command']}`", "",
             f"`vllm serve` + `vllm bench serve`: {r['adapters']} adapters (round-robin), rank {r['rank']}, nblocks "
             f"{r['nblocks']}; {r['num_prompts']} requests of {r['input_len']} random prompt tokens -> "
             f"{r['output_len']} tokens (--ignore-eos), all at once; {r['rounds']} round(s) x {r['repeats']} paired "
             f"repeats; median (min-max). {r.get('machine', '')}"
             + ("; load average (1, 5, 15 min) {} at the start, {} at the end".format(
                 *(" ".join(f"{v:.1f}" for v in r["load_average"][k]) for k in ("start", "end")))
                if "load_average" in r else "")
             + "; server environment: "
             + (" ".join(f"{k}={v}" for k, v in r.get("server_env", {}).items()) or "as is") + ".", "",
             "| mode | max-lora-rank | output tokens/s | base tokens/s, same server | median request latency s | "
             "throughput / base (paired) |", "|---|---|---|---|---|---|"]
    for mode, e in r["modes"].items():
        own = e.get(mode, e.get("base"))
        ratio = fmt(e["throughput_vs_base_same_server"], 3) if "throughput_vs_base_same_server" in e else "1"
        base = fmt(e["base"]["tokens_per_s"]) if mode != "base" else "-"
        lines.append(f"| {mode} | {e['max_lora_rank'] or '-'} | {fmt(own['tokens_per_s'])} | {base} | "
                     f"{fmt(own['median_latency_s'], 2)} | {ratio} |")
    if all("median_tpot_s" in e.get(mode, e["base"]) for mode, e in r["modes"].items()):
        lines += ["", "Where a request's time goes (medians over runs of each run's median): time to first token "
                  "(the prefill, queueing included) and time per output token after it (a decode step).", "",
                  "| mode | TTFT s | base TTFT s, same server | TPOT ms | base TPOT ms, same server |",
                  "|---|---|---|---|---|"]
        for mode, e in r["modes"].items():
            own = e.get(mode, e["base"])
            base = [fmt(e["base"]["median_ttft_s"], 2), fmt(_scaled(e["base"]["median_tpot_s"], 1000))]
            lines.append(f"| {mode} | {fmt(own['median_ttft_s'], 2)} | {base[0] if mode != 'base' else '-'} | "
                         f"{fmt(_scaled(own['median_tpot_s'], 1000))} | {base[1] if mode != 'base' else '-'} |")
    if r.get("bdlora_vs"):
        lines += ["", "BD-LoRA's base-normalised throughput over the other modes' (all pairs of runs): "
                  + "; ".join(f"vs {k}: {fmt(v, 2)}x" for k, v in r["bdlora_vs"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", default="smollm2-tp2-shape", help="smollm2-tp2-shape | llama-3.1-8b-shapes (random "
                   "weights, --load-format dummy) | smollm2 (the embedded model, real weights; TP 3) | an HF dir")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rank", type=int, default=32, help="adapter rank r (the per-rank rank is r/TP)")
    p.add_argument("--nblocks", type=int, default=None, help="default: --tp")
    p.add_argument("--adapters", type=int, default=3, help="adapters served together (round-robin over requests)")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="paired base/adapter runs per server")
    p.add_argument("--rounds", type=int, default=2, help="server starts per mode, the mode order rotated")
    p.add_argument("--modes", default=",".join(SERVING_ROUTES))
    p.add_argument("--workdir", default=None, help="model, adapters, server logs, raw bench results")
    p.add_argument("--out", default=None, help="write the results JSON here (and a .md next to it)")
    p.add_argument("--summarize-only", action="store_true", help="start nothing: summarize the bench results "
                   "already in --workdir")
    args = p.parse_args(argv)
    args.argv = [a for a in argv if a != "--summarize-only"]
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still stops the server it started
    results = run(args)
    text = format_md(results)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
        out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
