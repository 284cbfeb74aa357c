"""Which layers TP shards and how, with every check sharding at a TP degree needs; the two sharded models tp-check
compares: `shard_model` (the base, and S-LoRA's shards) and `runtime_model` (BD-LoRA by the training runtime).

Styles follow transformers' plan vocabulary (transformers/distributed/tensor_parallel.py) on PyTorch's own
ColwiseParallel / RowwiseParallel:

  colwise                 output sharded (Shard(-1)); the next layer runs on the shard
  colwise_gather_output   output all-gathered (Phi-3 qkv / gate_up, OLMo2 q/k/v, OPT / Bloom / MPT / Falcon attention)
  rowwise                 input sharded, output all-reduced
  rowwise_split_input     input replicated and split locally, output all-reduced
  packed_colwise / moe_tp_experts   expert parameters: checked here (their blocks must follow the split), left whole
                                    on every rank in the forward check (`tp-check --train` runs the runtime's
                                    expert sharding on a base transformers loads sharded)

A fused layer with segments (Phi-3 `qkv_proj` = [q | k | v]) is sharded segment-aware, as vLLM's QKVParallelLinear
does: rank i's shard is the i-th 1/N of every segment and the gathered output is put back in order (the S-LoRA
model permutes the rows before sharding; the runtime re-slices an adapted fused layer itself).
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
from bdlora_train.tp_diagnostics.sharded_lora import ReplicatedExperts, SiblingGroup, SLoraLinear


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
                f"tp: {name} is {shard.side}-parallel but the adapter stores role '{module.bd_role}' "
                f"(needs '{expected}'); its blocks do not follow the TP shards"
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


def _style(shard: Shard):
    """PyTorch's TP style for a Linear shard: column (output gathered or not) or row (input split locally or not)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if shard.side == COLUMN:
        return ColwiseParallel(output_layouts=Replicate()) if shard.gather else ColwiseParallel()
    return RowwiseParallel(input_layouts=Replicate()) if shard.split_input else RowwiseParallel()


def _trained_style(shard: Shard) -> str:
    """The transformers plan style, of those the training runtime computes (tp_runtime/styles.py TRAINED_STYLES), that
    shards this Linear as `shard` does."""
    if shard.side == COLUMN:
        return "colwise_gather_output" if shard.gather else "colwise"
    return "rowwise_split_input" if shard.split_input else "rowwise"


def _shard_linears(model, mesh, shards: dict[str, Shard], names: dict[str, str], whole: set[str]) -> None:
    """Shard each Linear of `shards` in place (`names`: its name in `model`, by base-model name). A fused layer's rows
    are permuted first, so that rank i's contiguous shard is the i-th 1/N of every segment, and its gathered output
    permuted back; `whole`: fused layers the training runtime re-slices itself, left in their own order."""
    from torch.distributed.tensor.parallel import parallelize_module

    world = mesh.size()
    orders = {}
    for name, shard in shards.items():
        if shard.layout.fused and name not in whole:
            orders[name] = rank_order(shard.layout.segments, world)
            _permute_rows_(model.get_submodule(names[name]), orders[name])
    # Every rank already holds the full weights (same seed / same files): slice locally, no scatter.
    parallelize_module(model, mesh, {names[n]: _style(s) for n, s in shards.items()}, src_data_rank=None)
    for name, order in orders.items():  # after the gather: back to [q | k | v] for the model's own code
        if shards[name].gather:
            inverse = torch.argsort(order)
            model.get_submodule(names[name]).register_forward_hook(
                lambda _m, _a, out, inv=inverse: out[..., inv.to(out.device)]
            )


def shard_model(model, mesh, adapter: Adapter | None = None) -> list:
    """Shard `model` in place over `mesh` (its TP plan) with S-LoRA's shards of `adapter`: returns the layers whose
    mode `set_mode` switches between the sharded base and S-LoRA (`SLoraLinear`, and `ReplicatedExperts` for adapted
    experts, which stay whole on every rank)."""
    world, rank = mesh.size(), mesh.get_local_rank()
    shards = tp_styles(model, world, adapter)
    linears = {n: s for n, s in shards.items() if not s.layout.experts}
    factors = adapter.modules if adapter else {}
    layers = {}
    for name, shard in linears.items():
        if name in factors:
            parent_name, _, leaf = name.rpartition(".")
            layers[name] = SLoraLinear(model.get_submodule(name), shard.side)
            setattr(model.get_submodule(parent_name), leaf, layers[name])
    for name, layer in layers.items():  # a fused layer's factors follow the permutation of its rows
        order = rank_order(linears[name].layout.segments, world) if linears[name].layout.fused else None
        layer.set_factors(factors[name], rank, world, order)
    _shard_linears(model, mesh, linears, {n: n for n in linears}, set())
    siblings: dict[tuple, list[SLoraLinear]] = {}  # by parent and input width: q|k|v, gate|up (not MLA's q_b|kv_b)
    for name, layer in layers.items():
        if layer.side == COLUMN:
            siblings.setdefault((name.rpartition(".")[0], layer.in_features), []).append(layer)
    for members in siblings.values():
        group = SiblingGroup(members)
        for layer in members:
            layer.group = group
    experts: dict[str, dict] = {}
    for name in (n for n, s in shards.items() if s.layout.experts and n in factors):
        owner, _, pname = name.rpartition(".")
        experts.setdefault(owner, {})[pname] = factors[name]
    return [*layers.values(), *(ReplicatedExperts(model.get_submodule(o), f) for o, f in experts.items())]


def runtime_model(model, mesh, adapter_path):
    """`model` with the adapter at `adapter_path` loaded by PEFT (the toolkit's layers, the file's roles) and made
    rank-local by the training runtime (tp_runtime/dispatch.py `shard_adapters`), on a base sharded with PyTorch's TP
    API like `shard_model`'s: BD-LoRA's forward in tp-check is the one `bdlora train` runs. Adapted experts stay
    whole on every rank (the runtime shards experts only as transformers loads them: `tp-check --train`)."""
    from bdlora_train.adapters.load import load_adapter
    from bdlora_train.tp_runtime.dispatch import adapted_layers, shard_adapters

    shards = {n: s for n, s in tp_styles(model, mesh.size()).items() if not s.layout.experts}
    peft_model = load_adapter(model, adapter_path)
    adapted = {name.removeprefix("base_model.model.") for name in adapted_layers(peft_model)}
    names = {n: f"base_model.model.{n}" + (".base_layer" if n in adapted else "") for n in shards}
    # a fused layer whose factors PEFT stores densely is re-sliced by the runtime itself (`_shard_dense_linear`)
    _shard_linears(peft_model, mesh, shards, names, {n for n in adapted if n in shards and shards[n].layout.fused})
    targets = getattr(peft_model.peft_config["default"], "resolved", {})
    shard_adapters(peft_model, {n: _trained_style(shards[n]) for n in adapted if n in shards}, targets)
    return peft_model


def set_mode(layers: list, mode: str) -> None:
    """Switch the S-LoRA model's layers between the sharded base ("base") and S-LoRA ("slora")."""
    if mode not in ("base", "slora"):
        raise TPError(f"tp: mode={mode!r}; the S-LoRA model runs 'base' or 'slora' (BD-LoRA: runtime_model)")
    for layer in layers:
        layer.set_mode(mode)
