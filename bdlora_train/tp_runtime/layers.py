"""The TP layer classes: a PEFT LoRA layer whose adapter `tp_runtime/dispatch.py` made rank-local gains one of these
classes (`become`), whose forward computes the base layer and the adapter from local shards inside the base's own
communication."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bdlora_train.core.errors import TPError
from bdlora_train.core.layout import COLUMN
from bdlora_train.core.roles import PLAIN, is_block_diagonal
from bdlora_train.kernels.bdlora import bdlora_add_
from bdlora_train.peft_integration.layers import drops
from bdlora_train.tp_runtime.mesh import local_part
from bdlora_train.tp_runtime.node import frozen_local, one_node_adapter, sharded_linear
from bdlora_train.tp_runtime.styles import AdapterShard


def is_dense(layer: nn.Module) -> bool:
    return any(buf.startswith("bdmask_") for buf, _ in layer.named_buffers(recurse=False))


def trained_adapters(layer) -> list[str]:
    """The adapters a TP forward adds (none while adapters are disabled); a merged adapter is refused."""
    if layer.merged:
        raise TPError("tp: a merged adapter cannot be trained under TP; unmerge it first")
    return [] if layer.disable_adapters else [a for a in layer.active_adapters if a in layer.lora_A]


def local_factors(layer, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A, B) of a dense-stored layer, masked (the off-block zeros stay zero)."""
    out = []
    for label, factors, piece in zip("AB", (layer.lora_A, layer.lora_B), layer.tp_shard.pieces):
        weight = local_part(factors[adapter].weight)
        weight = weight if piece is None else weight[0]  # a piece is held as a (1, a, b) DTensor shard
        mask = getattr(layer, f"bdmask_{label}_{adapter}", None)
        out.append(weight if mask is None else weight * mask.to(weight.dtype))
    return out[0], out[1]


class TPLoraLayer:
    """What a PEFT LoRA layer becomes once its adapter is rank-local (`become`): its TP class puts this mixin's
    subclass before the layer's own class, so its forward replaces PEFT's, and `tp_shard` says how it is sharded."""

    tp_shard: AdapterShard


_CLASSES: dict[tuple[type, type], type] = {}


def become(layer: nn.Module, kind: type[TPLoraLayer], shard: AdapterShard) -> AdapterShard:
    """Give `layer` the TP class `kind` (a subclass of its own class and of `kind`, made once per pair: the layer
    keeps its parameters, buffers and state-dict keys, as `torch.nn.utils.parametrize` does) and its shard."""
    own = type(layer)
    if isinstance(layer, TPLoraLayer):
        raise TPError(f"tp: {type(layer).__name__}: its adapter is rank-local already (shard_adapters ran twice)")
    cls = _CLASSES.get((kind, own))
    if cls is None:
        cls = _CLASSES[(kind, own)] = type(f"{kind.__name__}[{own.__name__}]", (kind, own), {"__module__": __name__})
    layer.__class__ = cls
    layer.tp_shard = shard
    return shard


