"""Training under tensor parallelism: every rank holds and trains only its own adapter blocks.

The base model comes from transformers, loaded with `DistributedConfig(tp_size=N)`: its Linear weights are DTensors
sharded along the model's TP plan, and transformers' forward hooks move activations between ranks. `shard_adapters`
makes every adapted Linear's LoRA factors DTensors on the same TP mesh and gives the layer a forward that computes the
base *and* the adapter from local shards, inside the base layer's own communication:

  column-parallel (colwise)   y_i = x W_i^T + b_i + s (x A_i^T) B_ii^T    x replicated, y_i this rank's output shard
  row-parallel (rowwise)      y   = all_reduce(x_i W_i^T + s (x_i A_ii^T) B_i^T) + b

so BD-LoRA adds no collective: forward, the row-parallel partial sums ride on the base all-reduce; backward, every
factor's gradient is local, and the adapter's input gradient on a column-parallel layer joins the base layer's own
input-gradient all-reduce (one reduction, not two: `to_local(grad_placements=[Partial()])`).

Placements of PEFT's saved tensors (the block-diagonal factor packed along dim 0, so its blocks are rows):

  method   layer    lora_A                     lora_B                     extra collectives per layer
  bdlora   column   (r, d_in) Shard(0): A_i    (d_out, r/N) Shard(0): B_ii  none
  bdlora   row      (r, d_in/N) Shard(0): A_ii (d_out, r) Shard(1): B_i     none
  lora     column   (r, d_in) Replicate        (d_out, r) Shard(0)          backward: all-reduce of A's gradient
  lora     row      (r, d_in) Shard(1)         (d_out, r) Replicate         forward: all-reduce of x A^T before B

Plain LoRA uses the layout PEFT's own TP hooks choose (`add_lora_tp_hooks_dtensor`: colwise base -> lora_B sharded,
lora_A replicated; rowwise base -> lora_A sharded, lora_B replicated), whose two reductions are what BD-LoRA avoids.
The adapter is built at its full shapes without PEFT's own TP hooks (`global_adapter_shapes`): PEFT builds LoRA
layers of the local shard's shape on a TP-loaded model (block-diagonal blocks would then not be the served ones), its
hooks shard plain LoRA only, and PEFT 0.21's TP forward fails on the first step (the adapter's full-width output meets
the base layer's local shard).
The adapter is saved gathered (`gather_adapter_state`: one all-gather per factor, at save time only) in PEFT's native
format, and loaded back by slicing locally (`load_adapter_state`).

Factors PEFT stores densely (a segment-aware fused projection's B; every factor of an adapter that adapts MoE expert
parameters) are held as rank-local pieces instead (tp/pieces.py: no DTensor placement describes a block diagonal):
a fused projection's rank computes the i-th 1/N of every segment and its output is put back in order after the
base's own all-gather (`_shard_dense_linear`); an expert parameter's rank adds its slice of every expert's delta to
its own shard before transformers' `moe_tp_experts` runs the experts (`_shard_expert_layer`). A Linear the model's
plan leaves whole trains replicated (`_replicate_layer`). None adds a collective for BD-LoRA.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bdlora_train.core.degrees import check_divides, check_rank, check_segments, divides
from bdlora_train.core.errors import TPError
from bdlora_train.core.roles import BD_A, BD_B
from bdlora_train.peft_seam.layers import (
    OneNode,
    adapter_role,
    bdlora_add_,
    drops,
    linear_with_adapter,
    node_dropout,
    one_node_dtypes,
)

COLWISE, ROWWISE = "colwise", "rowwise"
REPLICATED = "replicated"  # a targeted Linear transformers' plan leaves whole on every rank (Qwen2-MoE's shared expert)
EXPERT_PARALLEL = "expert_parallel"  # an expert parameter transformers' EP plan splits by whole experts (ep_size)


@dataclass(frozen=True)
class AdapterShard:
    """How one adapted Linear is sharded: its TP style, the adapter's role, and the mesh its weights live on."""

    style: str
    role: str  # bd_a | bd_b | plain (plain LoRA)
    nblocks: int  # blocks of the block-diagonal factor (1 for plain LoRA)
    mesh: object
    gather_output: bool = False  # colwise_gather_output: the output shards are all-gathered (the base's own)
    split_input: bool = False  # rowwise_split_input: the input arrives replicated and is split locally
    dense: bool = False  # the factors are dense-stored pieces (tp/pieces.py), not PEFT-native blocks
    order: torch.Tensor | None = None  # a fused projection: gathered output columns -> the fused layout

    @property
    def world(self) -> int:
        return self.mesh.size()


