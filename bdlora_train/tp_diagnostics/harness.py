"""The forward check and benchmark: shard base model and adapter over N ranks (ranks.py), count and time.

`tp_check` proves a sharded adapter equals the unsharded PEFT model and counts the collectives of base,
BD-LoRA and S-LoRA sharding; `bench_tp` times them. The base and S-LoRA run on the S-LoRA model (shard_model.py
`shard_model`), BD-LoRA on the training runtime's layers (`runtime_model`): the same base sharding, the same
adapter values. Both spawn their own ranks (torch.multiprocessing) and assert the world size; call them under
`if __name__ == "__main__":` in scripts.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bdlora_train.adapters.reader import read_adapter
from bdlora_train.adapters.shapes import base_model_for, verify_shapes
from bdlora_train.core.degrees import divides
from bdlora_train.core.errors import TPError
from bdlora_train.peft_integration.storage import quiet_peft_save
from bdlora_train.tp_diagnostics.ranks import (
    check_tp_degree,
    comm_counter,
    launch,
    machine_record,
    quiet_warnings,
    rel_err,
    timing_row,
    token_ids,
)
from bdlora_train.tp_diagnostics.shard_model import runtime_model, set_mode, shard_model, tp_styles
from bdlora_train.tp_diagnostics.sharded_lora import FORWARD_SCHEMES

TOLERANCE = 1e-4  # max relative error (fp32) for "sharded == unsharded"
# A Llama-shaped random model with real layer widths (Llama-style 1024 -> 2816 MLP) for latency; small vocab so
# the replicated lm_head does not dominate.
BENCH_DIMS = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=1024,
    max_position_embeddings=4096,
)
# Llama-3.1-8B's layer widths (hidden 4096, MLP 14336, 32 heads / 8 KV heads of 128), 2 layers: `--model bench-8b`,
# the GPU line of bench-tp --train (docs/tp.md, "Speed").
BENCH_8B_DIMS = dict(
    BENCH_DIMS,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=2,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)


def _load_base(job: dict):
    from bdlora_train.models import build_tiny_model, load_model

    if job.get("overrides"):
        model = build_tiny_model(job["base"].split(":", 1)[1], seed=0, **job["overrides"])
    else:
        model = load_model(job["base"])[0]
    return model.to(job.get("device", "cpu")).eval()  # load_model and build_tiny_model give fp32 already


def _check_job(job: dict, mesh) -> dict:
    """One model + adapter: unsharded PEFT reference, then the sharded forward in each mode, counted."""
    from bdlora_train.adapters.load import load_adapter

    model = _load_base(job)
    adapter = read_adapter(job["adapter"])
    ids = token_ids(model.config, 2, job["tokens"], seed=1234).to(model.device)
    with torch.no_grad():
        base_ref = model(ids, use_cache=False).logits
        peft_model = load_adapter(copy.deepcopy(model), job["adapter"]).eval()
        ref = peft_model(ids, use_cache=False).logits
        del peft_model
        models = _sharded_models(model, mesh, adapter, job["adapter"])
        result = dict(
            model=job["base"],
            adapter="random" if job.get("random") else str(job["adapter"]),
            nblocks=adapter.nblocks,
            r=adapter.config.r,
            tokens=job["tokens"],
            world_size=dist.get_world_size(),
            adapter_effect=rel_err(ref, base_ref),
        )
        for mode in FORWARD_SCHEMES:
            with comm_counter() as comm:
                logits = models(mode)(ids, use_cache=False).logits
            result[f"{mode}_collectives"] = comm.get_total_counts()
            result[f"{mode}_bytes"] = comm.comm_bytes
            result[f"{mode}_ops"] = {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items()}
            result[f"{mode}_rel_err"] = rel_err(logits, base_ref if mode == "base" else ref)
    result["max_rel_err"] = result["bdlora_rel_err"]
    result["experts"] = _experts_note(adapter)
    return result


# What each mode runs: BD-LoRA the training runtime's layers, "base" the same model with its adapter off (the
# adapter's own cost, on one code path), S-LoRA the S-LoRA model, "slora_base" that model's sharded base (S-LoRA's
# ratio is to it: PyTorch's TP hooks on a Linear cost CPU time that the runtime's layers do not pay).
TIMED = ("base", "bdlora", "slora_base", "slora")


def _sharded_models(model, mesh, adapter, adapter_path):
    """mode (TIMED) -> a callable running the sharded model of that mode: the training runtime's (on a copy of
    `model`), with its adapter on or off, or the S-LoRA model (`model` itself, switched)."""
    runtime = runtime_model(copy.deepcopy(model), mesh, adapter_path).eval()
    layers = shard_model(model, mesh, adapter)

    def models(mode: str):  # switched here, outside any timed region
        if mode in ("bdlora", "base"):
            lora = runtime.base_model  # PEFT's LoraModel
            switch = lora.enable_adapter_layers if mode == "bdlora" else lora.disable_adapter_layers
            switch()
            return runtime
        set_mode(layers, "slora" if mode == "slora" else "base")
        return model

    return models


def _experts_note(adapter) -> str | None:
    experts = [m for m in adapter.modules.values() if m.experts]
    if not experts:
        return None
    return (
        f"{len(experts)} expert parameters adapted: the experts run whole on every rank here (tp-check --train checks "
        "the runtime's expert sharding on a base transformers loads sharded)"
    )


def _bench_job(job: dict, mesh) -> dict:
    """Median TP forward latency per mode and token count; modes interleaved so drift hits all alike."""
    model = _load_base(job)
    models = _sharded_models(model, mesh, read_adapter(job["adapter"]), job["adapter"])
    rows = []
    for tokens in job["token_counts"]:
        ids = token_ids(model.config, 1, tokens, seed=tokens).to(model.device)
        sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)  # GPU kernels are asynchronous
        times = {mode: [] for mode in TIMED}
        cpu = {mode: [] for mode in TIMED}  # this process's CPU time: less disturbed by load than wall time
        counts = {}
        with torch.no_grad():
            for mode in TIMED:  # warm-up, and one counted forward
                with comm_counter() as comm:
                    models(mode)(ids, use_cache=False)
                counts[mode] = (comm.get_total_counts(), comm.comm_bytes)
            for _ in range(job["repeats"]):
                for mode in TIMED:
                    net = models(mode)
                    dist.barrier()
                    sync()
                    start, start_cpu = time.perf_counter(), time.process_time()
                    net(ids, use_cache=False)
                    sync()
                    times[mode].append(time.perf_counter() - start)
                    cpu[mode].append(time.process_time() - start_cpu)
        row = timing_row(tokens, TIMED, times, cpu, counts, ("bdlora",))
        row["slora_ratio"] = row["slora_ms"] / row["slora_base_ms"]
        row["slora_cpu_ratio"] = row["slora_cpu_ms"] / row["slora_base_cpu_ms"]
        rows.append(row)
    return dict(world_size=dist.get_world_size(), rows=rows)


def _merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """Rank 0's check results, after checking that every rank counted the same collectives; errors are the worst
    rank's."""
    for i, result in enumerate(per_rank[0]):
        for key in ("base_collectives", "bdlora_collectives", "slora_collectives"):
            values = {results[i][key] for results in per_rank}
            if len(values) > 1:
                raise RuntimeError(f"tp: ranks disagree on {key}: {sorted(values)}")
        for key in ("max_rel_err", "slora_rel_err", "base_rel_err"):
            result[key] = max(results[i][key] for results in per_rank)
    return per_rank[0]


