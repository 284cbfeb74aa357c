"""Adapter overhead on a 4-bit (QLoRA) base: frozen base (the floor) vs PEFT LoRA vs the toolkit's BD-LoRA.

The sibling of scripts/bench_adapters.py, with the same method (its timing and memory helpers are reused): a few
decoder layers with the real models' shapes and random weights, saved and re-loaded by transformers as
bitsandbytes NF4 (double quantization), one training step = forward + backward with gradients reaching the input.
Variants share the 4-bit base, run in interleaved rounds (the order rotates), and the table shows medians;
overhead = step - floor, paired per round. Rows: PEFT LoRA at r (stock PEFT's bitsandbytes layer, what QLoRA users
run), the toolkit's BD-LoRA at the same r, and at the budget-matched rank (2r when that has at most LoRA's
parameters, the paper's setting; otherwise the largest rank that does). On CPU the clock is this process's CPU time.

    python scripts/bench_quant.py --json eval/bench/quant_cpu.json      # CPU, fp32 compute, both shapes
    python scripts/bench_quant.py --exactness --json eval/bench/quant_exactness_cpu.json   # vs the dequantized fp32
    python scripts/bench_quant.py --device cuda --compute-dtype bf16 --tokens 4096 --layers 4 --rounds 20 \
        --json eval/bench/quant_cuda.json                                # GPU (not run here: no GPU on this machine)
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_adapters import (  # noqa: E402
    DEFAULT_RANK,
    DEFAULT_TOKENS,
    NBLOCKS,
    SHAPES,
    budget_rank,
    make_step,
    ratio,
    time_variants,
)
from peft import LoraConfig  # noqa: E402

from bdlora_train import get_peft_model  # noqa: E402
from bdlora_train.core.files import atomic_write_text  # noqa: E402
from bdlora_train.models import build_tiny_model  # noqa: E402
from bdlora_train.peft_integration.config import BlockDiagLoraConfig  # noqa: E402
from bdlora_train.quant.quantized import from_pretrained  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def quantized_base(shape: str, args, device):
    """The shape's decoder layers as a transformers model, re-loaded 4-bit NF4 (double quantization)."""
    from transformers import BitsAndBytesConfig

    torch.manual_seed(0)
    model = build_tiny_model(
        "llama",
        num_hidden_layers=args.layers,
        vocab_size=256,
        max_position_embeddings=max(4096, args.seq),
        **SHAPES[shape],
    )
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=DTYPES[args.compute_dtype],
    )
    with tempfile.TemporaryDirectory(prefix="bench-quant-") as tmp:
        model.save_pretrained(tmp)
        del model
        base = from_pretrained(tmp, config, DTYPES[args.compute_dtype])
    base.requires_grad_(False)
    return base  # from_pretrained placed it: the GPU when CUDA is visible, else the CPU


def build_variants(base, rank: int, rank2: int, nblocks: int):
    def share():
        return copy.deepcopy(base, memo={id(p): p for p in base.parameters()})

    def toolkit(r):
        return BlockDiagLoraConfig(r=r, lora_alpha=2 * r, nblocks=nblocks)

    targets = list(toolkit(nblocks).target_modules)
    configs = [
        ("floor (frozen 4-bit base)", None),
        (f"PEFT LoRA r={rank}", LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)),
        (f"toolkit BD-LoRA r={rank} nb={nblocks}", toolkit(rank)),
        (f"toolkit BD-LoRA r={rank2} nb={nblocks}", toolkit(rank2)),
    ]
    variants = []
    for name, cfg in configs:
        model = share()
        if cfg is not None:
            model = get_peft_model(model, cfg)  # fp32 adapters, as QLoRA trains them
            with torch.no_grad():  # B starts at zero; random values keep the math honest (same cost either way)
                for n, p in model.named_parameters():
                    if "lora_" in n:
                        p.normal_(0, 0.02)
        model.train()
        variants.append((name, model, sum(p.numel() for p in model.parameters() if p.requires_grad)))
    return variants


