"""One training step under TP, checked and timed: `tp_check(train=True)` and `bench_tp(train=True)`.

Every rank loads the base with transformers' `DistributedConfig(tp_size=N)` (the same sharded load `bdlora train`
does), then runs forward + backward in three modes on the same batch:

  base     the frozen base model: activation gradients through every layer (what a LoRA step costs without adapter;
           every mode asks for the gradient at the embedding output, so the backward graphs differ by the adapter alone)
  bdlora   BD-LoRA, each rank holding only its blocks (tp/)
  lora     plain LoRA at about the same number of parameters, in PEFT's TP layout (lora_A or lora_B replicated)

Collectives are counted per mode (`ranks.comm_counter`), forward + backward, and separately for the optimizer step
(AdamW with gradient clipping). The adapters' gradients are gathered and compared with an unsharded model that holds
the same adapter (same init, same random B), on the same batch. The benchmark also times each adapter's optimizer
step after its backward, in two AdamW implementations (OPTIMIZERS).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bdlora_train.core.errors import TPError
from bdlora_train.core.flops import projection_flops
from bdlora_train.core.layout import COLUMN
from bdlora_train.tp_diagnostics.ranks import (
    check_device,
    check_tp_degree,
    launch,
    machine_record,
    quiet_warnings,
    rel_err,
    timing_row,
    token_ids,
)
from bdlora_train.tp_diagnostics.train_step import (
    PRECISIONS,
    adapted,
    counted,
    gathered_grads,
    load_base,
    optimizer_step,
    peak_memory,
    peft_config,
    plan_styles,
    step,
    trainable_params,
    updater,
)

STEP_METHODS = ("base", "bdlora", "lora")
ADAPTER_METHODS = ("bdlora", "lora")
# The optimizer steps bench-tp --train times after each adapter's backward (gradient clipping to norm 1 included):
# fused AdamW (`optim: adamw_torch_fused`, transformers' default on torch >= 2.8), and torch's own pick for AdamW with
# neither flag set (`optim: adamw_torch`, the recipe default): one foreach kernel per op over the DTensor parameters
# on CUDA, a Python loop over them on CPU.
OPTIMIZERS = {"fused": dict(fused=True), "adamw": {}}
TOLERANCE = 1e-4  # max relative error (fp32) of a gathered gradient against the unsharded model's


def _check_job(job: dict, mesh) -> dict:
    tp, ep = mesh.size(), job["ep"]
    path, r_bd, r_lora, nblocks = job["base"], job["r_bd"], job["r_lora"], job["nblocks"]
    ids = token_ids(load_base(path, None).config, job["batch"], job["tokens"], seed=1234)
    result = dict(
        world_size=dist.get_world_size(),
        tokens=job["tokens"],
        batch=job["batch"],
        r_bd=r_bd,
        r_lora=r_lora,
        nblocks=nblocks,
    )
    base = load_base(path, tp, ep)
    base.requires_grad_(False)
    result["base"] = dict(zip(("collectives", "bytes", "ops"), counted(lambda: step(base, ids))))
    for method, r in (("bdlora", r_bd), ("lora", r_lora)):
        styles = plan_styles(path, method, r, nblocks, tp, ep)
        sharded, pieces = adapted(load_base(path, tp, ep), method, r, nblocks, styles)
        reference, _ = adapted(load_base(path, None), method, r, nblocks)
        loss = {}
        counts = counted(lambda: loss.setdefault("tp", step(sharded, ids)))
        loss["ref"] = step(reference, ids)
        got, want = gathered_grads(sharded, pieces), gathered_grads(reference, {})
        if got.keys() != want.keys():
            raise TPError(f"tp: {method}: the sharded and the unsharded adapter have different parameters")
        params = sum(p.numel() for p in sharded.parameters() if p.requires_grad)
        result[method] = dict(
            zip(("collectives", "bytes", "ops"), counts),
            params=params,
            grad_rel_err=max(rel_err(got[k], want[k]) for k in got),
            loss_rel_err=rel_err(loss["tp"], loss["ref"]),
            optimizer=dict(zip(("collectives", "bytes", "ops"), counted(lambda: optimizer_step(sharded)))),
        )
    return result


def _bench_job(job: dict, mesh) -> dict:
    """Median step time per mode, modes interleaved so drift hits all alike; a step's time is its slowest rank's.
    Each adapter's optimizer steps (OPTIMIZERS) are timed right after its backward, as modes of their own."""
    tp = mesh.size()
    path, r_bd, r_lora, nblocks = job["base"], job["r_bd"], job["r_lora"], job["nblocks"]
    dtype, dropout = job["dtype"], job["lora_dropout"]
    autocast = PRECISIONS[dtype][2]
    base = load_base(path, tp, dtype=dtype)
    base.requires_grad_(False)
    models = {"base": base}
    for method, r in (("bdlora", r_bd), ("lora", r_lora)):
        plan = plan_styles(path, method, r, nblocks, tp)
        models[method], _ = adapted(load_base(path, tp, dtype=dtype), method, r, nblocks, plan, dtype, dropout)
    sync = torch.cuda.synchronize if base.device.type == "cuda" else (lambda: None)  # GPU kernels are asynchronous
    trainable = {method: trainable_params(models[method]) for method in ADAPTER_METHODS}
    updates = {
        f"{method}_{name}": updater(trainable[method], torch.optim.AdamW(trainable[method], lr=1e-6, **flags))
        for method in ADAPTER_METHODS
        for name, flags in OPTIMIZERS.items()
    }
    modes = (*STEP_METHODS, *updates)
    rows = []
    for tokens in job["token_counts"]:
        ids = token_ids(base.config, job["batch"], tokens, seed=tokens).to(base.device)
        wall = {mode: [] for mode in modes}
        cpu = {mode: [] for mode in modes}
        counts = {mode: counted(lambda m=mode: step(models[m], ids, autocast))[:2] for mode in STEP_METHODS}
        counts.update({mode: counted(update)[:2] for mode, update in updates.items()})

        def timed(mode: str, fn) -> None:
            sync()
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            sync()
            wall[mode].append(time.perf_counter() - start)
            cpu[mode].append(time.process_time() - start_cpu)

        for _ in range(job["repeats"]):
            for mode in STEP_METHODS:
                model = models[mode]
                model.zero_grad(set_to_none=True)
                timed(mode, lambda m=model: step(m, ids, autocast))
                for name in OPTIMIZERS if mode in ADAPTER_METHODS else ():
                    timed(f"{mode}_{name}", updates[f"{mode}_{name}"])
        row = timing_row(tokens, modes, wall, cpu, counts, ADAPTER_METHODS)
        row["bdlora_vs_lora"] = row["bdlora_ms"] / row["lora_ms"]
        for method in ADAPTER_METHODS:  # the whole training step with the fused optimizer, over the frozen base's
            row[f"{method}_fused_step_ratio"] = (row[f"{method}_ms"] + row[f"{method}_fused_ms"]) / row["base_ms"]
        row.update(peak_memory(models, ids, base.device, autocast))
        rows.append(row)
    params = {method: sum(p.numel() for p in trainable[method]) for method in ADAPTER_METHODS}
    return dict(world_size=dist.get_world_size(), rows=rows, params=params)


