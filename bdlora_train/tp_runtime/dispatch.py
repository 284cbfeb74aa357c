"""`shard_adapters`: make every adapted layer of a TP-loaded model rank-local, one dispatch per kind of layer
(PEFT-native Linear, dense-stored pieces, replicated, expert, expert-parallel), each returning its `AdapterShard`
and giving the layer its TP class."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from bdlora_train.arch.plans import parallel_of
from bdlora_train.core.degrees import check_divides
from bdlora_train.core.errors import TPError
from bdlora_train.core.layout import COLUMN, Side, factor_of, side_of_role
from bdlora_train.core.roles import PLAIN, is_block_diagonal
from bdlora_train.peft_integration.layers import adapter_role
from bdlora_train.tp_runtime.adapter import ShardedAdapter
from bdlora_train.tp_runtime.experts import expert_shard
from bdlora_train.tp_runtime.layers import ReplicatedLora, ShardedLora, become, is_dense
from bdlora_train.tp_runtime.mesh import local_part, tp_placement, tp_side
from bdlora_train.tp_runtime.styles import (
    EXPERT_PARALLEL,
    REPLICATED,
    TRAINED_STYLES,
    WHOLE_BLOCKS,
    AdapterShard,
    TrainedStyle,
    factor_placements,
)

# Modules whose output a transformers forward then modifies in place, which autograd refuses on the output of a TP
# layer (a view of its DTensor's local tensor): Llama-4's MoE adds the routed experts into the shared expert's output
# (modeling_llama4.py, Llama4TextMoe.forward: `out.add_(...)`; transformers 5.24). `copy_outputs_modified_in_place`
# gives these a forward hook that returns a copy (one hidden-sized tensor per layer), so the in-place add lands on it.
MODIFIED_IN_PLACE = {"Llama4TextMoe": "shared_expert"}


@contextlib.contextmanager
def global_adapter_shapes(model: nn.Module):
    """Build a PEFT adapter on a TP-loaded model exactly as on the unsharded model: the full shapes, PEFT's own init,
    the same random draws (so a TP run starts from the adapter a single-process run starts from), no TP hooks.

    PEFT reads a TP-sharded Linear as its local shard (`peft/tuners/tuners_utils.py`, `_get_in_out_features`: a
    DTensor weight on a mesh with a "tp" dimension gives the local shape) and adds its own TP hooks when the model has
    a TP plan (`peft/tuners/lora/model.py`, `get_tp_plan_and_mesh`), both for its plain-LoRA layout. For the duration,
    every sharded Linear shows PEFT a full-shape placeholder weight (an expanded scalar: no memory) and the model an
    empty TP plan; `shard_adapters` then places every factor itself.
    """
    from torch.distributed.tensor import DTensor

    swapped = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and isinstance(weight, DTensor):
            placeholder = torch.empty((), dtype=weight.dtype, device=weight.to_local().device).expand(weight.shape)
            swapped[module] = weight
            module._parameters["weight"] = nn.Parameter(placeholder, requires_grad=False)
    plan, model._tp_plan = model._tp_plan, {}
    try:
        yield
    finally:
        model._tp_plan = plan
        for module, weight in swapped.items():
            frozen = not module._parameters["weight"].requires_grad  # PEFT froze the placeholder: freeze the weight
            module._parameters["weight"] = weight
            weight.requires_grad_(not frozen)


def adapted_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{name: PEFT LoRA layer} of every adapted Linear and expert parameter (ParamWrapper) in `model`."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "get_base_layer")}


def _target_name(name: str, layer: nn.Module) -> str:
    """A PEFT layer's name -> the base-model name its target and plan style are keyed by (an expert parameter:
    `experts.gate_up_proj`, whichever wrapper level holds it)."""
    from bdlora_train.core.naming import canonical

    base = canonical(name).removeprefix("base_model.model.")
    parameter = getattr(layer, "parameter_name", None)
    return f"{base}.{parameter}" if parameter else base


def shard_adapters(model: nn.Module, styles: dict[str, str], targets=None) -> ShardedAdapter:
    """Make the adapter of every adapted layer of a TP-loaded model rank-local (see the module docstring), in place.

    `styles`: {base-model name: plan style}, from `check_tp_training`; `targets`: the resolved targets it checked
    (arch/targets.py `Target`s: the layouts of the factors PEFT stores densely, tp_runtime/pieces.py). Every rank must
    hold the same full adapter before (same seed: the factors are sliced locally, never sent). Returns the run's
    `ShardedAdapter` (adapter.py); refuses, in one line, a layer it cannot shard exactly.
    """
    targets = targets or {}
    shards = {}
    copy_outputs_modified_in_place(model)
    for name, layer in adapted_layers(model).items():
        adapters = list(layer.lora_A)
        if len(adapters) != 1:
            raise TPError(f"tp: {name} holds {len(adapters)} adapters; TP training trains one adapter")
        key = _target_name(name, layer)
        target = targets.get(key)
        if key not in styles:
            continue  # expert parallelism without TP: a dense layer trains data-parallel, as PEFT built it
        if styles[key] == EXPERT_PARALLEL:
            shards[name] = _shard_ep_expert_layer(name, layer, adapters[0], target)
        elif styles[key] == REPLICATED:
            shards[name] = _replicate_layer(name, layer, adapters[0], model)
        elif hasattr(layer, "parameter_name"):
            shards[name] = _shard_expert_layer(name, layer, adapters[0], target)
        elif is_dense(layer):
            shards[name] = _shard_dense_linear(name, layer, adapters[0], target, styles.get(key))
        else:
            shards[name] = _shard_linear_layer(name, layer, adapters[0], styles.get(key))
    if not shards:
        raise TPError("tp: the model has no adapted Linear to shard")
    return ShardedAdapter.of(model, shards)


def copy_outputs_modified_in_place(model: nn.Module) -> None:
    """Make a TP-loaded model's forward differentiable where transformers modifies a TP layer's output in place
    (MODIFIED_IN_PLACE), adapted or not (idempotent)."""
    for module in model.modules():
        child = MODIFIED_IN_PLACE.get(type(module).__name__)
        if child is not None and not hasattr(module, "_bdlora_copied_output"):
            getattr(module, child).register_forward_hook(lambda _m, _args, out: out.clone())
            module._bdlora_copied_output = True


def _replicate_layer(name: str, layer: nn.Module, adapter: str, model: nn.Module) -> AdapterShard:
    """A Linear or expert parameter the model's plan leaves replicated: every rank computes all of it on the same
    input, so its factors are replicated DTensors (their gradients are whole and equal on every rank: no collective)
    and the layer runs on their local tensors (an expert parameter adds its whole delta, `ExpertLora`)."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = next(
        (tp_placement(p)[0] for p in model.parameters() if isinstance(p, DTensor) and tp_placement(p)[0] is not None),
        None,
    )
    if mesh is None or mesh.ndim != 1:
        raise TPError(f"tp: {name}: no 1-D TP mesh to replicate its adapter on; leave it out of target_modules")
    role, nblocks = adapter_role(layer, adapter) if not is_dense(layer) else (PLAIN, 1)
    for factors in (layer.lora_A, layer.lora_B):
        _distribute_factor(name, factors[adapter], mesh, Replicate())
    shard = AdapterShard(REPLICATED, role, nblocks, mesh, dense=is_dense(layer))
    if hasattr(layer, "parameter_name"):
        return expert_shard(layer, shard)
    return become(layer, ReplicatedLora, shard)