def _tiny_overrides(base: str, tp: int) -> dict:
    """A built-in tiny model gets enough heads for --tp (its default 4 heads / 2 KV heads fit TP 1 and 2)."""
    if divides(tp, 2):
        return {}
    return dict(
        hidden_size=32 * tp,
        num_attention_heads=2 * tp,
        num_key_value_heads=tp,
        intermediate_size=128 if divides(tp, 128) else 48 * tp,
    )


def random_adapter(
    out_dir,
    base: str = "tiny:llama",
    tp: int = 2,
    r: int | None = None,
    overrides: dict | None = None,
    seed: int = 0,
    b_std: float = 0.05,
    config: dict | None = None,
):
    """Save a BD-LoRA adapter (nblocks = tp) with random, non-zero A *and* B on a base model; returns its path.

    `config`: extra BlockDiagLoraConfig arguments (target_modules, target_parameters, roles, experts, ...).
    With `overrides` (a tiny model of non-default shape) the base's config.json is written to `<out_dir>-base` and
    recorded as the adapter's base_model_name_or_path, so every command checks the adapter against the true shapes.
    """
    from bdlora_train.models import build_tiny_model, load_model
    from bdlora_train.peft_integration.config import BlockDiagLoraConfig, get_peft_model

    r = r or tp * math.ceil(8 / tp)
    quiet_warnings()
    model = build_tiny_model(base.split(":", 1)[1], seed=0, **overrides) if overrides else load_model(base)[0]
    peft_model = get_peft_model(model, BlockDiagLoraConfig(r=r, lora_alpha=2 * r, nblocks=tp, **(config or {})))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero; a zero adapter would prove nothing
                param.copy_(torch.randn(param.shape, generator=generator) * b_std)
        for module in peft_model.modules():  # a densely stored block-diagonal B keeps its zeros, as training does
            for buffer_name, mask in module.named_buffers(recurse=False):
                if buffer_name.startswith("bdmask_B_"):
                    module.lora_B[buffer_name.removeprefix("bdmask_B_")].weight.mul_(mask)
    if overrides:
        base = str(Path(out_dir).with_name(Path(out_dir).name + "-base"))
        model.config.save_pretrained(base)
    peft_model.peft_config["default"].base_model_name_or_path = base
    with quiet_peft_save():
        peft_model.save_pretrained(str(out_dir))
    return Path(out_dir)