def flop_floor(path: str, method: str, r: int, nblocks: int, tp: int) -> float:
    """The step time an adapter could cost at best, as a multiple of the frozen base's: 1 + (the adapter's FLOPs) /
    (the base's), per rank, over the adapted projections alone (the base's attention, norms and head are left out, so
    the true floor is lower still); `core/flops.py projection_flops` counts each projection."""
    from bdlora_train.tp_runtime.styles import TRAINED_STYLES

    styles, targets = plan_styles(path, method, r, nblocks, tp)
    base = adapter = 0
    for name, style in styles.items():
        if style not in TRAINED_STYLES:
            raise TPError(
                f"bench-tp: {name} is sharded {style!r}; the FLOP floor counts column- and row-parallel Linears only: "
                "time a dense model (--model bench, or a dense model spec)"
            )
        layout = targets[name].layout
        column = layout.parallel == COLUMN
        b, a = projection_flops(
            layout.d_in, layout.d_out, r, column=column, block_diagonal=method == "bdlora", nblocks=nblocks, tp=tp
        )
        base, adapter = base + b, adapter + a
    return 1 + adapter / base


def _base_checkpoint(spec: str, tp: int, workdir: str) -> str:
    """A checkpoint directory every rank loads sharded: a local model directory as is, or `spec` ("bench",
    "bench-8b", "tiny:<type>", "embedded") written once by this process (a tiny model gets enough heads for `tp`)."""
    from bdlora_train.models import build_tiny_model, load_model
    from bdlora_train.tp_diagnostics.harness import BENCH_8B_DIMS, BENCH_DIMS, _tiny_overrides

    if Path(spec).is_dir():
        return spec
    if spec in ("bench", "bench-8b"):
        model = build_tiny_model("llama", seed=0, **(BENCH_DIMS if spec == "bench" else BENCH_8B_DIMS))
    elif spec.startswith("tiny:"):
        model = build_tiny_model(spec.split(":", 1)[1], seed=0, **_tiny_overrides(spec, tp))
    else:
        model = load_model(spec, with_tokenizer=False)[0]
    path = Path(workdir, "base")
    model.save_pretrained(path)
    return str(path)