def _placements(shard: AdapterShard):
    """(lora_A placement, lora_B placement) of one layer (the table in the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard

    if shard.role in (BD_A, BD_B):
        return (Shard(0), Shard(0)) if shard.style == COLWISE else (Shard(0), Shard(1))
    return (Replicate(), Shard(0)) if shard.style == COLWISE else (Shard(1), Replicate())


# The fix when a BD adapter's blocks do not split over the TP ranks (every rank must hold whole blocks).
_WHOLE_BLOCKS = "use nblocks={0} (the default under TP) or a multiple of it"

# transformers' plan styles of a Linear that `_tp_forward` computes, and how: (side, gathers its output, splits its
# replicated input). Other styles (packed / expert / MLA styles) are refused before the model loads.
TRAINED_STYLES = {
    "colwise": (COLWISE, False, False),
    "colwise_gather_output": (COLWISE, True, False),
    "rowwise": (ROWWISE, False, False),
    "rowwise_split_input": (ROWWISE, False, True),
}


def _family_plan(model: nn.Module) -> tuple[str, dict]:
    """(family, transformers' own TP plan of its decoder), or one line when transformers ships none."""
    from bdlora_train.core.heads import text_config

    config = text_config(model.config)
    family = getattr(config, "model_type", type(model).__name__)
    own_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not own_plan:
        raise TPError(
            f"tp: transformers ships no tensor-parallel plan for {family}, so it cannot load it sharded; train it with "
            "tp_size=1 (data-parallel: DDP, ZeRO, FSDP)"
        )
    return family, own_plan


# Modules whose output a transformers forward then modifies in place, which autograd refuses on the output of a TP
# layer (a view of its DTensor's local tensor): Llama-4's MoE adds the routed experts into the shared expert's output
# (modeling_llama4.py, Llama4TextMoe.forward: `out.add_(...)`; transformers 5.24). `copy_outputs_modified_in_place`
# gives these a forward hook that returns a copy (one hidden-sized tensor per layer), so the in-place add lands on it.
MODIFIED_IN_PLACE = {"Llama4TextMoe": "shared_expert"}


# Families whose TP training runs but does not train the one-process adapter, refused under TP (tp_size > 1).
# DeepSeek-V3 (transformers 5.24's plan: attention replicated, MLP and experts sharded): after 6 steps the saved
# adapter differed from one process's by 7e-2 with only the experts adapted and by O(1) on the attention projections;
# the cause is not found. Its experts train exactly by expert parallelism (tp_size=1; tests/test_tp_training.py).
NOT_EXACT_UNDER_TP = {
    "deepseek_v3": "train it with tp_size=1 fsdp_size=N ep_size=N (its experts by expert parallelism, attention "
    "data-parallel) or with tp_size=1"
}


def check_tp_model(model: nn.Module, tp_size: int, nblocks: int | None = None, r: int | None = None) -> None:
    """What TP training needs from the model before any adapter is resolved (the user chose tp_size, not nblocks,
    so this speaks first): transformers ships a TP plan for the family, and tp_size splits its heads. The degrees a
    refusal suggests also divide the recipe's `nblocks` and split its rank `r` (when given)."""
    from bdlora_train.arch.checks import check_heads
    from bdlora_train.core.degrees import splitting_degrees
    from bdlora_train.core.heads import head_counts

    family, _ = _family_plan(model)
    if tp_size > 1 and family in NOT_EXACT_UNDER_TP:
        raise TPError(
            f"tp: {family} under TP (tp_size={tp_size}) does not yet train the one-process adapter (docs/tp.md, "
            f"'Limits'); {NOT_EXACT_UNDER_TP[family]}"
        )
    heads, kv = head_counts(model.config)
    choices = splitting_degrees(nblocks=nblocks, r=r, heads=heads, kv=kv) if heads else None
    check_heads(model.config, tp_size, label="tp_size", error=TPError, choices=choices)


def check_tp_blocks(model: nn.Module, tp_size: int, nblocks: int | None, r: int | None, error=TPError) -> None:
    """After `check_tp_model`: a recipe's explicit nblocks must be a multiple of tp_size (each rank holds whole
    blocks) that splits the heads; the nblocks the refusal suggests are multiples of tp_size that also split the
    heads and the rank."""
    from bdlora_train.core.degrees import SUGGEST_UP_TO, divides, heads_split, splitting_degrees
    from bdlora_train.core.heads import head_counts

    heads, kv = head_counts(model.config)
    whole_blocks = nblocks is None or divides(tp_size, nblocks)
    if whole_blocks and (nblocks is None or not heads or heads_split(heads, kv, nblocks)):
        return
    fits = splitting_degrees(max(SUGGEST_UP_TO, tp_size), r=r, heads=heads, kv=kv)
    choices = [d for d in fits if divides(tp_size, d)]
    fix = (
        "use " + " or ".join(f"nblocks={d}" for d in choices) + f" (or drop it: it defaults to tp_size={tp_size})"
        if choices
        else f"drop nblocks (it defaults to tp_size={tp_size}) and give lora_r a multiple of {tp_size}"
    )
    why = (
        f"is not a multiple of tp_size={tp_size}: each rank must hold whole blocks"
        if not whole_blocks
        else f"does not split the {heads} attention / {kv or heads} KV heads: blocks must hold whole heads"
    )
    raise error(f"recipe: nblocks={nblocks} {why}; {fix}")


def check_ep_model(model: nn.Module, ep_size: int) -> None:
    """What expert-parallel training needs from the model before any weight loads: transformers ships an EP plan for
    the family, and ep_size splits its experts into whole experts per rank."""
    from bdlora_train.core.heads import text_config

    config = text_config(model.config)
    family = getattr(config, "model_type", type(model).__name__)
    if not getattr(config, "base_model_ep_plan", None):
        raise TPError(
            f"tp: transformers ships no expert-parallel plan for {family}, so it cannot load it with ep_size="
            f"{ep_size}; drop ep_size"
        )
    counts = sorted({p.shape[0] for p in model.parameters() if p.ndim == 3})
    if not counts:
        raise TPError(f"tp: {family} has no MoE experts for ep_size={ep_size} to split; drop ep_size")
    uneven = [count for count in counts if not divides(ep_size, count)]
    if uneven:
        fits = [d for d in range(2, uneven[0] + 1) if divides(d, uneven[0])]
        raise TPError(
            f"tp: ep_size={ep_size} does not divide the {uneven[0]} experts of {family}: every rank holds whole "
            f"experts; use ep_size in {fits}"
        )


def check_tp_training(
    model: nn.Module, targets: dict, tp_size: int, block_diagonal: bool = True, ep_size: int = 1, data_parallel: int = 1
) -> dict[str, str]:
    """Before any weight loads (on the meta-device model), after `check_tp_model`: every target must be a Linear that
    transformers' own TP plan shards in a style `_tp_forward` computes, with whole blocks per rank. Returns {module
    name: plan style}; one line naming the family, the module and the alternative otherwise. `targets`: what the
    adapter config resolves to (arch/targets.py `Target`s); `block_diagonal`: a BD-LoRA adapter (its rank and blocks
    must split over the ranks) rather than plain LoRA. With `ep_size` > 1 (after `check_ep_model`) the expert
    parameters are whole experts per rank (EXPERT_PARALLEL: any blocks are local); with tp_size 1 as well, the other
    targets get no style: they train data-parallel, as PEFT builds them. `data_parallel`: fsdp_size x
    dp_replicate_size (FSDP2 then manages the base weights, which a segment-aware fused projection re-cuts)."""
    from bdlora_train.arch.plans import plan_style
    from bdlora_train.arch.scope import decoder_prefix
    from bdlora_train.core.naming import relative

    if ep_size > 1 and not any(t.kind == "expert" for t in targets.values()):
        raise TPError(
            f"tp: ep_size={ep_size} but the adapter adapts no expert parameter; adapt the experts (the default "
            "targets do), or drop ep_size"
        )
    family, own_plan = _family_plan(model) if tp_size > 1 else (None, {})
    prefix = decoder_prefix(model)
    styles = {}
    for name, target in sorted(targets.items()):
        if ep_size > 1 and target.kind == "expert":
            styles[name] = EXPERT_PARALLEL
            continue
        if tp_size == 1:
            continue
        kind = target.name.rsplit(".", 1)[-1]
        style = plan_style(relative(name, prefix) or name, own_plan)
        if target.kind == "expert" or style is None:
            pass  # an expert parameter: any style that splits it (arch/plan_layouts.py); None: a replicated layer
        elif style not in TRAINED_STYLES:
            raise TPError(
                f"tp: {family}: {kind} has TP style {style!r} in transformers' plan, which TP training does not "
                f"compute ({sorted(TRAINED_STYLES)}); leave it out of target_modules or train with tp_size=1"
            )
        elif target.layout.fused and block_diagonal and data_parallel > 1:
            raise TPError(
                f"tp: {family}: {kind} is a fused projection {list(target.layout.segments)}: its rank re-cuts the base "
                "weight by segment, which FSDP2 (fsdp_size / dp_replicate_size) manages; train it under TP alone or "
                "leave it out of target_modules"
            )
        elif target.layout.fused and block_diagonal and not TRAINED_STYLES[style][1]:
            raise TPError(
                f"tp: {family}: {kind} is a fused projection {list(target.layout.segments)} with TP style {style!r}, "
                "whose output shards its consumer reads contiguously; its segment-aware blocks cannot be rank-local: "
                "leave it out of target_modules or train with tp_size=1"
            )
        if style is None and target.kind != "expert":  # every rank computes all of it: nothing to split
            styles[name] = REPLICATED
            continue
        if block_diagonal:  # whole blocks and an equal share of the rank on every rank
            check_divides(
                tp_size, target.nblocks, f"tp: {name}", key="tp_size", fix=_WHOLE_BLOCKS.format(tp_size), error=TPError
            )
            check_rank(target.r, tp_size, f"tp: {name}", blocks="tp_size", error=TPError)
        if target.layout.fused or target.kind == "expert":  # the i-th 1/N of every segment on rank i
            check_segments(target.layout.segments, tp_size, f"tp: {name}", blocks="tp_size", error=TPError)
        styles[name] = style
    return styles


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


def _tp_placement(weight):
    """(TP mesh, the weight's placement on it) of a DTensor weight: its mesh itself when 1-D, else its "tp" dimension
    (a base sharded by TP and FSDP2 holds (fsdp, tp) placements outside forward)."""
    mesh = weight.device_mesh
    if mesh.ndim == 1:
        return mesh, weight.placements[0]
    names = mesh.mesh_dim_names or ()
    if "tp" not in names:
        return None, None
    return mesh["tp"], weight.placements[names.index("tp")]


def tp_style(module: nn.Module) -> str | None:
    """COLWISE or ROWWISE for a Linear transformers sharded by its plan (read from its weight's TP placement)."""
    from torch.distributed.tensor import DTensor, Shard

    weight = getattr(module, "weight", None)
    if not isinstance(weight, DTensor):
        return None
    _, placement = _tp_placement(weight)
    if not isinstance(placement, Shard) or type(placement) is not Shard:
        return None
    return COLWISE if placement.dim == 0 else ROWWISE


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


def shard_adapters(model: nn.Module, styles: dict[str, str], targets=None) -> dict[str, AdapterShard]:
    """Make the adapter of every adapted layer of a TP-loaded model rank-local (see the module docstring), in place.

    `styles`: {base-model name: plan style}, from `check_tp_training`; `targets`: the resolved targets it checked
    (arch/targets.py `Target`s: the layouts of the factors PEFT stores densely, tp/pieces.py). Every rank must hold
    the same full adapter before (same seed: the factors are sliced locally, never sent). Returns {layer name:
    AdapterShard}; refuses, in one line, a layer it cannot shard exactly.
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
        elif hasattr(layer, "parameter_name"):
            shards[name] = _shard_expert_layer(name, layer, adapters[0], target)
        elif styles.get(key) == REPLICATED:
            shards[name] = _replicate_layer(name, layer, adapters[0], model)
        elif _is_dense(layer):
            shards[name] = _shard_dense_linear(name, layer, adapters[0], target, styles.get(key))
        else:
            shards[name] = _shard_linear_layer(name, layer, adapters[0], styles.get(key))
    if not shards:
        raise TPError("tp: the model has no adapted Linear to shard")
    return shards


def copy_outputs_modified_in_place(model: nn.Module) -> None:
    """Make a TP-loaded model's forward differentiable where transformers modifies a TP layer's output in place
    (MODIFIED_IN_PLACE), adapted or not (idempotent)."""
    for module in model.modules():
        child = MODIFIED_IN_PLACE.get(type(module).__name__)
        if child is not None and not hasattr(module, "_bdlora_copied_output"):
            getattr(module, child).register_forward_hook(lambda _m, _args, out: out.clone())
            module._bdlora_copied_output = True


def _replicate_layer(name: str, layer: nn.Module, adapter: str, model: nn.Module) -> AdapterShard:
    """A Linear the model's plan leaves replicated: every rank computes all of it on the same input, so its factors
    are replicated DTensors (their gradients are whole and equal on every rank: no collective) and the layer runs on
    their local tensors."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = next(
        (_tp_placement(p)[0] for p in model.parameters() if isinstance(p, DTensor) and _tp_placement(p)[0] is not None),
        None,
    )
    if mesh is None or mesh.ndim != 1:
        raise TPError(f"tp: {name}: no 1-D TP mesh to replicate its adapter on; leave it out of target_modules")
    role, nblocks = adapter_role(layer, adapter) if not _is_dense(layer) else ("plain", 1)
    for factors in (layer.lora_A, layer.lora_B):
        _distribute_factor(name, factors[adapter], mesh, Replicate())
    shard = AdapterShard(REPLICATED, role, nblocks, mesh, dense=_is_dense(layer))
    layer._bdlora_tp = shard
    layer.forward = types.MethodType(_replicated_forward, layer)
    return shard