def _prepare(adapter_path, tp: int, base: str | None, workdir: str, r: int | None = None) -> dict:
    """A job dict for the ranks: with no adapter, a tiny random Llama (or --base) with a random BD-LoRA adapter."""
    from bdlora_train.models import load_config, meta_model, tiny_config

    if tp < 1:
        raise TPError(f"tp: --tp {tp}; use a positive TP degree such as 2")
    if adapter_path is None:
        spec = base or "tiny:llama"
        overrides = _tiny_overrides(spec, tp) if spec.startswith("tiny:") else {}
        config = tiny_config(spec.split(":", 1)[1], **overrides) if overrides else load_config(spec)
        tp_styles(meta_model(config), tp)
        adapter_path = random_adapter(Path(workdir, "adapter"), spec, tp, r=r, overrides=overrides)
        return dict(base=spec, overrides=overrides, adapter=str(adapter_path), random=True)
    adapter = read_adapter(adapter_path)
    model = base_model_for(adapter, base)
    verify_shapes(adapter, model)  # a base of other shapes: one line here, not a traceback from every rank
    tp_styles(model, tp, adapter)
    return dict(base=adapter.base_spec(base), overrides={}, adapter=str(adapter_path))


def tp_check(
    adapter=None,
    tp: int = 2,
    base: str | None = None,
    tokens: int = 16,
    extra_bases: list[str] = (),
    device: str = "cpu",
    extra_adapters: list = (),
) -> list[dict]:
    """Run the TP check for an adapter (or a random adapter on `base`), then each of `extra_adapters` (saved
    adapters on their own bases) and random adapters on each of `extra_bases`, all in one spawn."""
    check_tp_degree(tp)
    with tempfile.TemporaryDirectory(prefix="bdlora-tpcheck-") as workdir:
        jobs = [_prepare(adapter, tp, base, workdir)]
        jobs += [_prepare(extra, tp, None, workdir) for extra in extra_adapters]
        for i, extra in enumerate(extra_bases):
            jobs.append(_prepare(None, tp, extra, os.path.join(workdir, f"extra{i}")))
        for job in jobs:
            job["tokens"] = tokens
        results = _merge_ranks(launch(_check_job, jobs, tp, device))
    for result in results:
        result["ok"] = (
            result["bdlora_collectives"] == result["base_collectives"]
            and result["slora_collectives"] > result["base_collectives"]
            and result["max_rel_err"] < TOLERANCE
            and result["slora_rel_err"] < TOLERANCE
            and result["base_rel_err"] < TOLERANCE
        )
    return results


def bench_tp(
    tp: int = 2, token_counts=(16, 256, 2048), base: str = "bench", r: int = 16, repeats: int = 5, device: str = "cpu"
) -> dict:
    """TP forward latency of base, BD-LoRA and S-LoRA sharding (same weights, same adapter values)."""
    check_tp_degree(tp)
    if repeats < 1 or any(t < 1 for t in token_counts):
        raise TPError(f"bench-tp: --repeats {repeats} and --tokens {list(token_counts)} must be positive")
    with tempfile.TemporaryDirectory(prefix="bdlora-bench-") as workdir:
        if base == "bench":
            job = dict(
                base="tiny:llama",
                overrides=dict(BENCH_DIMS),
                adapter=str(
                    random_adapter(Path(workdir, "adapter"), "tiny:llama", tp, r=r, overrides=dict(BENCH_DIMS))
                ),
            )
            from bdlora_train.models import meta_model, tiny_config

            tp_styles(meta_model(tiny_config("llama", **BENCH_DIMS)), tp)
        else:
            job = _prepare(None, tp, base, workdir, r=r)
        job.update(token_counts=list(token_counts), repeats=repeats)
        result = launch(_bench_job, [job], tp, device)[0][0]
    result.update(
        model=base,
        r=r,
        repeats=repeats,
        **machine_record(device, tp),
    )
    return result