def _linear_style(name: str, base: nn.Module, plan: str | None) -> tuple[Side, TrainedStyle]:
    """(COLUMN | ROW, what `ShardedLora` does beside the split) of a Linear sharded by the model's TP plan in a
    style `ShardedLora` computes; one line otherwise."""
    side = tp_side(base)
    if side is None or plan not in TRAINED_STYLES or parallel_of(plan) != side:
        raise TPError(
            f"tp: {name} is adapted but its base layer is not sharded column- or row-wise by the model's TP plan; "
            "adapt only the TP-sharded projections (the default targets)"
        )
    return side, TRAINED_STYLES[plan]


def _shard_linear_layer(name: str, layer: nn.Module, adapter: str, plan: str | None) -> AdapterShard:
    """A Linear whose factors PEFT stores natively: DTensor placements (the table in the module docstring)."""
    base = layer.get_base_layer()
    side, trained = _linear_style(name, base, plan)
    role, nblocks = adapter_role(layer, adapter)
    mesh, _ = tp_placement(base.weight)
    shard = AdapterShard(side, role, nblocks, mesh, trained.gathers_output, trained.splits_input)
    if is_block_diagonal(role):
        check_divides(
            shard.world, nblocks, f"tp: {name}", key="tp_size", fix=WHOLE_BLOCKS.format(shard.world), error=TPError
        )
    if is_block_diagonal(role) and side_of_role(role) != side:
        raise TPError(
            f"tp: {name} is {side}-parallel but its block-diagonal factor is {factor_of(role)}: the "
            "blocks do not follow the TP shards"
        )
    for factors, placement in zip((layer.lora_A, layer.lora_B), factor_placements(shard)):
        _distribute_factor(name, factors[adapter], mesh, placement)
    if not is_block_diagonal(role) and side == COLUMN:
        _reduce_grad_after_backward(layer.lora_A[adapter].weight)  # plain LoRA: each rank has a partial grad of A
    return become(layer, ShardedLora, shard)


