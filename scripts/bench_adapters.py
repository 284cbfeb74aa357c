"""Adapter overhead benchmark: frozen base (the floor) vs PEFT LoRA vs PEFT's native BD-LoRA vs the toolkit's.

One training step = forward + backward of a few decoder layers with random weights, gradients reaching the
input (as they do for every layer but the first in real training). Variants share the base weights and run in
interleaved rounds (the order rotates every round) so load from other processes hits all of them alike; the
table shows medians. Overhead = step - floor, the median over rounds of each step minus the floor step of the
same round, with the standard error of that median. On CPU the clock is this process's CPU time. Peak memory is
the high-water mark of bytes allocated during one step above what was allocated before it (CUDA: the allocator's
counter; CPU: the profiler's allocation events). Page faults are this process's minor faults per step (median):
memory the allocator handed back to the OS and touched again, a cost the step's clock includes. The FLOP floor is
the step time the adapter's FLOPs (bdlora_train/core/flops.py) would take at the frozen projections' own rate,
measured in the same run.

    python scripts/bench_adapters.py                       # CPU fp32, Llama-3.1-8B and SmolLM2-135M shapes
    python scripts/bench_adapters.py --base zero --rounds 21      # adapter path alone (frozen GEMMs skipped)
    python scripts/bench_adapters.py --modules --rounds 21        # the same, one projection at a time
    python scripts/bench_adapters.py --device cuda --dtype bf16 --tokens 4096 --layers 4 --rounds 20
    # issue 29: 2 layers 1024 -> 2816, 512 tokens; --two-nodes adds the layer before its fused node, as a row
    python scripts/bench_adapters.py --shapes llama-1024 --layers 2 --tokens 512 --seq 512 --rounds 11 --two-nodes
    python scripts/bench_adapters.py --shapes llama-1024 --modules --base real --two-nodes --tokens 512 --rounds 21
    python scripts/bench_adapters.py --shapes llama-1024 --layers 2 --tokens 512 --seq 512 --rounds 41 --inference
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import statistics
import sys
import time
import types
import warnings
from pathlib import Path

import torch
from torch import nn

try:
    import resource  # POSIX: the process's page-fault counter
except ImportError:  # Windows
    resource = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
importlib.import_module("bdlora_train")  # first: its import-chatter filter is in place before PEFT imports torchao

from peft import BdLoraConfig, LoraConfig  # noqa: E402
from peft.tuners.lora.layer import Linear as PeftLoraLinear  # noqa: E402

from bdlora_train import get_peft_model  # noqa: E402
from bdlora_train.budget import count_adapter_params, match_budget  # noqa: E402
from bdlora_train.core.files import atomic_write_text  # noqa: E402
from bdlora_train.core.flops import projection_flops  # noqa: E402
from bdlora_train.models import build_tiny_model, meta_model, tiny_config  # noqa: E402
from bdlora_train.peft_integration.config import BlockDiagLoraConfig, prepare_bdlora_config  # noqa: E402
from bdlora_train.peft_integration.layers import BlockDiagLoraLinear  # noqa: E402
from bdlora_train.tp_diagnostics.ranks import step_peak_bytes  # noqa: E402

# Decoder-layer shapes of the real models; vocab kept tiny so the LM head does not drown the layers.
SHAPES = {
    "llama-3.1-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128
    ),
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64
    ),
    # Issue 29's single-device setting (a ~1B-class Llama layer): 1024 -> 2816, run with --layers 2 --tokens 512.
    "llama-1024": dict(
        hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4, head_dim=64
    ),
}
# TP degree the heads allow (paper: 8; SmolLM2: 3 KV heads; llama-1024: 4 KV heads)
NBLOCKS = {"llama-3.1-8b": 8, "smollm2-135m": 3, "llama-1024": 4}
DEFAULT_TOKENS = {"llama-3.1-8b": 128, "smollm2-135m": 512, "llama-1024": 512}  # per step on CPU (--tokens)
DEFAULT_RANK = {"llama-3.1-8b": 32, "smollm2-135m": 24, "llama-1024": 16}  # a multiple of nblocks
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class _SkippedGemm(torch.autograd.Function):
    """x W^T and its input gradient g W without the GEMMs: zeros of the right shapes, gradients still flowing."""

    @staticmethod
    def forward(x, out_features):
        return x.new_zeros(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad):
        return grad.new_zeros(*grad.shape[:-1], ctx.in_features), None

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.in_features = inputs[0].shape[-1]


class ZeroProjection(nn.Linear):
    """A projection with the real shapes whose frozen GEMMs are skipped (forward and input gradient are zeros).
    With `--base zero` every variant keeps attention, norms, the backward through them, and its adapter, so
    step - floor is the adapter path alone, without the run-to-run noise of the big frozen GEMMs (on CPU they
    are ~98% of a Llama-3.1-8B layer's step)."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.new_empty(0), requires_grad=False)  # dtype/device for PEFT
        self.bias = None

    def forward(self, x):
        return _SkippedGemm.apply(x, self.out_features)


def zero_projections(model) -> None:
    targets = set(BlockDiagLoraConfig(r=1, nblocks=1).target_modules)
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in targets and isinstance(module, nn.Linear):
            parent, leaf = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), leaf, ZeroProjection(module))