class ShardedLora(TPLoraLayer):
    """A column- or row-parallel Linear and its adapter from this rank's shards (the package docstring's two
    formulas): the adapter's input gradient joins the base layer's, its row-parallel partial sum the base's own
    all-reduce."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The adapted layer's forward under TP (replaces PEFT's and the base layer's TP hook)."""
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        shard: AdapterShard = self.tp_shard
        base = self.get_base_layer()
        weight = frozen_local(base.weight)
        active = trained_adapters(self)
        if isinstance(x, DTensor):
            x = x.to_local()
        if shard.style == COLUMN:
            bias = frozen_local(base.bias)
            # the input gradient of the base *and* the adapter is one partial sum, all-reduced once (backward)
            x = DTensor.from_local(x, shard.mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
            out = self._local_output(shard, active, x, weight, bias)
            if shard.gather_output:  # the base layer's own all-gather
                out = DTensor.from_local(out, shard.mesh, [Shard(out.dim() - 1)], run_check=False)
                out = out.redistribute(placements=[Replicate()]).to_local()
            return out if shard.order is None else out.index_select(-1, shard.order.to(out.device))
        if shard.split_input:  # replicated input: keep this rank's slice (its gradient is all-gathered, as the base's)
            x = DTensor.from_local(x, shard.mesh, [Replicate()], run_check=False)
            x = x.redistribute(placements=[Shard(x.dim() - 1)]).to_local()
        # this rank's partial sum of the output, its block-diagonal adapters' part included; a plain LoRA's x_i A_i^T
        # is partial too, so its B follows the all-reduce (the collective BD-LoRA avoids)
        block_diagonal = is_block_diagonal(shard.role)
        out = self._local_output(shard, active if block_diagonal else [], x, weight, None)
        out = _all_reduce(out, shard.mesh)  # the base layer's own all-reduce
        if base.bias is not None:
            out = out + frozen_local(base.bias)
        for adapter in [] if block_diagonal else active:
            weight_a, weight_b = local_part(self.lora_A[adapter].weight), local_part(self.lora_B[adapter].weight)
            out = out + _plain_lora(self, adapter, x, weight_a, weight_b, lambda h: _all_reduce(h, shard.mesh))
        return out

    def _local_output(self, shard: AdapterShard, active: list[str], x, weight, bias) -> torch.Tensor:
        """This rank's output of the base shard and the adapters in `active`: one autograd node where
        `one_node_adapter` allows it, else the base's `F.linear` and each adapter added."""
        one_node = one_node_adapter(self, shard, active, x, weight, bias)
        if one_node is not None:
            return sharded_linear(self, one_node, shard, x, weight, bias)
        out = F.linear(x, weight, bias)
        for adapter in active:
            out = _add_adapter(self, adapter, shard, x, out)
        return out


class ReplicatedLora(TPLoraLayer):
    """A Linear the model's plan leaves whole on every rank, and its adapter, computed locally."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """A replicated layer's forward: the base layer and the whole adapter, locally."""
        from torch.distributed.tensor import DTensor

        active = trained_adapters(self)
        if isinstance(x, DTensor):
            x = x.to_local()
        out = self.get_base_layer()(x, *args, **kwargs)
        shard: AdapterShard = self.tp_shard
        for adapter in active:
            if shard.dense or not is_block_diagonal(shard.role):
                out = out + _plain_lora(self, adapter, x, *local_factors(self, adapter))
            else:
                weight_a, weight_b = local_part(self.lora_A[adapter].weight), local_part(self.lora_B[adapter].weight)
                out = bdlora_add_(
                    out,
                    _dropout(self, adapter, x),
                    weight_a,
                    weight_b,
                    self.scaling[adapter],
                    shard.nblocks,
                    shard.role,
                )
        return out


def _dropout(layer, adapter: str, x: torch.Tensor) -> torch.Tensor:
    return layer.lora_dropout[adapter](x) if drops(layer, adapter) else x


def _plain_lora(layer, adapter: str, x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor,
                between=None) -> torch.Tensor:
    """Plain LoRA's forward, s (dropout(x) A^T) B^T, with this rank's factors; `between` (row-parallel plain LoRA:
    the all-reduce of the partial x_i A_i^T) runs on the rank-r activations before B."""
    h = _dropout(layer, adapter, x) @ weight_a.t()
    return layer.scaling[adapter] * ((h if between is None else between(h)) @ weight_b.t())


def _all_reduce(partial: torch.Tensor, mesh) -> torch.Tensor:
    """The sum over the mesh of each rank's partial tensor (a row-parallel layer's output, the base's own
    all-reduce)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    summed = DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(placements=[Replicate()])
    return summed.to_local()


def _add_adapter(layer, adapter: str, shard: AdapterShard, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out += s (x A_local^T) B_local^T with this rank's factors: in place (the toolkit's fused kernel) for PEFT-native
    blocks, masked matmuls for dense-stored pieces."""
    if shard.dense:
        return out + _plain_lora(layer, adapter, x, *local_factors(layer, adapter))
    weight_a = local_part(layer.lora_A[adapter].weight)
    weight_b = local_part(layer.lora_B[adapter].weight)
    local_blocks = max(shard.nblocks // shard.world, 1)
    role = shard.role if is_block_diagonal(shard.role) else PLAIN
    return bdlora_add_(out, _dropout(layer, adapter, x), weight_a, weight_b, layer.scaling[adapter], local_blocks, role)