def _is_dense(layer: nn.Module) -> bool:
    return any(buf.startswith("bdmask_") for buf, _ in layer.named_buffers(recurse=False))


def _replicated_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A replicated layer's forward: the base layer and the whole adapter, locally."""
    from torch.distributed.tensor import DTensor

    active = _trained_adapters(self)
    if isinstance(x, DTensor):
        x = x.to_local()
    out = self.get_base_layer()(x, *args, **kwargs)
    shard: AdapterShard = self._bdlora_tp
    for adapter in active:
        if shard.dense or shard.role not in (BD_A, BD_B):
            weight_a, weight_b = _local_factors(self, adapter)
            out = out + self.scaling[adapter] * ((_dropout(self, adapter, x) @ weight_a.t()) @ weight_b.t())
        else:
            weight_a, weight_b = _local(self.lora_A[adapter].weight), _local(self.lora_B[adapter].weight)
            out = bdlora_add_(
                out, _dropout(self, adapter, x), weight_a, weight_b, self.scaling[adapter], shard.nblocks, shard.role
            )
    return out


def _linear_style(name: str, base: nn.Module, plan: str | None) -> tuple[str, bool, bool]:
    """(COLWISE | ROWWISE, gathers its output, splits its input) of a Linear sharded by the model's TP plan in a
    style `_tp_forward` computes; one line otherwise."""
    style = tp_style(base)
    if style is None or plan not in TRAINED_STYLES or TRAINED_STYLES[plan][0] != style:
        raise TPError(
            f"tp: {name} is adapted but its base layer is not sharded column- or row-wise by the model's TP plan; "
            "adapt only the TP-sharded projections (the default targets)"
        )
    return (style, *TRAINED_STYLES[plan][1:])


