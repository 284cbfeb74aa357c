"""Which layers TP shards and how, with every check sharding at a TP degree needs; `shard_model`.

Styles follow transformers' plan vocabulary (transformers/distributed/tensor_parallel.py) on PyTorch's own
ColwiseParallel / RowwiseParallel:

  colwise                 output sharded (Shard(-1)); the next layer runs on the shard
  colwise_gather_output   output all-gathered (Phi-3 qkv / gate_up, OLMo2 q/k/v, OPT / Bloom / MPT / Falcon attention)
  rowwise                 input sharded, output all-reduced
  rowwise_split_input     input replicated and split locally, output all-reduced
  packed_colwise / moe_tp_experts   expert parameters: rank i holds the i-th 1/N of every expert (sharded_experts.py)

A fused layer with segments (Phi-3 `qkv_proj` = [q | k | v]) is sharded segment-aware, as vLLM's QKVParallelLinear
does: its rows are permuted so rank i's contiguous shard is the i-th 1/N of every segment, and the gathered output
is permuted back. Base weights, BD-LoRA blocks and S-LoRA shards all use the same permutation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from bdlora_train.adapters.reader import Adapter
from bdlora_train.arch.checks import check_heads
from bdlora_train.arch.plan_layouts import plan_layouts
from bdlora_train.arch.plans import GATHER_STYLES, tp_plan
from bdlora_train.core.blocks import rank_order
from bdlora_train.core.degrees import check_rank, check_segments, divides, servable_degrees
from bdlora_train.core.errors import BlockDiagLoraError, TPError
from bdlora_train.core.heads import head_counts, text_config
from bdlora_train.core.layout import COLUMN, Layout, Side
from bdlora_train.models import probe_model
from bdlora_train.tp_diagnostics.sharded_lora import FORWARD_SCHEMES, SiblingGroup, TPLoraLinear


@dataclass
class Shard:
    """How the harness shards one Linear (or one expert parameter)."""

    layout: Layout  # its side: layout.parallel; the raw plan style: layout.style

    @property
    def side(self) -> Side:
        return self.layout.parallel

    @property
    def gather(self) -> bool:
        return self.layout.style in GATHER_STYLES

    @property
    def split_input(self) -> bool:
        return self.layout.style == "rowwise_split_input"


def tp_styles(model, tp: int, adapter: Adapter | None = None) -> dict[str, Shard]:
    """{module or expert parameter: Shard} for the model's TP plan, after every check sharding at `tp` needs.

    Works on meta-device models, so the parent process validates before spawning ranks.
    """
    config = text_config(model.config)
    if not tp_plan(model.config):
        raise TPError(
            f"tp: model_type={config.model_type!r} has no tensor-parallel plan; use a Llama/Qwen2/Mistral-style decoder"
        )
    heads, kv = head_counts(model.config)
    if adapter is not None:
        _check_blocks(adapter, tp, heads, kv)
    check_heads(model.config, tp, label="--tp", error=TPError)
    try:
        layouts = plan_layouts(model, probe_model)
    except BlockDiagLoraError as err:
        raise TPError(f"tp: {err}") from None
    shards = {}
    for name, layout in layouts.items():
        if not layout.experts and not isinstance(model.get_submodule(name), nn.Linear):
            continue
        check_segments(layout.segments, tp, f"tp: {name} ({layout.style})", blocks="--tp",
                       what="features along the split", heads=heads, kv=kv, error=TPError)
        shards[name] = Shard(layout)
    if adapter is not None:
        _check_roles(adapter, shards, tp)
    return shards


def _check_blocks(adapter: Adapter, tp: int, heads: int | None = None, kv: int | None = None) -> None:
    if not adapter.has_structure:
        raise TPError(
            f"tp: {adapter.path} is a plain LoRA adapter (no use_bdlora): BD-LoRA sharding needs block-diagonal "
            "factors; "
            "train with BlockDiagLoraConfig(nblocks=TP)"
        )
    if not divides(tp, adapter.bd_nblocks):
        degrees = servable_degrees(adapter.bd_nblocks, heads, kv)
        raise TPError(
            f"tp: adapter nblocks={adapter.bd_nblocks} is not a multiple of --tp {tp}: blocks would straddle TP "
            f"shards; use --tp in {degrees}"
        )


def _check_roles(adapter: Adapter, shards: dict[str, Shard], tp: int) -> None:
    for name, module in adapter.modules.items():
        shard = shards.get(name)
        if shard is None:
            raise TPError(
                f"tp: adapter module {name} is not a column- or row-parallel layer of the base model's TP plan"
            )
        expected = shard.layout.role
        if module.experts and module.bd_nblocks == 1:
            continue  # expert parallelism: whole experts per rank, dense factors (experts stay replicated here)
        if module.bd_role != expected:
            raise TPError(
                f"tp: {name} is {shard.side}-parallel but the adapter stores role {module.bd_role!r} "
                f"(needs {expected!r}); its blocks do not follow the TP shards"
            )
        if module.segments != shard.layout.segments:
            raise TPError(
                f"tp: {name} is sharded by segments {list(shard.layout.segments)} but the adapter's blocks follow "
                f"{list(module.segments)} (contiguous blocks on a fused layer straddle the TP shards)"
            )
        check_rank(module.r, tp, f"tp: {name}", blocks="--tp", error=TPError)


def _permute_rows_(linear: nn.Linear, order: torch.Tensor) -> None:
    with torch.no_grad():
        linear.weight.data = linear.weight.data[order].contiguous()
        if linear.bias is not None:
            linear.bias.data = linear.bias.data[order].contiguous()


def shard_model(model, mesh, adapter: Adapter | None = None) -> list:
    """Shard `model` in place over `mesh` (its TP plan) and attach this rank's LoRA shards; returns the LoRA layers
    (TPLoraLinear and tp.experts.ExpertShard) whose mode `set_mode` switches."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from bdlora_train.tp_diagnostics.sharded_experts import shard_experts

    world, rank = mesh.size(), mesh.get_local_rank()
    shards = tp_styles(model, world, adapter)
    linear_shards = {n: s for n, s in shards.items() if not s.layout.experts}
    factors = adapter.modules if adapter else {}
    layers = []
    orders = {}
    for name, shard in linear_shards.items():
        if shard.layout.fused:
            orders[name] = rank_order(shard.layout.segments, world)
        if name not in factors and name not in orders:
            continue
        parent_name, _, leaf = name.rpartition(".")
        layer = TPLoraLinear(model.get_submodule(name), shard.side)
        setattr(model.get_submodule(parent_name), leaf, layer)
        if name in orders:
            _permute_rows_(layer, orders[name])
        if name in factors:
            layer.set_factors(factors[name], rank, world, orders.get(name))
            layers.append((name, layer))
    plan = {}
    for name, shard in linear_shards.items():
        if shard.side == COLUMN:
            plan[name] = ColwiseParallel(output_layouts=Replicate()) if shard.gather else ColwiseParallel()
        else:
            plan[name] = RowwiseParallel(input_layouts=Replicate()) if shard.split_input else RowwiseParallel()
    # Every rank already holds the full weights (same seed / same files): slice locally, no scatter.
    parallelize_module(model, mesh, plan, src_data_rank=None)
    for name, order in orders.items():  # after the gather: back to [q | k | v] for the model's own code
        if linear_shards[name].gather:
            inverse = torch.argsort(order)
            model.get_submodule(name).register_forward_hook(
                lambda _m, _a, out, inv=inverse: out[..., inv.to(out.device)]
            )
    siblings: dict[tuple, list[TPLoraLinear]] = {}  # by parent and input width: q|k|v, gate|up (not MLA's q_b|kv_b)
    for name, layer in layers:
        if layer.side == COLUMN:
            siblings.setdefault((name.rpartition(".")[0], layer.in_features), []).append(layer)
    for members in siblings.values():
        group = SiblingGroup(members)
        for layer in members:
            layer.group = group
    experts = shard_experts(model, mesh, {n: s.layout for n, s in shards.items() if s.layout.experts}, factors)
    return [layer for _, layer in layers] + experts


def set_mode(layers: list, mode: str) -> None:
    if mode not in FORWARD_SCHEMES:
        raise TPError(f"tp: mode={mode!r}; use one of {FORWARD_SCHEMES}")
    for layer in layers:
        layer.set_mode(mode) if hasattr(layer, "set_mode") else setattr(layer, "mode", mode)