def _plan(path: str, tp: int, lora_r: int, ep: bool = False) -> dict:
    """nblocks = tp and the BD-LoRA rank with about LoRA r's parameters on the same modules, checked before spawning."""
    from transformers import AutoConfig

    from bdlora_train.budget import match_budget
    from bdlora_train.models import meta_model

    meta = meta_model(AutoConfig.from_pretrained(path))
    r_bd = match_budget(meta, lora_r, tp, mode="below")
    for method, r in (("bdlora", r_bd), ("lora", lora_r)):
        plan_styles(path, method, r, tp, tp, ep)  # every refusal here, not in every rank
    return dict(base=path, r_bd=r_bd, r_lora=lora_r, nblocks=tp, ep=ep)


def train_check(
    tp: int = 2, base: str = "tiny:llama", lora_r: int = 8, tokens: int = 16, device: str = "cpu", ep: bool = False
) -> dict:
    """One training step at TP `tp` in each mode: collectives (forward + backward, and the optimizer step) and the
    gathered gradients against the unsharded model. `ok`: BD-LoRA adds no collective over the frozen base, plain LoRA
    adds some, and both sharded adapters' gradients equal the unsharded ones. `ep`: a MoE's experts split by whole
    experts over the same ranks (ep_size = tp; the frozen base's count then includes its token dispatch and
    combine)."""
    check_tp_degree(tp)
    check_device(device, tp)
    quiet_warnings()
    with tempfile.TemporaryDirectory(prefix="bdlora-tptrain-") as workdir:
        job = dict(_plan(_base_checkpoint(base, tp, workdir), tp, lora_r, ep), tokens=tokens, batch=2)
        per_rank = launch(_check_job, [job], tp, device)
    result = per_rank[0][0]
    for method in ("bdlora", "lora"):
        counts = {rank[0][method]["collectives"] for rank in per_rank}
        if len(counts) > 1:
            raise RuntimeError(f"tp: ranks disagree on {method}'s collectives: {sorted(counts)}")
        result[method]["grad_rel_err"] = max(rank[0][method]["grad_rel_err"] for rank in per_rank)
        result[method]["extra_collectives"] = result[method]["collectives"] - result["base"]["collectives"]
        result[method]["extra_bytes"] = result[method]["bytes"] - result["base"]["bytes"]
    result.update(model=base, tolerance=TOLERANCE, ep_size=tp if ep else 1)
    result["ok"] = (
        result["bdlora"]["extra_collectives"] == 0
        and result["lora"]["extra_collectives"] > 0
        and all(
            result[m]["grad_rel_err"] < TOLERANCE and result[m]["loss_rel_err"] < TOLERANCE for m in ("bdlora", "lora")
        )
    )
    return result