def _trained_adapters(layer) -> list[str]:
    """The adapters a TP forward adds (none while adapters are disabled); a merged adapter is refused."""
    if layer.merged:
        raise TPError("tp: a merged adapter cannot be trained under TP; unmerge it first")
    return [] if layer.disable_adapters else [a for a in layer.active_adapters if a in layer.lora_A]


def _shard_linear_layer(name: str, layer: nn.Module, adapter: str, plan: str | None) -> AdapterShard:
    """A Linear whose factors PEFT stores natively: DTensor placements (the table in the module docstring)."""
    base = layer.get_base_layer()
    style, gather, split = _linear_style(name, base, plan)
    role, nblocks = adapter_role(layer, adapter)
    mesh, _ = _tp_placement(base.weight)
    shard = AdapterShard(style, role, nblocks, mesh, gather, split)
    if role in (BD_A, BD_B):
        check_divides(
            shard.world, nblocks, f"tp: {name}", key="tp_size", fix=_WHOLE_BLOCKS.format(shard.world), error=TPError
        )
    if role in (BD_A, BD_B) and (role == BD_B) != (style == COLWISE):
        raise TPError(
            f"tp: {name} is {style}-parallel but its block-diagonal factor is {'B' if role == BD_B else 'A'}: the "
            "blocks do not follow the TP shards"
        )
    for factors, placement in zip((layer.lora_A, layer.lora_B), _placements(shard)):
        _distribute_factor(name, factors[adapter], mesh, placement)
    if role not in (BD_A, BD_B) and style == COLWISE:
        _reduce_grad_after_backward(layer.lora_A[adapter].weight)  # plain LoRA: each rank has a partial grad of A
    layer._bdlora_tp = shard
    layer.forward = types.MethodType(_tp_forward, layer)
    return shard


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


def _shard_pieces(name: str, layer: nn.Module, adapter: str, target, mesh, block_diagonal: bool) -> None:
    """Hold each dense-stored factor as its rank-local piece (tp/pieces.py), its mask sliced alike; a replicated
    factor (plain LoRA) gets its gradient all-reduced."""
    from torch.distributed.tensor import Replicate

    from bdlora_train.tp.pieces import factor_pieces

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
        module.weight._bdlora_piece = piece
        mask = getattr(layer, f"bdmask_{label}_{adapter}", None)
        if mask is not None:
            layer.register_buffer(f"bdmask_{label}_{adapter}", piece.local(mask, rank), persistent=False)