def _distribute_factor(name: str, module: nn.Module, mesh, placement) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = module.weight.detach()
    if isinstance(full, DTensor):
        raise TPError(f"tp: {name}: the adapter is already sharded; build it under `global_adapter_shapes`")
    module.weight = nn.Parameter(
        distribute_tensor(full, mesh, [placement], src_data_rank=None), requires_grad=module.weight.requires_grad
    )


def _dense_target(name: str, target, mesh) -> None:
    """A dense-stored layer needs its resolved target (the layout of its blocks) and the 1-D mesh its weight is split
    over (under TP x FSDP, the weight's "tp" dimension)."""
    if target is None:
        raise TPError(f"tp: {name}: no resolved target describes its blocks; build it from the run's plan")
    if mesh is None or mesh.ndim != 1:
        raise TPError(
            f"tp: {name}: transformers did not split it over a tensor- or expert-parallel mesh; leave it out of "
            "target_modules or train with tp_size=1"
        )


def _shard_pieces(name: str, layer: nn.Module, adapter: str, target, mesh, block_diagonal: bool) -> tuple:
    """Hold each dense-stored factor as its rank-local piece (tp_runtime/pieces.py), its mask sliced alike; a replicated
    factor (plain LoRA) gets its gradient all-reduced. Returns the (A, B) pieces (None for a replicated factor)."""
    from torch.distributed.tensor import Replicate

    from bdlora_train.tp_runtime.pieces import factor_pieces

    lay = target.layout
    modules = {"A": layer.lora_A[adapter], "B": layer.lora_B[adapter]}
    pieces = factor_pieces(
        modules["A"].weight.shape,
        modules["B"].weight.shape,
        lay.segments,
        target.r,
        mesh.size(),
        lay.experts,
        lay.factor,
        block_diagonal,
    )
    for label, piece in zip("AB", pieces):
        if piece is None:
            _distribute_factor(name, modules[label], mesh, Replicate())
            _reduce_grad_after_backward(modules[label].weight)
    _hold_pieces(layer, adapter, modules, pieces, mesh)
    return tuple(pieces)


def _hold_pieces(layer: nn.Module, adapter: str, modules: dict, pieces, mesh) -> None:
    """Each factor with a piece becomes a (N, a, b) Shard(0) DTensor holding this rank's piece; its mask is sliced
    alike."""
    from torch.distributed.tensor import DTensor, Shard

    rank = mesh.get_local_rank()
    for label, piece in zip("AB", pieces):
        module = modules[label]
        if piece is None:
            continue
        full = module.weight.detach()
        local = piece.local(full, rank).unsqueeze(0).contiguous()
        module.weight = nn.Parameter(
            DTensor.from_local(local, mesh, [Shard(0)], run_check=False), requires_grad=module.weight.requires_grad
        )
        mask = getattr(layer, f"bdmask_{label}_{adapter}", None)
        if mask is not None:
            layer.register_buffer(f"bdmask_{label}_{adapter}", piece.local(mask, rank), persistent=False)


def _shard_dense_linear(name: str, layer: nn.Module, adapter: str, target, plan: str | None) -> AdapterShard:
    """A Linear whose block-diagonal factor PEFT stores densely (tp_runtime/pieces.py): a segment-aware fused projection
    (Phi-3 qkv_proj / gate_up_proj, GLM-4 gate_up_proj), or any Linear of an adapter that also holds expert factors.

    A fused projection is column-parallel with its output all-gathered, and transformers shards its weight
    contiguously; here rank i holds instead the i-th 1/N of every segment (the rows its blocks of B cover), computes
    those outputs, and after the base's own all-gather a local index puts the output back in order (no collective).
    Its base weight is regathered once, at setup, to take those rows."""
    from torch.distributed.tensor import DTensor, Shard

    from bdlora_train.core.blocks import rank_order, shard_rows

    base = layer.get_base_layer()
    mesh, _ = tp_placement(base.weight) if isinstance(base.weight, DTensor) else (None, None)
    _dense_target(name, target, mesh)
    side, trained = _linear_style(name, base, plan)
    order = None
    if target.layout.fused:
        if not trained.gathers_output:
            raise TPError(f"tp: {name}: a fused projection trains under TP only with its output gathered ({plan!r})")
        segments, world = tuple(target.layout.segments), mesh.size()
        rows = shard_rows(segments, world, mesh.get_local_rank())
        for pname in ("weight", "bias"):
            param = getattr(base, pname, None)
            if param is not None:
                mine = param.full_tensor().index_select(0, rows.to(param.device)).contiguous()  # once, at setup
                base._parameters[pname] = nn.Parameter(
                    DTensor.from_local(mine, mesh, [Shard(0)], run_check=False), requires_grad=False
                )
        order = torch.argsort(rank_order(segments, world))  # gathered rank-0 rows, rank-1 rows, ... -> fused order
    pieces = _shard_pieces(name, layer, adapter, target, mesh, block_diagonal=target.nblocks > 1)
    role = target.role if target.nblocks > 1 else PLAIN
    shard = AdapterShard(
        side, role, target.nblocks, mesh, trained.gathers_output, trained.splits_input, True, order, pieces
    )
    return become(layer, ShardedLora, shard)