def budget_rank(base, rank: int, nblocks: int) -> int:
    """The paper's matched budget, BD-LoRA at 2r, when that has at most LoRA's parameters (Llama-3.1-8B, nb 8:
    0.86x); otherwise (few blocks) the largest BD rank that does."""
    lora = count_adapter_params(
        base, LoraConfig(r=rank, target_modules=list(BlockDiagLoraConfig(r=nblocks, nblocks=nblocks).target_modules))
    )
    if count_adapter_params(base, BlockDiagLoraConfig(r=2 * rank, nblocks=nblocks)) <= lora:
        return 2 * rank
    return match_budget(base, rank, nblocks, mode="below")


def two_nodes(model):
    """The toolkit's layers as they were before the fused base-and-adapter node: PEFT's `Linear.forward`, the
    base layer and `_BlockDiagLoraAdd` as two autograd nodes (the `--two-nodes` comparison row)."""
    for module in model.modules():
        if isinstance(module, BlockDiagLoraLinear):
            module.forward = types.MethodType(PeftLoraLinear.forward, module)
    return model


def build_variants(
    base,
    rank: int,
    rank2: int,
    nblocks: int,
    targets=None,
    roles=None,
    two_node_row=False,
    dropout=0.0,
    inference=False,
):
    """(name, model, params) for every variant, each with lora_dropout `dropout`, in training mode (eval mode for
    `inference`); all share the base weights (deepcopy memo keeps them)."""
    targets = list(targets or BlockDiagLoraConfig(r=nblocks, nblocks=nblocks).target_modules)

    def share():
        return copy.deepcopy(base, memo={id(p): p for p in base.parameters()})

    def toolkit(r):
        return BlockDiagLoraConfig(
            r=r, lora_alpha=2 * r, nblocks=nblocks, target_modules=targets, roles=roles, lora_dropout=dropout
        )

    def stock_bd(r):
        bound = toolkit(r)
        prepare_bdlora_config(base, bound)  # the same role patterns the toolkit writes, as a plain PEFT config
        return LoraConfig(
            r=r,
            lora_alpha=2 * r,
            target_modules=targets,
            lora_dropout=dropout,
            use_bdlora=BdLoraConfig(
                target_modules_bd_a=bound.use_bdlora.target_modules_bd_a,
                target_modules_bd_b=bound.use_bdlora.target_modules_bd_b,
                nblocks=nblocks,
                match_strict=True,
            ),
        )

    configs = [
        ("floor (frozen base)", None),
        (f"PEFT LoRA r={rank}", LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=dropout)),
        (f"PEFT BD-LoRA r={rank} nb={nblocks}", stock_bd(rank)),
        (f"toolkit BD-LoRA r={rank} nb={nblocks}", toolkit(rank)),
        (f"PEFT BD-LoRA r={rank2} nb={nblocks}", stock_bd(rank2)),
        (f"toolkit BD-LoRA r={rank2} nb={nblocks}", toolkit(rank2)),
    ]
    if two_node_row:
        configs.append((f"toolkit BD-LoRA r={rank2} nb={nblocks}, two nodes (before)", toolkit(rank2)))
    variants = []
    for name, cfg in configs:
        model = share()
        if cfg is not None:
            model = get_peft_model(model, cfg, autocast_adapter_dtype=False)  # adapters in the run's dtype
            if name.endswith("two nodes (before)"):
                two_nodes(model)
            with torch.no_grad():  # B starts at zero; random values keep the math honest (same cost either way)
                for n, p in model.named_parameters():
                    if "lora_" in n:
                        p.normal_(0, 0.02)
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        model.train(not inference)
        variants.append((name, model, params))
    return variants


