"""One training step on the ranks, in pieces the TP checks and benchmarks of train_check.py assemble: the base loaded
sharded or whole (`PRECISIONS`: its dtype, the adapter's and the step's autocast), a seeded adapter with a non-zero B
on it (rank-local under TP), forward + backward, the gradients gathered into PEFT's layout, the collectives a call
makes, the optimizer step as the run's Trainer takes it, and a step's peak memory."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bdlora_train.tp_diagnostics.ranks import comm_counter, step_peak_bytes

# --dtype of bench-tp --train: the base's dtype, the adapter's, and the step's autocast. bf16-autocast is how a recipe
# with a bf16 base and `bf16: true` trains: PEFT keeps the adapter's weights in fp32 (`autocast_adapter_dtype`) and
# the Trainer runs the forward under bf16 autocast.
PRECISIONS = {
    "fp32": (torch.float32, torch.float32, None),
    "bf16": (torch.bfloat16, torch.bfloat16, None),
    "bf16-autocast": (torch.bfloat16, torch.float32, torch.bfloat16),
}


def load_base(path: str, tp: int | None, ep: bool = False, dtype: str = "fp32"):
    """The base, unsharded (`tp` None), at TP `tp`, or with `ep` its experts split over the same ranks by whole
    experts (ep_size = tp_size: the TP group's batch is shared, as `bdlora train` with tp_size = ep_size runs).
    Under TP transformers places each rank's shard on the rank's own device (a GPU each under NCCL)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from bdlora_train.tp_runtime.dispatch import copy_outputs_modified_in_place

    config = None
    if tp:
        from bdlora_train.arch.scope import split_experts
        from bdlora_train.models import meta_model

        # the experts split as `bdlora train` splits them under TP alone (launch/checks.py model_parallel_config)
        experts = {} if ep else split_experts(meta_model(AutoConfig.from_pretrained(path)))
        config = DistributedConfig(tp_size=tp, ep_size=tp if ep else None, **({"tp_plan": experts} if experts else {}))
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=PRECISIONS[dtype][0], distributed_config=config, use_kernels=False
    )
    model.train()
    if tp:  # the frozen base is differentiated too (Llama-4's in-place add into a TP output)
        copy_outputs_modified_in_place(model)
    return model


def peft_config(model, method: str, r: int, nblocks: int, dropout: float = 0.0):
    """BD-LoRA's default targets, or plain LoRA on exactly the modules and expert parameters BD-LoRA adapts."""
    from bdlora_train.budget import lora_baseline
    from bdlora_train.peft_integration.config import BlockDiagLoraConfig

    if method == "bdlora":
        return BlockDiagLoraConfig(r=r, nblocks=nblocks, lora_alpha=2 * r, lora_dropout=dropout)
    config = lora_baseline(model, r, nblocks)
    config.lora_alpha, config.lora_dropout = 2 * r, dropout
    return config


def adapted(model, method: str, r: int, nblocks: int, plan=None, dtype: str = "fp32", dropout: float = 0.0):
    """`model` with a seeded adapter whose B is random and non-zero (PEFT starts B at zero: a zero adapter proves
    nothing); rank-local when `plan` ((styles, targets) from `plan_styles`) is given. The adapter is in the adapter
    dtype of `PRECISIONS[dtype]`."""
    from transformers import set_seed

    from bdlora_train.peft_integration.config import get_peft_model
    from bdlora_train.tp_runtime.dispatch import global_adapter_shapes, shard_adapters

    set_seed(0)
    config = peft_config(model, method, r, nblocks, dropout)
    if plan is None:
        peft_model = get_peft_model(model, config)
    else:
        with global_adapter_shapes(model):
            peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    base_dtype, adapter_dtype, _ = PRECISIONS[dtype]
    if adapter_dtype == base_dtype:  # before sharding; on a bf16 base PEFT keeps the adapter fp32 by itself
        peft_model.to(adapter_dtype)
    pieces = shard_adapters(peft_model, *plan).pieces if plan is not None else {}
    return peft_model, pieces