def _shard_expert_layer(name: str, layer: nn.Module, adapter: str, target) -> AdapterShard:
    """An expert parameter (PEFT's ParamWrapper on transformers' experts module, `moe_tp_experts`): the parameter is
    split along one axis (gate_up: the i-th 1/N of gate and of up, `packed_colwise`; down: its input slice), and rank
    i adds its slice of every expert's delta, from its own pieces, to its own shard before the experts run. The
    experts' own all-reduce (forward) and input-gradient all-reduce (backward) are the only collectives."""
    from torch.distributed.tensor import DTensor

    from bdlora_train.core.layout import expert_axis, is_transposed

    experts = layer.get_base_layer()
    param = experts._parameters.get(layer.parameter_name)
    mesh, placement = tp_placement(param) if isinstance(param, DTensor) else (None, None)
    _dense_target(name, target, mesh)
    want = expert_axis(target.layout.factor, is_transposed(experts))
    dim = getattr(placement, "dim", None)
    strided = getattr(placement, "split_factor", 1) > 1
    if dim is None or dim % 3 != want or strided != target.layout.fused:
        raise TPError(
            f"tp: {name}: transformers sharded {layer.parameter_name} as {placement}, not along axis {want} as its "
            f"{target.layout.style!r} plan entry says; leave the experts out (experts=False) or train with tp_size=1"
        )
    block_diagonal = is_block_diagonal(target.role) and target.nblocks > 1
    pieces = _shard_pieces(name, layer, adapter, target, mesh, block_diagonal=block_diagonal)
    role = target.role if target.nblocks > 1 else PLAIN
    return expert_shard(layer, AdapterShard("expert", role, target.nblocks, mesh, pieces=pieces))


def _shard_ep_expert_layer(name: str, layer: nn.Module, adapter: str, target) -> AdapterShard:
    """An expert parameter under expert parallelism (transformers' `grouped_gemm` / `ep_dispatch_experts`): rank i
    holds whole experts, a contiguous 1/ep of them, so it holds their whole factors (tp_runtime/pieces.py
    `expert_pieces`:
    blocks, if any, included) and adds their deltas to its experts before they run. The base's token dispatch and
    combine are the only collectives; each factor's gradient sums the tokens every rank sent its experts
    (`average_over_data_parallel` divides it by the data-parallel degree)."""
    from torch.distributed.tensor import DTensor

    from bdlora_train.tp_runtime.pieces import expert_pieces

    experts = layer.get_base_layer()
    param = experts._parameters.get(layer.parameter_name)
    names = (param.device_mesh.mesh_dim_names or ()) if isinstance(param, DTensor) else ()
    if "ep" not in names:
        raise TPError(
            f"tp: {name}: transformers did not split {layer.parameter_name} over an expert-parallel mesh; load the "
            "base with the run's ep_size"
        )
    mesh = param.device_mesh if len(names) == 1 else param.device_mesh["ep"]
    _dense_target(name, target, mesh)
    modules = {"A": layer.lora_A[adapter], "B": layer.lora_B[adapter]}
    shape_a, count = modules["A"].weight.shape, target.layout.experts
    # the rank PEFT built (plain LoRA gives a packed gate|up parameter a rank per projection: not target.r)
    pieces = expert_pieces(shape_a, modules["B"].weight.shape, shape_a[0] // count, count, mesh.size())
    _hold_pieces(layer, adapter, modules, pieces, mesh)
    role = target.role if target.nblocks > 1 else PLAIN
    return expert_shard(layer, AdapterShard(EXPERT_PARALLEL, role, target.nblocks, mesh, pieces=tuple(pieces)))


def _reduce_grad_after_backward(param: nn.Parameter) -> None:
    """Plain LoRA on a column-parallel layer: every rank computes A's gradient from its own output shard only, so the
    gradients are partial sums; add them up after each backward (the collective BD-LoRA does not need)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    def all_reduce(p):
        grad = DTensor.from_local(local_part(p.grad), p.device_mesh, [Partial()], run_check=False)
        p.grad = grad.redistribute(placements=[Replicate()])

    param.register_post_accumulate_grad_hook(all_reduce)
