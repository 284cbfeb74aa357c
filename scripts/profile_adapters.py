"""Where a BD-LoRA layer's overhead goes inside a training step: torch.profiler over the whole-model step of
scripts/bench_adapters.py (issue 29's setting), the adapter's rank-r GEMMs summed apart from everything else.

    python scripts/profile_adapters.py > eval/bench/profile_adapters_cpu.txt

For PEFT's and the toolkit's BD-LoRA at rank 16: the self CPU time, per step, of the GEMMs with a rank-sized operand
(a dimension equal to r or r / nblocks: only the adapter's products have one), next to the same GEMMs timed alone on
warm inputs (each call repeated in place), which is what a microbenchmark of the layer's kernels sees. baddbmm_ on CPU
runs one addmm_ per block: its rows are its own dispatch, its blocks are the addmm_ rows. One thread, fp32, 5
profiled steps after 3 warm-up steps. (The step's own overhead is scripts/bench_adapters.py's to measure: one
profiled step varies by more than the adapter costs.) Last, the fixed cost of one adapted projection, its GEMMs made
negligible (64 -> 64), unprofiled, median of 3000 calls: forward + backward at 8 tokens, and the eval-mode forward
under no_grad at 1 token (a decode step).
"""

import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_adapters as bench  # noqa: E402  (the same models and step as the benchmark)

GEMMS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::addmm_", "aten::baddbmm", "aten::baddbmm_")
RANK, NBLOCKS, STEPS = 16, 4, 5


def rank_sized(shapes, ranks) -> bool:
    return any(dim in ranks for shape in shapes if isinstance(shape, list) for dim in shape)


def profile_step(step, ranks):
    """(rank-sized GEMM ms, {(op, shapes): (calls, ms, shapes)} of those GEMMs), per step."""
    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(STEPS):
            step()
    adapter, kernels = 0.0, {}
    for event in prof.key_averages(group_by_input_shape=True):
        ms = event.self_cpu_time_total / 1e3 / STEPS
        if event.key in GEMMS and rank_sized(event.input_shapes, ranks):
            adapter += ms
            kernels[(event.key, str(event.input_shapes))] = (event.count // STEPS, ms, event.input_shapes)
    return adapter, kernels


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, 1 thread, fp32, load average {os.getloadavg()}")
    base = bench.build_tiny_model(
        "llama", dtype=torch.float32, num_hidden_layers=2, vocab_size=256, **bench.SHAPES["llama-1024"]
    )
    base.requires_grad_(False)
    variants = bench.build_variants(base, RANK, 2 * RANK, NBLOCKS)
    embeds = torch.randn(1, 512, base.config.hidden_size, requires_grad=True)
    labels = torch.randint(0, 256, (1, 512))
    ranks = {RANK, RANK // NBLOCKS}
    for name, model, _ in variants:
        if f"BD-LoRA r={RANK} " not in name:
            continue
        adapter, kernels = profile_step(bench.make_step(model, embeds, labels), ranks)
        print(f"\n{name}: rank-sized GEMMs {adapter:.1f} ms per step (profiled)")
        warm = 0.0
        for (op, shapes), (calls, ms, dims) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
            alone = 0.0 if op == "aten::baddbmm_" else calls * warm_ms(op, dims)
            warm += alone
            print(f"   {op:14s} {shapes:56s} x{calls:<3d} {ms:6.2f} ms in the step, {alone:6.2f} ms alone warm")
        print(f"   the same GEMMs alone on warm inputs: {warm:.1f} ms")
    fixed_cost()


def fixed_cost() -> None:
    """One 64 -> 64 projection per variant: Python, dispatch and autograd, its GEMMs next to nothing."""
    print("\nOne projection, 64 -> 64 (the fixed cost per adapted layer), us:")
    print(f"   {'variant':32s} {'fwd + bwd, 8 tokens':>20s} {'no_grad fwd, 1 token':>21s}")
    layer = bench.OneProjection(64, 64, torch.device("cpu"), torch.float32, real=True)
    x, grad, token = torch.randn(8, 64, requires_grad=True), torch.randn(8, 64), torch.randn(1, 64)
    variants = bench.build_variants(layer, RANK, 2 * RANK, NBLOCKS, targets=["proj"], roles={"proj": "bd_b"})
    for name, model, _ in variants:
        inner = model.base_model.model if hasattr(model, "base_model") else model  # no PeftModel wrapper call
        train = median_us(lambda: inner(x).backward(grad))
        inner.eval()
        with torch.no_grad():
            decode = median_us(lambda: inner(token))
        inner.train()
        print(f"   {name:32s} {train:20.1f} {decode:21.1f}")


def median_us(step, calls: int = 3000, warmup: int = 50) -> float:
    """One call of `step`, median of `calls` after `warmup` untimed ones, us."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def warm_ms(op: str, shapes) -> float:
    """One call of `op` on operands of `shapes`, median of 20 after 3 warm-up calls, ms."""
    args = [torch.randn(*s) for s in shapes if isinstance(s, list) and s]
    fn = {
        "aten::mm": lambda: torch.mm(args[0], args[1]),
        "aten::bmm": lambda: torch.bmm(args[0], args[1]),
        "aten::addmm_": lambda: args[0].addmm_(args[1], args[2]),
        # out of place with beta=0 (the scaling as alpha): the 0-dim input has no shape, so args are the two factors
        "aten::addmm": lambda: torch.addmm(torch.empty(()), args[0], args[1], beta=0, alpha=2.0),
        "aten::baddbmm": lambda: torch.baddbmm(torch.empty(()), args[0], args[1], beta=0, alpha=2.0),
    }[op]
    return median_us(fn, calls=20, warmup=3) / 1000


if __name__ == "__main__":
    main()