def _local_factors(layer, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A, B) of a dense-stored layer, masked (the off-block zeros stay zero)."""
    out = []
    for label, factors in (("A", layer.lora_A), ("B", layer.lora_B)):
        weight = _local(factors[adapter].weight)
        weight = weight[0] if hasattr(factors[adapter].weight, "_bdlora_piece") else weight
        mask = getattr(layer, f"bdmask_{label}_{adapter}", None)
        out.append(weight if mask is None else weight * mask.to(weight.dtype))
    return out[0], out[1]


def _shard_dense_linear(name: str, layer: nn.Module, adapter: str, target, plan: str | None) -> AdapterShard:
    """A Linear whose block-diagonal factor PEFT stores densely (tp/pieces.py): a segment-aware fused projection
    (Phi-3 qkv_proj / gate_up_proj, GLM-4 gate_up_proj), or any Linear of an adapter that also holds expert factors.

    A fused projection is column-parallel with its output all-gathered, and transformers shards its weight
    contiguously; here rank i holds instead the i-th 1/N of every segment (the rows its blocks of B cover), computes
    those outputs, and after the base's own all-gather a local index puts the output back in order (no collective).
    Its base weight is regathered once, at setup, to take those rows."""
    from torch.distributed.tensor import DTensor, Shard

    from bdlora_train.core.blocks import rank_order, shard_rows

    base = layer.get_base_layer()
    mesh, _ = _tp_placement(base.weight) if isinstance(base.weight, DTensor) else (None, None)
    _dense_target(name, target, mesh)
    style, gather, split = _linear_style(name, base, plan)
    order = None
    if target.layout.fused:
        if not gather:
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
    _shard_pieces(name, layer, adapter, target, mesh, block_diagonal=target.nblocks > 1)
    role = target.role if target.nblocks > 1 else "plain"
    shard = AdapterShard(style, role, target.nblocks, mesh, gather, split, dense=True, order=order)
    layer._bdlora_tp = shard
    layer.forward = types.MethodType(_tp_forward, layer)
    return shard


def _shard_expert_layer(name: str, layer: nn.Module, adapter: str, target) -> AdapterShard:
    """An expert parameter (PEFT's ParamWrapper on transformers' experts module, `moe_tp_experts`): the parameter is
    split along one axis (gate_up: the i-th 1/N of gate and of up, `packed_colwise`; down: its input slice), and rank
    i adds its slice of every expert's delta, from its own pieces, to its own shard before the experts run. The
    experts' own all-reduce (forward) and input-gradient all-reduce (backward) are the only collectives."""
    from torch.distributed.tensor import DTensor

    from bdlora_train.core.layout import expert_axis, is_transposed

    experts = layer.get_base_layer()
    param = experts._parameters.get(layer.parameter_name)
    mesh, placement = _tp_placement(param) if isinstance(param, DTensor) else (None, None)
    _dense_target(name, target, mesh)
    want = expert_axis(target.layout.factor, is_transposed(experts))
    dim = getattr(placement, "dim", None)
    strided = getattr(placement, "split_factor", 1) > 1
    if dim is None or dim % 3 != want or strided != target.layout.fused:
        raise TPError(
            f"tp: {name}: transformers sharded {layer.parameter_name} as {placement}, not along axis {want} as its "
            f"{target.layout.style!r} plan entry says; leave the experts out (experts=False) or train with tp_size=1"
        )
    _shard_pieces(name, layer, adapter, target, mesh, block_diagonal=target.role in (BD_A, BD_B) and target.nblocks > 1)
    return _expert_shard(layer, AdapterShard("expert", target.role if target.nblocks > 1 else "plain",
                                             target.nblocks, mesh))  # fmt: skip


def _shard_ep_expert_layer(name: str, layer: nn.Module, adapter: str, target) -> AdapterShard:
    """An expert parameter under expert parallelism (transformers' `grouped_gemm` / `ep_dispatch_experts`): rank i
    holds whole experts, a contiguous 1/ep of them, so it holds their whole factors (tp/pieces.py `expert_pieces`:
    blocks, if any, included) and adds their deltas to its experts before they run. The base's token dispatch and
    combine are the only collectives; each factor's gradient sums the tokens every rank sent its experts
    (`average_over_data_parallel` divides it by the data-parallel degree)."""
    from torch.distributed.tensor import DTensor

    from bdlora_train.tp.pieces import expert_pieces

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
    for module in modules.values():
        module.weight._bdlora_expert_parallel = True
    return _expert_shard(layer, AdapterShard(EXPERT_PARALLEL, target.role if target.nblocks > 1 else "plain",
                                             target.nblocks, mesh))  # fmt: skip


def _expert_shard(layer, shard: AdapterShard) -> AdapterShard:
    """Give an expert parameter's wrapper its rank-local forward; its experts module adds the staged deltas."""
    experts = layer.get_base_layer()
    if not hasattr(experts, "_bdlora_deltas"):
        experts._bdlora_deltas, experts._bdlora_swapped = {}, {}
        experts.register_forward_pre_hook(_add_staged_deltas)
        experts.register_forward_hook(_restore_parameters, always_call=True)
    layer._bdlora_tp = shard
    layer.forward = types.MethodType(_expert_forward, layer)
    return shard


def _expert_delta(layer, adapter: str, experts: int) -> torch.Tensor:
    """This rank's delta of the `experts` experts it computes, in the parameter's own layout (PEFT's
    `get_delta_factors` on the local pieces: A (E*r_i, d_in_i) expert-major rows, B (d_out_i, r_i*E) rank-major
    columns)."""
    weight_a, weight_b = _local_factors(layer, adapter)
    weight_a = weight_a.reshape(experts, -1, weight_a.shape[-1])
    weight_b = weight_b.reshape(weight_b.shape[0], -1, experts).permute(2, 0, 1)
    if not layer._did_swap_in_out_features:
        lhs, rhs = weight_a.transpose(-2, -1), weight_b.transpose(-2, -1)
    else:
        lhs, rhs = weight_b, weight_a
    return torch.bmm(lhs, rhs) * layer.scaling[adapter]