def bench_shape(shape: str, args, device) -> dict:
    base = quantized_base(shape, args, device)
    nblocks = args.nblocks or NBLOCKS[shape]
    rank = args.rank or DEFAULT_RANK[shape]
    rank2 = args.bd_rank or budget_rank(base, rank, nblocks)
    variants = build_variants(base, rank, rank2, nblocks)
    tokens = args.tokens or DEFAULT_TOKENS[shape]
    batch = max(1, tokens // args.seq)
    seq = tokens // batch
    # Activations in the dtype prepare_model_for_kbit_training leaves them (fp32 norms/embeddings); the 4-bit
    # layers cast to their compute dtype themselves.
    embeds = torch.randn(batch, seq, base.config.hidden_size, device=device, requires_grad=True)
    labels = torch.randint(0, 256, (batch, seq), device=device)
    steps = [make_step(model, embeds, labels) for _, model, _ in variants]
    rows = time_variants(variants, steps, args, device)
    return dict(
        shape=shape,
        layers=args.layers,
        tokens=batch * seq,
        batch=batch,
        seq=seq,
        rank=rank,
        rank2=rank2,
        nblocks=nblocks,
        rounds=args.rounds,
        compute_dtype=args.compute_dtype,
        rows=rows,
    )


def format_result(res: dict) -> str:
    rows = res["rows"]
    floor, lora = rows[0], rows[1]
    lines = [
        f"### {res['shape']}, 4-bit NF4 base (double quant, {res['compute_dtype']} compute): {res['layers']} decoder "
        f"layer(s), {res['tokens']} tokens ({res['batch']} x {res['seq']}), {res['rounds']} rounds",
        "",
        "| variant | adapter params | x LoRA params | step ms (median) | overhead ms (± s.e.) | overhead x PEFT LoRA "
        "| overhead / floor | peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, row in enumerate(rows):
        lines.append(
            f"| {row['variant']} | {row['params']:,} | {ratio(row['params'], lora['params']) if i else '-'} | "
            f"{row['median_ms']:.1f} | {row['overhead_ms']:.1f} ± {row['overhead_se_ms']:.1f} | "
            f"{ratio(row['overhead_ms'], lora['overhead_ms']) if i else '-'} | "
            f"{ratio(row['overhead_ms'], floor['median_ms']) if i else '-'} | {row['peak_mib']:.1f} |"
        )
    return "\n".join(lines)


EXACTNESS = {  # recipe keys per base (the tiny Llama); the reference computes everything in fp32
    "bitsandbytes 4-bit NF4, fp32 compute": dict(load_in_4bit=True, bnb_4bit_compute_dtype="float32"),
    "bitsandbytes 4-bit NF4, bf16 compute, double quant": dict(
        load_in_4bit=True, bnb_4bit_compute_dtype="bfloat16", bnb_4bit_use_double_quant=True
    ),
    "bitsandbytes 4-bit FP4, fp32 compute": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "bitsandbytes 8-bit (LLM.int8)": dict(load_in_8bit=True),
    "torchao int8 weight-only": dict(torchao_int8=True),
}


def exactness() -> list[dict]:
    """BD-LoRA (r=4, nblocks=2) on each quantized tiny Llama vs the same adapter on a float32 copy whose weights are
    the dequantized ones (transformers' / torchao's dequantize): worst relative errors of the train-mode logits and
    of the 28 adapter gradients."""
    from bdlora_train.models import load_model
    from bdlora_train.quant.quantized import dequantize_, quantization_config
    from bdlora_train.recipe.schema import Recipe

    ids = torch.randint(4, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    rows = []
    for name, keys in EXACTNESS.items():
        quantized, _ = load_model("tiny:llama", quantization=quantization_config(Recipe(**keys).quant_keys))
        reference = dequantize_(copy.deepcopy(quantized)).float()
        results = []
        for model in (quantized, reference):
            peft_model = get_peft_model(model, BlockDiagLoraConfig(r=4, nblocks=2))
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for n, p in sorted(peft_model.named_parameters()):
                    if "lora_" in n:
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            out = peft_model.train()(input_ids=ids, labels=ids)
            out.loss.backward()
            grads = {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
            results.append((out.logits.detach(), grads))
        (logits, grads), (ref_logits, ref_grads) = results
        rel = {n: ((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()).item() for n in ref_grads}
        rows.append(
            dict(
                base=name,
                keys=keys,
                logits_max_rel=((logits - ref_logits).abs().max() / ref_logits.abs().max()).item(),
                grad_worst_rel=max(rel.values()),
                grad_median_rel=sorted(rel.values())[len(rel) // 2],
                adapter_tensors=len(rel),
            )
        )
    return rows


def format_exactness(rows: list[dict]) -> str:
    lines = [
        "| base | logits max rel. err | adapter grads: worst rel. L2 err | median | tensors |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['base']} | {r['logits_max_rel']:.1e} | {r['grad_worst_rel']:.1e} | {r['grad_median_rel']:.1e} | "
            f"{r['adapter_tensors']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--layers", type=int, default=1, help="decoder layers per model")
    parser.add_argument("--tokens", type=int, default=None, help=f"tokens per step (default {DEFAULT_TOKENS})")
    parser.add_argument("--seq", type=int, default=128, help="sequence length; batch = tokens // seq")
    parser.add_argument("--rank", type=int, default=None, help=f"LoRA rank r (default {DEFAULT_RANK})")
    parser.add_argument("--bd-rank", type=int, default=None, help="budget-matched BD-LoRA rank (default: see above)")
    parser.add_argument("--nblocks", type=int, default=None, help=f"override the blocks per shape {NBLOCKS}")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--compute-dtype", default="fp32", choices=list(DTYPES), help="bnb_4bit_compute_dtype")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: a shared machine)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default=None, help="default: cpu on CPU, wall on CUDA")
    parser.add_argument(
        "--exactness",
        action="store_true",
        help="instead of timing: BD-LoRA on each quantized base vs the fp32 dequantized reference (tiny Llama)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible to torch")
    if not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    args.clock = args.clock or ("wall" if device.type == "cuda" else "cpu")
    import bitsandbytes

    where = f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else f", {torch.get_num_threads()} threads"
    env = (
        f"torch {torch.__version__}, bitsandbytes {bitsandbytes.__version__}, device {args.device}{where}, "
        f"{args.compute_dtype} compute, {args.clock} clock"
    )
    command = f"python scripts/bench_quant.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    print(f"bench_quant: {env}; command: {command}")
    if args.exactness:
        rows = exactness()
        print()
        print(format_exactness(rows), flush=True)
        if args.json:
            atomic_write_text(args.json, json.dumps(dict(env=env, command=command, exactness=rows), indent=2) + "\n")
        return 0
    results = []
    for shape in args.shapes:
        res = bench_shape(shape, args, device)
        results.append(res)
        print()
        print(format_result(res), flush=True)
    if args.json:
        atomic_write_text(args.json, json.dumps(dict(env=env, command=command, results=results), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