def plan_styles(path: str, method: str, r: int, nblocks: int, tp: int, ep: bool = False) -> tuple[dict, dict]:
    """({module: plan style}, {name: resolved target}) of a method's adapter at TP `tp` (with `ep`, its experts by
    expert parallelism over the same ranks), after every TP / EP check."""
    from transformers import AutoConfig

    from bdlora_train.arch.scope import split_experts
    from bdlora_train.models import meta_model
    from bdlora_train.peft_integration.resolve import resolve
    from bdlora_train.tp_runtime.preflight import check_ep_model, check_tp_model, check_tp_training

    meta = meta_model(AutoConfig.from_pretrained(path))
    check_tp_model(meta, tp)
    if ep:
        check_ep_model(meta, tp)
    else:
        split_experts(meta)  # as the base loads (`load_base`)
    targets = resolve(meta, peft_config(meta, method, r, nblocks), nblocks if method == "bdlora" else 1)
    styles = check_tp_training(meta, targets, tp, block_diagonal=method == "bdlora", ep_size=tp if ep else 1)
    return styles, targets


def step(model, ids, autocast=None):
    """Forward + backward, with the gradient asked for at the embedding output in every mode: the backward then runs
    through every layer whether or not anything below the first adapter trains, so the modes differ by the adapter
    alone (the frozen base: its activation gradients only). `autocast`: the forward under autocast to that dtype,
    the backward outside it (as the Trainer steps)."""
    handle = model.get_input_embeddings().register_forward_hook(lambda _m, _a, out: out.requires_grad_(True))
    try:
        with torch.autocast(ids.device.type, dtype=autocast, enabled=autocast is not None):
            out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
    finally:
        handle.remove()
    return out.loss.detach()


def gathered_grads(model, pieces: dict) -> dict[str, torch.Tensor]:
    """{parameter: full gradient, in PEFT's layout} (`pieces`: {parameter: rank-local Piece}, unpacked:
    tp_runtime/pieces.py)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        if param.requires_grad and param.grad is not None:
            grad = param.grad
            grad = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
            out[name] = pieces[name].unpack(grad) if name in pieces else grad
    return out


def counted(fn):
    with comm_counter() as comm:
        fn()
    return (
        comm.get_total_counts(),
        comm.comm_bytes,
        {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items()},
    )


def trainable_params(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def optimizer_step(model) -> None:
    """Clip to norm 1, then one AdamW step, as the run's Trainer does."""
    params = trainable_params(model)
    clip(params)
    torch.optim.AdamW(params, lr=1e-3).step()


def clip(params: list) -> None:
    """Clip the gradients to total norm 1. Under EP the experts' factors live on the EP mesh and the others on the TP
    mesh, which one `clip_grad_norm_` cannot span: one norm per mesh, each reduced over its own mesh (what
    transformers' Trainer does in training, `_mixed_mesh_grad_norm`)."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    by_mesh = {}
    for p in params:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = [get_total_norm([p.grad for p in group]) for group in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    for group in by_mesh.values():
        clip_grads_with_norm_(group, 1.0, total)


def updater(params: list, optimizer):
    """One optimizer step as the run's Trainer takes it: clip the gradients to norm 1, then step."""

    def update() -> None:
        clip(params)
        optimizer.step()

    return update


def peak_memory(models: dict, ids, device, autocast=None) -> dict:
    """{mode_peak_mib: the most one step allocates on any rank, above what was live before it} (collective)."""
    peaks = {}
    for mode, model in models.items():
        model.zero_grad(set_to_none=True)
        peaks[mode] = step_peak_bytes(lambda m=model: step(m, ids, autocast), device)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, peaks)
    return {f"{mode}_peak_mib": max(rank[mode] for rank in everyone) / 2**20 for mode in peaks}