def _expert_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """An expert parameter's wrapper under TP / EP: stage this rank's delta for its experts module, which adds it to
    the parameter as the experts run (`_add_staged_deltas`), after whatever transformers' own hooks put there (the
    local shard, FSDP's unsharded experts)."""
    active = _trained_adapters(self)
    if not active:
        return self.base_layer(x, *args, **kwargs)
    experts = self.get_base_layer()
    count = _local(experts._parameters[self.parameter_name]).shape[0]
    experts._bdlora_deltas[self.parameter_name] = sum(_expert_delta(self, adapter, count) for adapter in active)
    try:
        return self.base_layer(x, *args, **kwargs)
    finally:
        experts._bdlora_deltas.pop(self.parameter_name, None)


def _add_staged_deltas(experts: nn.Module, args) -> None:
    """Forward pre-hook of an adapted experts module (after transformers' and FSDP's own: they were registered
    first): each staged parameter becomes its local tensor plus the delta for the experts' forward
    (`moe_tp_experts` and `ep_dispatch_experts` leave a non-DTensor parameter as it is)."""
    for name, delta in experts._bdlora_deltas.items():
        current = experts._parameters[name]
        weight = _local(current)
        if delta.shape != weight.shape:
            raise TPError(f"tp: {name}: this rank's delta {tuple(delta.shape)} does not fit its {tuple(weight.shape)}")
        summed = weight + delta.to(weight.dtype)
        experts._bdlora_swapped[name] = (current, summed)
        experts._parameters[name] = summed


def _restore_parameters(experts: nn.Module, args, output) -> None:
    """Forward hook: the parameters `_add_staged_deltas` replaced come back (unless FSDP's own hook already put its
    sharded parameter back)."""
    for name, (current, summed) in experts._bdlora_swapped.items():
        if experts._parameters[name] is summed:
            experts._parameters[name] = current
    experts._bdlora_swapped.clear()