def make_step(model, embeds, labels, inference=False):
    def step():
        if inference:  # eval and generation: the forward alone, under no_grad
            with torch.no_grad():
                model(inputs_embeds=embeds)
            return
        embeds.grad = None
        for p in model.parameters():
            p.grad = None
        loss = model(inputs_embeds=embeds, labels=labels).loss
        loss.backward()

    return step


class OneProjection(nn.Module):
    """A single projection (its frozen GEMMs skipped), for the per-module breakdown."""

    def __init__(self, d_in, d_out, device, dtype, real=False):
        super().__init__()
        if real:  # --base real: the frozen projection itself, its GEMMs timed in every variant
            self.proj = nn.Linear(d_in, d_out, bias=False, device=device, dtype=dtype).requires_grad_(False)
            return
        self.proj = ZeroProjection(nn.Linear(d_in, d_out, bias=False, device="meta"))
        self.proj.weight = nn.Parameter(torch.empty(0, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x):
        return self.proj(x)


def make_module_step(model, x, weights, inference=False):
    def step():
        if inference:
            with torch.no_grad():
                model(x)
            return
        x.grad = None
        for p in model.parameters():
            p.grad = None
        (model(x) * weights).sum().backward()  # a dense (T, d_out) output gradient, as a next layer gives

    return step


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_shape(shape: str, args, device, dtype) -> dict:
    torch.manual_seed(0)
    base = build_tiny_model(
        "llama",
        dtype=dtype,
        num_hidden_layers=args.layers,
        vocab_size=256,
        max_position_embeddings=max(4096, args.seq),
        **SHAPES[shape],
    ).to(device)
    base.requires_grad_(False)
    nblocks = args.nblocks or NBLOCKS[shape]
    rank = args.rank or DEFAULT_RANK[shape]
    rank2 = args.bd_rank or budget_rank(base, rank, nblocks)
    if args.base == "zero":
        zero_projections(base)
    variants = build_variants(
        base, rank, rank2, nblocks, two_node_row=args.two_nodes, dropout=args.lora_dropout, inference=args.inference
    )
    tokens = args.tokens or DEFAULT_TOKENS[shape]
    batch = max(1, tokens // args.seq)
    seq = tokens // batch
    embeds = torch.randn(batch, seq, base.config.hidden_size, device=device, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 256, (batch, seq), device=device)
    steps = [make_step(model, embeds, labels, args.inference) for _, model, _ in variants]
    rows = time_variants(variants, steps, args, device)
    floor = flop_floor_ms(shape, args.layers, batch * seq, nblocks, args, device, dtype)
    for row in rows:
        row["flop_floor_ms"] = floor(row["variant"])
    return dict(
        shape=shape,
        base=args.base,
        inference=args.inference,
        layers=args.layers,
        tokens=batch * seq,
        batch=batch,
        seq=seq,
        rank=rank,
        rank2=rank2,
        nblocks=nblocks,
        rounds=args.rounds,
        rows=rows,
    )


def minor_faults() -> int:
    """Minor page faults of this process so far (0 where the platform does not count them: the rows say None)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0


def time_variants(variants, steps, args, device) -> list[dict]:
    """Warm up, measure peak memory, then time interleaved rounds (the order rotates every round)."""
    # CPU time of this process is what a shared machine cannot steal; on CUDA the wall clock is the measure.
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for step in steps:  # warm-up: allocator, kernels, lazy init
        for _ in range(args.warmup):
            step()
    peaks = [step_peak_bytes(step, device) for step in steps]
    times = [[] for _ in steps]
    faults = [[] for _ in steps]
    for rnd in range(args.rounds):
        order = list(range(len(steps)))
        order = order[rnd % len(order) :] + order[: rnd % len(order)]
        for i in order:
            sync(device)
            f0, t0 = minor_faults(), clock()
            steps[i]()
            sync(device)
            times[i].append(clock() - t0)
            faults[i].append(minor_faults() - f0)
    rows = []
    for (name, _, params), ts, fs, peak in zip(variants, times, faults, peaks):
        # Overhead pairs each step with the floor step of the same round, so slow drifts in machine load cancel.
        diffs = [1e3 * (t - f) for t, f in zip(ts, times[0])]
        mad = statistics.median(abs(d - statistics.median(diffs)) for d in diffs)
        rows.append(
            dict(
                variant=name,
                params=params,
                median_ms=1e3 * statistics.median(ts),
                min_ms=1e3 * min(ts),
                overhead_ms=statistics.median(diffs),
                overhead_se_ms=1.2533 * 1.4826 * mad / len(diffs) ** 0.5,  # std. error of a median
                peak_mib=peak / 2**20,
                page_faults=statistics.median(fs) if resource else None,
                times_ms=[1e3 * t for t in ts],
            )
        )
    return rows


def flop_floor_ms(shape: str, layers: int, tokens: int, nblocks: int, args, device, dtype):
    """A function (variant name -> ms): the step time that variant's adapter FLOPs (`core/flops.py`, forward +
    backward) would take at the frozen projections' own FLOP rate, measured here on each projection's forward GEMM
    x W^T (median of 7). A floor no GEMM-by-GEMM layer reaches: rank-r GEMMs run below the big GEMMs' rate
    (scripts/bench_rank_gemms.py)."""
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    shapes = projection_shapes(shape)
    base_flops = base_ms = 0.0
    for _, d_in, d_out, role, count in shapes:
        x = torch.randn(tokens, d_in, device=device, dtype=dtype)
        weight = torch.randn(d_out, d_in, device=device, dtype=dtype)
        times = []
        for _ in range(9):
            sync(device)
            t0 = clock()
            torch.nn.functional.linear(x, weight)
            sync(device)
            times.append(clock() - t0)
        base_ms += count * 1e3 * statistics.median(times[2:])
        base_flops += count * projection_flops(d_in, d_out, 1, column=True, block_diagonal=False)[0]
    ms_per_flop = 2 * base_ms / base_flops  # the base's FLOPs are forward + input gradient: twice the forward GEMM

    def floor(variant: str) -> float | None:
        if " r=" not in variant:
            return None
        r = int(variant.split(" r=")[1].split()[0])
        bd = "BD" in variant
        flops = sum(
            count * projection_flops(d_in, d_out, r, column=role == "bd_b", block_diagonal=bd, nblocks=nblocks)[1]
            for _, d_in, d_out, role, count in shapes
        )
        return layers * flops * ms_per_flop / (3 if args.inference else 1)  # forward: 1 of each product's 3

    return floor


def projection_shapes(shape: str) -> list[tuple[str, int, int, str, int]]:
    """(name, d_in, d_out, role, count per decoder layer) of the 7 projections."""
    dims = SHAPES[shape]
    h, q, kv, inter = (
        dims["hidden_size"],
        dims["num_attention_heads"] * dims["head_dim"],
        dims["num_key_value_heads"] * dims["head_dim"],
        dims["intermediate_size"],
    )
    return [
        ("q_proj", h, q, "bd_b", 1),
        ("k_proj, v_proj", h, kv, "bd_b", 2),
        ("o_proj", q, h, "bd_a", 1),
        ("gate_proj, up_proj", h, inter, "bd_b", 2),
        ("down_proj", inter, h, "bd_a", 1),
    ]


def bench_modules(shape: str, args, device, dtype) -> dict:
    """Each projection alone, frozen GEMMs skipped: the adapter cost per module, and where a layer's time goes."""
    nblocks = args.nblocks or NBLOCKS[shape]
    rank = args.rank or DEFAULT_RANK[shape]
    torch.manual_seed(0)
    layer = meta_model(tiny_config("llama", num_hidden_layers=1, vocab_size=256, **SHAPES[shape]))
    rank2 = args.bd_rank or budget_rank(layer, rank, nblocks)
    tokens = args.tokens or DEFAULT_TOKENS[shape]
    modules = []
    for name, d_in, d_out, role, count in projection_shapes(shape):
        base = OneProjection(d_in, d_out, device, dtype, real=args.base == "real")
        variants = build_variants(
            base,
            rank,
            rank2,
            nblocks,
            targets=["proj"],
            roles={"proj": role},
            two_node_row=args.two_nodes,
            dropout=args.lora_dropout,
            inference=args.inference,
        )
        x = torch.randn(tokens, d_in, device=device, dtype=dtype, requires_grad=True)
        weights = torch.randn(tokens, d_out, device=device, dtype=dtype)
        steps = [make_module_step(model, x, weights, args.inference) for _, model, _ in variants]
        modules.append(
            dict(
                module=name,
                d_in=d_in,
                d_out=d_out,
                role=role,
                count=count,
                rows=time_variants(variants, steps, args, device),
            )
        )
    return dict(
        shape=shape,
        mode="modules",
        base=args.base,
        inference=args.inference,
        tokens=tokens,
        rank=rank,
        rank2=rank2,
        nblocks=nblocks,
        rounds=args.rounds,
        modules=modules,
    )


def format_modules(res: dict) -> str:
    names = [row["variant"] for row in res["modules"][0]["rows"]][1:]
    lines = [
        f"### {res['shape']}: adapter overhead per projection "
        f"({'frozen GEMMs timed too' if res['base'] == 'real' else 'frozen GEMMs skipped'}"
        f"{', forward only under no_grad' if res.get('inference') else ''}), {res['tokens']} tokens, "
        f"{res['rounds']} rounds, ms (median, paired with the floor)",
        "",
        "| module | d_in -> d_out | role | " + " | ".join(names) + " | toolkit / PEFT BD r | toolkit / PEFT BD r2 |",
        "|---|---|---|" + "---:|" * (len(names) + 2),
    ]
    layer = [0.0] * len(names)
    for mod in res["modules"]:
        over = [row["overhead_ms"] for row in mod["rows"]][1:]
        layer = [acc + mod["count"] * o for acc, o in zip(layer, over)]
        lines.append(
            f"| {mod['module']} | {mod['d_in']} -> {mod['d_out']} | {mod['role']} | "
            + " | ".join(f"{o:.2f}" for o in over)
            + f" | {ratio(over[2], over[1])} | {ratio(over[4], over[3])} |"
        )
    lines.append(
        "| **decoder layer** (q + 2 kv + o + 2 gate/up + down) | | | "
        + " | ".join(f"**{o:.2f}**" for o in layer)
        + f" | **{ratio(layer[2], layer[1])}** | **{ratio(layer[4], layer[3])}** |"
    )
    lines += [
        "",
        f"Per layer: toolkit BD-LoRA r={res['rank2']} / PEFT LoRA r={res['rank']}: {ratio(layer[4], layer[0])}",
    ]
    if len(layer) > 5:
        lines.append(
            f"Per layer, two nodes (before): toolkit / PEFT BD r2: {ratio(layer[5], layer[3])}; "
            f"fused / two nodes: {ratio(layer[4], layer[5])}"
        )
    return "\n".join(lines)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "n/a"


def floor_cells(row: dict) -> str:
    """The FLOP floor and the overhead as a multiple of it ('- | -' for the frozen base, or a result without it)."""
    floor = row.get("flop_floor_ms")
    return f"{floor:.1f} | {ratio(row['overhead_ms'], floor)}" if floor else "- | -"


def format_result(res: dict) -> str:
    rows = res["rows"]
    lora, peft_bd, ours = rows[1], rows[2], rows[3]
    lines = [
        f"### {res['shape']}: {res['layers']} decoder layer(s), {res['tokens']} tokens ({res['batch']} x "
        f"{res['seq']}), "
        f"{res['rounds']} rounds{', base projections zeroed (adapter path only)' if res['base'] == 'zero' else ''}"
        f"{', forward only under no_grad (eval mode)' if res.get('inference') else ''}",
        "",
        "| variant | adapter params | x LoRA params | step ms (median) | overhead ms (± s.e.) | x PEFT BD-LoRA "
        "same r | x PEFT LoRA r | FLOP floor ms | x floor | peak MiB | page faults |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, row in enumerate(rows):
        same_r_peft = (rows[4] if i > 5 else rows[i - 1]) if "toolkit" in row["variant"] else None
        lines.append(
            f"| {row['variant']} | {row['params']:,} | {ratio(row['params'], lora['params']) if i else '-'} | "
            f"{row['median_ms']:.1f} | {row['overhead_ms']:.1f} ± {row['overhead_se_ms']:.1f} | "
            f"{ratio(row['overhead_ms'], same_r_peft['overhead_ms']) if same_r_peft else '-'} | "
            f"{ratio(row['overhead_ms'], lora['overhead_ms']) if i else '-'} | "
            f"{floor_cells(row)} | {row['peak_mib']:.1f} | "
            f"{'-' if row['page_faults'] is None else round(row['page_faults'])} |"
        )
    big_ours = rows[5]
    lines += [
        "",
        f"Targets (issue 29): toolkit/PEFT BD-LoRA overhead at r={res['rank']}: "
        f"{ratio(ours['overhead_ms'], peft_bd['overhead_ms'])} "
        f"(<= 0.5), at r={res['rank2']}: {ratio(big_ours['overhead_ms'], rows[4]['overhead_ms'])} (<= 0.5); "
        f"toolkit BD-LoRA r={res['rank2']} ({ratio(big_ours['params'], lora['params'])}x LoRA params) "
        f"overhead / PEFT LoRA r={res['rank']} overhead: {ratio(big_ours['overhead_ms'], lora['overhead_ms'])} "
        "(<= 1.00)",
    ]
    if len(rows) > 6:
        lines.append(
            f"Two nodes (before): toolkit/PEFT BD-LoRA overhead at r={res['rank2']}: "
            f"{ratio(rows[6]['overhead_ms'], rows[4]['overhead_ms'])}; fused / two nodes: "
            f"{ratio(big_ours['overhead_ms'], rows[6]['overhead_ms'])}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "smollm2-135m"], choices=list(SHAPES))
    parser.add_argument("--layers", type=int, default=1, help="decoder layers per model")
    parser.add_argument("--tokens", type=int, default=None, help=f"tokens per step (default {DEFAULT_TOKENS})")
    parser.add_argument("--seq", type=int, default=128, help="sequence length; batch = tokens // seq")
    parser.add_argument(
        "--rank", type=int, default=None, help=f"LoRA rank r, BD-LoRA runs at r too (default {DEFAULT_RANK})"
    )
    parser.add_argument(
        "--bd-rank",
        type=int,
        default=None,
        help="the budget-matched BD-LoRA rank (default: 2r if it has <= LoRA's params, else match_budget)",
    )
    parser.add_argument("--nblocks", type=int, default=None, help=f"override the blocks per shape {NBLOCKS}")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    parser.add_argument(
        "--base",
        choices=("real", "zero"),
        default=None,
        help="zero: skip the frozen projections' GEMMs in every variant, timing the adapter path alone "
        "(default: real for decoder layers, zero with --modules)",
    )
    parser.add_argument(
        "--modules",
        action="store_true",
        help="time each projection alone (frozen GEMMs skipped unless --base real) instead of decoder layers",
    )
    parser.add_argument(
        "--two-nodes",
        action="store_true",
        help="add a row: the toolkit's layer with base and adapter as two autograd nodes (before the fused node)",
    )
    parser.add_argument(
        "--lora-dropout", type=float, default=0.0, help="every variant's lora_dropout (PEFT's default 0.0)"
    )
    parser.add_argument(
        "--inference",
        action="store_true",
        help="time eval-mode forwards under no_grad (evaluation, generation) instead of training steps",
    )
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared machine, multi-threaded GEMMs time the neighbours)",
    )
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default=None,
        help="cpu = process CPU time (default on CPU), wall = perf_counter (default on CUDA)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = parser.parse_args(argv)
    args.base = args.base or ("zero" if args.modules else "real")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # transformers deprecation noise
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible to torch")
    if args.threads and not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    args.clock = args.clock or ("wall" if device.type == "cuda" else "cpu")
    where = f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else f", {torch.get_num_threads()} threads"
    env = f"torch {torch.__version__}, device {args.device}{where}, {args.dtype}, {args.clock} clock"
    print(
        f"bench_adapters: {env}; command: python scripts/bench_adapters.py "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    load_before = os.getloadavg()
    results = []
    for shape in args.shapes:
        res = (bench_modules if args.modules else bench_shape)(shape, args, device, dtype)
        results.append(res)
        print()
        print((format_modules if args.modules else format_result)(res), flush=True)
    if args.json:
        atomic_write_text(
            args.json,
            json.dumps(
                dict(
                    env=env, argv=sys.argv[1:], loadavg=dict(before=load_before, after=os.getloadavg()), results=results
                ),
                indent=2,
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