def bench_train(
    tp: int = 2,
    token_counts=(128, 512),
    base: str = "bench",
    lora_r: int = 16,
    repeats: int = 5,
    device: str = "cpu",
    dtype: str = "fp32",
    lora_dropout: float = 0.0,
) -> dict:
    """TP training-step time (forward + backward; median, min and CPU time over interleaved repeats) of the frozen
    base, BD-LoRA and plain LoRA at about the same parameters; ratios to the base and BD-LoRA / LoRA, each mode's
    peak memory per rank, and the FLOP floor each ratio is bounded by (`flop_floor`)."""
    check_tp_degree(tp)
    if repeats < 1 or any(t < 1 for t in token_counts):
        raise TPError(f"bench-tp: --repeats {repeats} and --tokens {list(token_counts)} must be positive")
    if dtype not in PRECISIONS:
        raise TPError(f"bench-tp: --dtype {dtype!r}; use one of {', '.join(PRECISIONS)}")
    if not 0 <= lora_dropout < 1:
        raise TPError(f"bench-tp: --lora-dropout {lora_dropout}; use a probability in [0, 1)")
    check_device(device, tp)
    quiet_warnings()
    with tempfile.TemporaryDirectory(prefix="bdlora-tpbench-") as workdir:
        job = dict(
            _plan(_base_checkpoint(base, tp, workdir), tp, lora_r),
            token_counts=list(token_counts),
            repeats=repeats,
            batch=1,
            dtype=dtype,
            lora_dropout=lora_dropout,
        )
        result = launch(_bench_job, [job], tp, device)[0][0]
        result["flop_floor"] = {
            "bdlora": flop_floor(job["base"], "bdlora", job["r_bd"], tp, tp),
            "lora": flop_floor(job["base"], "lora", lora_r, tp, tp),
        }
    result.update(
        model=base,
        r_bd=job["r_bd"],
        r_lora=lora_r,
        nblocks=tp,
        repeats=repeats,
        dtype=dtype,
        lora_dropout=lora_dropout,
        **machine_record(device, tp),
    )
    return result


def training_traffic(model_spec: str, tp: int, lora_r: int, tokens: int) -> dict:
    """`traffic.training_step_traffic` for a --model spec's config at TP `tp` (meta device, offline for the bundled
    configs): LoRA at `lora_r` and BD-LoRA (nblocks = tp) at the rank of about the same parameters. A TP degree the
    training run would refuse (KV heads not divisible, a family without a TP plan) is refused here the same way.
    `experts`: E of the adapted expert parameters (0 on a dense model), `expert_params`: how many of `layers` are,
    `replicated`: how many of `layers` transformers' plan leaves whole on every rank (no traffic)."""
    from bdlora_train.arch.scope import split_experts
    from bdlora_train.budget import match_budget
    from bdlora_train.models import load_config, meta_model
    from bdlora_train.peft_integration.resolve import resolve
    from bdlora_train.tp_diagnostics.traffic import training_step_traffic
    from bdlora_train.tp_runtime.preflight import check_tp_model, check_tp_training
    from bdlora_train.tp_runtime.styles import REPLICATED

    check_tp_degree(tp)
    meta = meta_model(load_config(model_spec))
    check_tp_model(meta, tp)
    split_experts(meta)  # the experts split under TP alone, as `bdlora train` loads them
    targets = resolve(meta, peft_config(meta, "lora", lora_r, 1), 1)
    styles = check_tp_training(meta, targets, tp, block_diagonal=False)
    result = training_step_traffic(targets, styles, tokens)
    experts = {t.layout.experts for t in targets.values() if t.layout.experts}
    result.update(
        model=model_spec,
        tp=tp,
        tokens=tokens,
        r_lora=lora_r,
        r_bd=match_budget(meta, lora_r, tp, "below"),
        layers=len(targets),
        expert_params=sum(1 for t in targets.values() if t.layout.experts),
        experts=max(experts, default=0),
        replicated=sum(1 for style in styles.values() if style == REPLICATED),
    )
    return result