def _reduce_grad_after_backward(param: nn.Parameter) -> None:
    """Plain LoRA on a column-parallel layer: every rank computes A's gradient from its own output shard only, so the
    gradients are partial sums; add them up after each backward (the collective BD-LoRA does not need)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    def all_reduce(p):
        grad = DTensor.from_local(_local(p.grad), p.device_mesh, [Partial()], run_check=False)
        p.grad = grad.redistribute(placements=[Replicate()])

    param.register_post_accumulate_grad_hook(all_reduce)


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


class _ShardedLinearFn(torch.autograd.Function):
    """This rank's shard of a frozen Linear and its adapter's local factors as one autograd node (the TP twin of
    peft_seam/layers.py's `_BdLoraLinearFn`, same forward and backward, dropout and autocast included).

    The factors come in as the DTensor parameters themselves: the forward reads their local shards (autograd runs it
    with grad mode off, where `to_local` is the shard itself) and the backward hands their gradients back as DTensors
    of the parameters' own mesh and placements. Reading them with `to_local` in the forward instead costs two autograd
    nodes per layer, and each one's backward re-derives the gradient's global layout and wraps it through
    `DTensor.from_local`: on CPU that per-parameter Python outweighed a 16-token step's adapter FLOPs."""

    @staticmethod
    def forward(ctx, x, dropout, weight, bias, weight_a, weight_b, scaling, nblocks, role):
        a, b = weight_a.to_local(), weight_b.to_local()
        result, h, mask = linear_with_adapter(x, dropout, x.dtype, weight, bias, a, b, scaling, nblocks, role)
        ctx.save_for_backward(x, h, mask, weight, a, b)
        ctx.node = OneNode(scaling, nblocks, role, x, dropout, x.dtype, result)
        ctx.specs = weight_a._spec, weight_b._spec  # mesh, placements and global shape / stride of each
        return result

    @staticmethod
    def backward(ctx, grad_out):
        from torch.distributed.tensor import DTensor

        x, h, mask, weight, a, b = ctx.saved_tensors
        need = ctx.needs_input_grad
        grad_x, *grads = ctx.node.grads(grad_out, x, h, mask, weight, a, b, need[0], need[4], need[5])
        # The parameter's own spec, not `DTensor.from_local`, which re-derives it (59 us a gradient on CPU against
        # 4 us, scripts/bench_dtensor_grad_wrap.py; 56 a step on the bench model): the gradient has the parameter's
        # shape, stride and dtype.
        grad_a, grad_b = (
            None if grad is None else DTensor(grad.contiguous(), spec, requires_grad=False)
            for grad, spec in zip(grads, ctx.specs)
        )
        return grad_x, None, None, None, grad_a, grad_b, None, None, None


def _frozen_local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A base weight's local shard: with no autograd node when it is frozen (nothing flows back into it), through
    `to_local`'s when it trains (e.g. PEFT's `bias="all"`)."""
    if t is None:
        return None
    if t.requires_grad:
        return _local(t)
    with torch.no_grad():
        return _local(t)


def _one_node_adapter(layer, shard: AdapterShard, active: list[str], x, weight, bias) -> str | None:
    """The adapter `_ShardedLinearFn` computes with the base layer, else None (the two-node path): one PEFT-native
    adapter on a frozen base, in dtypes `one_node_dtypes` takes (autocast and fp32 adapter weights on a bf16 base
    included), dropout or not; on a row-parallel layer only a block-diagonal one (plain LoRA's B follows the
    all-reduce)."""
    if len(active) != 1 or shard.dense or (shard.style == ROWWISE and shard.role not in (BD_A, BD_B)):
        return None
    adapter = active[0]
    base = layer.get_base_layer()
    if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        return None
    weight_a, weight_b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    if node_dropout(layer, adapter) is None:
        return None
    return adapter if one_node_dtypes(x, weight, bias, weight_a, weight_b) else None


def _sharded_linear(layer, adapter: str, shard: AdapterShard, x, weight, bias) -> torch.Tensor:
    role = shard.role if shard.role in (BD_A, BD_B) else "plain"
    return _ShardedLinearFn.apply(
        x,
        node_dropout(layer, adapter),
        weight,
        bias,
        layer.lora_A[adapter].weight,
        layer.lora_B[adapter].weight,
        layer.scaling[adapter],
        max(shard.nblocks // shard.world, 1),
        role,
    )


def _tp_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The adapted layer's forward under TP (replaces PEFT's and the base layer's TP hook; see the module docstring)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    shard: AdapterShard = self._bdlora_tp
    base = self.get_base_layer()
    weight = _frozen_local(base.weight)
    active = _trained_adapters(self)
    if isinstance(x, DTensor):
        x = x.to_local()
    if shard.style == COLWISE:
        bias = _frozen_local(base.bias)
        one_node = _one_node_adapter(self, shard, active, x, weight, bias)
        # the input gradient of the base *and* the adapter is one partial sum, all-reduced once (backward)
        x = DTensor.from_local(x, shard.mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
        if one_node is not None:
            out = _sharded_linear(self, one_node, shard, x, weight, bias)
        else:
            out = F.linear(x, weight, bias)
            for adapter in active:
                out = _add_adapter(self, adapter, shard, x, out)
        if shard.gather_output:  # the base layer's own all-gather
            out = DTensor.from_local(out, shard.mesh, [Shard(out.dim() - 1)], run_check=False)
            out = out.redistribute(placements=[Replicate()]).to_local()
        return out if shard.order is None else out.index_select(-1, shard.order.to(out.device))
    if shard.split_input:  # replicated input: keep this rank's slice (its gradient is all-gathered, as the base's)
        x = DTensor.from_local(x, shard.mesh, [Replicate()], run_check=False)
        x = x.redistribute(placements=[Shard(x.dim() - 1)]).to_local()
    one_node = _one_node_adapter(self, shard, active, x, weight, None)
    plain_lora = []
    if one_node is not None:  # this rank's partial sum of the output, the adapter's part included
        out = _sharded_linear(self, one_node, shard, x, weight, None)
    else:
        out = F.linear(x, weight)  # this rank's partial sum of the output
        for adapter in active:
            if shard.role in (BD_A, BD_B):
                out = _add_adapter(self, adapter, shard, x, out)
            else:
                plain_lora.append(adapter)
    out = DTensor.from_local(out, shard.mesh, [Partial()], run_check=False)
    out = out.redistribute(placements=[Replicate()]).to_local()  # the base layer's own all-reduce
    if base.bias is not None:
        out = out + _frozen_local(base.bias)
    for adapter in plain_lora:  # x_i A_i^T is partial: all-reduced before B (the collective BD-LoRA avoids)
        h = _dropout(self, adapter, x) @ _local(self.lora_A[adapter].weight).t()
        h = DTensor.from_local(h, shard.mesh, [Partial()], run_check=False).redistribute(placements=[Replicate()])
        out = out + self.scaling[adapter] * (h.to_local() @ _local(self.lora_B[adapter].weight).t())
    return out


def _dropout(layer, adapter: str, x: torch.Tensor) -> torch.Tensor:
    return layer.lora_dropout[adapter](x) if drops(layer, adapter) else x


def _add_adapter(layer, adapter: str, shard: AdapterShard, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out += s (x A_local^T) B_local^T with this rank's factors: in place (the toolkit's fused kernel) for PEFT-native
    blocks, masked matmuls for dense-stored pieces."""
    if shard.dense:
        weight_a, weight_b = _local_factors(layer, adapter)
        return out + layer.scaling[adapter] * ((_dropout(layer, adapter, x) @ weight_a.t()) @ weight_b.t())
    weight_a = _local(layer.lora_A[adapter].weight)
    weight_b = _local(layer.lora_B[adapter].weight)
    local_blocks = max(shard.nblocks // shard.world, 1)
    role = shard.role if shard.role in (BD_A, BD_B) else "plain"
    return bdlora_add_(out, _dropout(layer, adapter, x), weight_a, weight_b, layer.scaling[adapter], local_blocks, role)


def is_sharded(model: nn.Module) -> bool:
    """Whether `shard_adapters` sharded this model's adapter."""
    return any(hasattr(m, "_bdlora_tp") for m in model.modules())


def adapter_pieces(model: nn.Module) -> dict:
    """{parameter name: tp/pieces.py Piece} of the factors held as rank-local pieces."""
    return {key: p._bdlora_piece for key, p in model.named_parameters() if hasattr(p, "_bdlora_piece")}


def peft_numel(param: torch.Tensor) -> int:
    """Entries of a parameter as PEFT saves it: a rank-local piece counts as the whole tensor (zeros included, as in
    a one-process run), a ZeRO-3 partition as its full size."""
    piece = getattr(param, "_bdlora_piece", None)
    if piece is not None:
        return piece.shape[0] * piece.shape[1]
    return getattr(param, "ds_numel", param.numel())


def gather_adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """{state-dict key: full tensor, in PEFT's layout} of every adapter parameter (collective: every rank must call
    it)."""
    from torch.distributed.tensor import DTensor

    pieces = adapter_pieces(model)
    out = {}
    for key, value in model.state_dict().items():
        if ".lora_" not in key:
            continue
        full = (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
        out[key] = (pieces[key].unpack(full) if key in pieces else full).contiguous()
    return out


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full adapter tensors (keyed as `gather_adapter_state` returns them) into the rank-local parameters: each
    rank keeps its own slice (no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = dict(model.named_parameters())
    pieces = adapter_pieces(model)
    missing = [key for key in params if ".lora_" in key and key not in state]
    if missing:
        raise TPError(f"tp: the checkpoint has no tensor for {missing[0]}; resume with the adapter it was trained with")
    with torch.no_grad():
        for key, full in state.items():
            param = params.get(key)
            if param is None:
                continue
            shape = pieces[key].shape if key in pieces else tuple(param.shape)
            if tuple(full.shape) != tuple(shape):
                raise TPError(f"tp: checkpoint tensor {key} is {tuple(full.shape)}, the adapter's is {tuple(shape)}")
            if key in pieces:
                full = pieces[key].pack(full)
            if isinstance(param, DTensor):
                param.copy_(
                    distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
                )
            else:
                param.copy_(full)


# ---- what the Trainer needs (train/trainer.py) -----------------------------------------------------------------


@contextlib.contextmanager
def hidden_tp_size(model: nn.Module):
    """Hide a TP-loaded model's `tp_size` from transformers' Trainer while it builds its Accelerator, so that it hands
    accelerate no ParallelismConfig (which accelerate refuses on CPU process groups); see `data_mesh`."""
    model.tp_size = 1  # an instance attribute shadows the property PeftModel forwards to the base model
    try:
        yield
    finally:
        del model.tp_size


def mesh_sizes(model: nn.Module) -> tuple[int, int, int]:
    """(dp_replicate, fsdp, tp) of the `DistributedConfig` the base was loaded with (a size transformers' version
    does not have, or left unset, is 1)."""
    return tuple(_distributed_size(model, key) for key in ("dp_replicate_size", "fsdp_size", "tp_size"))


def ep_size(model: nn.Module) -> int:
    """The expert-parallel degree the base was loaded with (1: none)."""
    return _distributed_size(model, "ep_size")


def _distributed_size(model: nn.Module, key: str) -> int:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base.config.distributed_config, key, None) or 1


def data_mesh(model: nn.Module):
    """A device mesh with accelerate's dimension names (dp_replicate, dp_shard, tp) over the same ranks as the base
    model's (transformers lays them out row-major as (pp, dp_replicate, fsdp, tp)): accelerate's data loaders give
    every rank of a TP group the same batch and each data-parallel rank its own."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(_device_type(), mesh_sizes(model), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def data_parallel_group(model: nn.Module):
    """The process group of the ranks that hold the same adapter shard on other data (every rank with this rank's TP
    coordinate), or None without data parallelism."""
    from torch.distributed.device_mesh import init_device_mesh

    replicas, fsdp, tp = mesh_sizes(model)
    if replicas * fsdp == 1:
        return None
    return init_device_mesh(_device_type(), (replicas * fsdp, tp), mesh_dim_names=("dp", "tp"))["dp"].get_group()


def average_over_data_parallel(model: nn.Module, group) -> None:
    """Average the adapter's local gradients over the data-parallel ranks, in one flattened all-reduce: what DDP does
    for a replicated model (FSDP2, applied by transformers at load, manages only the frozen base). An expert-parallel
    factor lives on one rank and its gradient already sums the tokens of every data-parallel rank (the base's token
    dispatch brought them): it is divided by their number instead, with no collective."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if group is None:
        return
    trained = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    for p in trained:
        if getattr(p, "_bdlora_expert_parallel", False):
            _local(p.grad).div_(dist.get_world_size(group))
    grads = [p.grad for p in trained if not getattr(p, "_bdlora_expert_parallel", False)]
    if not grads:
        return
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    flat = torch.cat([g.reshape(-1) for g in local])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in local:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _saved_key(state_key: str, adapter: str = "default") -> str:
    """A state-dict key of the adapter -> the key PEFT saves it under (the adapter name dropped)."""
    return state_key.replace(f".lora_A.{adapter}.", ".lora_A.").replace(f".lora_B.{adapter}.", ".lora_B.")


def load_checkpoint_adapter(model: nn.Module, checkpoint) -> None:
    """Resume: the adapter saved in a checkpoint (PEFT's adapter_model.safetensors, gathered) back into the
    rank-local parameters."""
    from pathlib import Path

    from safetensors.torch import load_file

    saved = load_file(str(Path(checkpoint) / "adapter_model.safetensors"))
    state = {key: saved[_saved_key(key)] for key in model.state_dict() if ".lora_" in key and _saved_key(key) in saved}
    load_adapter_state(model, state)


def _state_dict_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def _map_piece_state(model: nn.Module, state: dict, to_peft: bool) -> dict:
    """The optimizer state with every state tensor of a rank-local piece converted to PEFT's layout (`to_peft`, for
    the checkpoint) or back to the pieces (at resume), so a checkpoint holds it whatever the TP degree."""
    pieces = adapter_pieces(model)
    for key, entry in state.get("state", {}).items():
        piece = pieces.get(key)
        for name, value in entry.items() if piece is not None else ():
            if isinstance(value, torch.Tensor) and to_peft and value.dim() == 3:
                entry[name] = piece.unpack(value)
            elif isinstance(value, torch.Tensor) and not to_peft and tuple(value.shape) == piece.shape:
                entry[name] = piece.pack(value)
    return state


def save_optimizer(model: nn.Module, optimizer, output_dir, write: bool) -> None:
    """The optimizer state with every rank-local tensor gathered (collective), written by the writing rank as
    optimizer.pt: a checkpoint holds the full adapter and its full optimizer state, whatever the TP degree."""
    from pathlib import Path

    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
    state = get_optimizer_state_dict(model, inner, options=_state_dict_options(cpu_offload=True))
    if write:
        state = _map_piece_state(model, state, to_peft=True)
        torch.save(state, Path(output_dir) / "optimizer.pt")


def load_optimizer(model: nn.Module, optimizer, checkpoint) -> None:
    """Resume: the full optimizer state of a checkpoint, each rank keeping its own slice of every tensor."""
    from pathlib import Path

    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    inner = getattr(optimizer, "optimizer", optimizer)
    state = torch.load(Path(checkpoint) / "optimizer.pt", map_location="cpu", weights_only=True)
    state = _map_piece_state(model, state, to_peft=False)
    set_optimizer_state_dict(model, inner, state, options=_state_dict_options())
