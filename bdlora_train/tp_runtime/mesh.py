"""The meshes a TP run lives on: a weight's TP placement and style, the data-parallel mesh and group the Trainer
uses, and the data-parallel gradient average."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from bdlora_train.core.layout import COLUMN, ROW, Side


def tp_placement(weight):
    """(TP mesh, the weight's placement on it) of a DTensor weight: its mesh itself when 1-D, else its "tp" dimension
    (a base sharded by TP and FSDP2 holds (fsdp, tp) placements outside forward)."""
    mesh = weight.device_mesh
    if mesh.ndim == 1:
        return mesh, weight.placements[0]
    names = mesh.mesh_dim_names or ()
    if "tp" not in names:
        return None, None
    return mesh["tp"], weight.placements[names.index("tp")]


def tp_side(module: nn.Module) -> Side | None:
    """COLUMN or ROW for a Linear transformers sharded by its plan (read from its weight's TP placement)."""
    from torch.distributed.tensor import DTensor, Shard

    weight = getattr(module, "weight", None)
    if not isinstance(weight, DTensor):
        return None
    _, placement = tp_placement(weight)
    if not isinstance(placement, Shard) or type(placement) is not Shard:
        return None
    return COLUMN if placement.dim == 0 else ROW


def local_part(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


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


def tp_group(model: nn.Module):
    """The process group of this rank's TP peers (the ranks that read the same batch), or None without TP
    (collective: every rank calls it)."""
    from torch.distributed.device_mesh import init_device_mesh

    replicas, fsdp, tp = mesh_sizes(model)
    if tp == 1:
        return None
    return init_device_mesh(_device_type(), (replicas * fsdp, tp), mesh_dim_names=("dp", "tp"))["tp"].get_group()


def average_over_data_parallel(shared: list, expert_parallel: list, group) -> None:
    """Average the adapter's local gradients (`shared`: the trained parameters with a gradient) over the data-parallel
    ranks, in one flattened all-reduce: what DDP does for a replicated model (FSDP2, applied by transformers at load,
    manages only the frozen base). An expert-parallel factor lives on one rank and its gradient already sums the
    tokens of every data-parallel rank (the base's token dispatch brought them): it is divided by their number
    instead, with no collective."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if group is None:
        return
    for p in expert_parallel:
        local_part(p.grad).div_(dist.get_world_size(group))
    grads = [p.grad for p in shared]
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
