"""The sharded one-node layer: this rank's shard of a frozen Linear and its adapter's local factors as one autograd
node (`_ShardedLinearFn`, the TP twin of kernels/bdlora.py's `_BlockDiagLoraLinearFn`)."""

from __future__ import annotations

import torch

from bdlora_train.core.layout import ROW
from bdlora_train.core.roles import PLAIN, is_block_diagonal
from bdlora_train.kernels.bdlora import AdapterFactors, NodeInputs, OneNode, linear_with_adapter, one_node_dtypes
from bdlora_train.peft_integration.layers import node_dropout
from bdlora_train.tp_runtime.mesh import local_part
from bdlora_train.tp_runtime.styles import AdapterShard


class _ShardedLinearFn(torch.autograd.Function):
    """This rank's shard of a frozen Linear and its adapter's local factors as one autograd node (the TP twin of
    kernels/bdlora.py's `_BlockDiagLoraLinearFn`, same forward and backward, dropout and autocast included).

    The factors come in as the DTensor parameters themselves: the forward reads their local shards (autograd runs it
    with grad mode off, where `to_local` is the shard itself) and the backward hands their gradients back as DTensors
    of the parameters' own mesh and placements. Reading them with `to_local` in the forward instead costs two autograd
    nodes per layer, and each one's backward re-derives the gradient's global layout and wraps it through
    `DTensor.from_local`: on CPU that per-parameter Python outweighed a 16-token step's adapter FLOPs."""

    @staticmethod
    def forward(ctx, x, dropout, weight, bias, weight_a, weight_b, scaling, nblocks, role):
        a, b = weight_a.to_local(), weight_b.to_local()
        node = NodeInputs(x, weight, bias, AdapterFactors(a, b, scaling, nblocks, role), dropout, x.dtype)
        result, h, mask = linear_with_adapter(node)
        ctx.save_for_backward(x, h, mask, weight, a, b)
        ctx.node = OneNode(node, result)
        ctx.specs = weight_a._spec, weight_b._spec  # mesh, placements and global shape / stride of each
        return result

    @staticmethod
    def backward(ctx, grad_out):
        from torch.distributed.tensor import DTensor

        need = ctx.needs_input_grad
        grad_x, *grads = ctx.node.grads(grad_out, ctx.saved_tensors, (need[0], need[4], need[5]))
        # The parameter's own spec, not `DTensor.from_local`, which re-derives it (59 us a gradient on CPU against
        # 4 us, scripts/bench_dtensor_grad_wrap.py; 56 a step on the bench model): the gradient has the parameter's
        # shape, stride and dtype.
        grad_a, grad_b = (
            None if grad is None else DTensor(grad.contiguous(), spec, requires_grad=False)
            for grad, spec in zip(grads, ctx.specs)
        )
        return grad_x, None, None, None, grad_a, grad_b, None, None, None


def frozen_local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A base weight's local shard: with no autograd node when it is frozen (nothing flows back into it), through
    `to_local`'s when it trains (e.g. PEFT's `bias="all"`)."""
    if t is None:
        return None
    if t.requires_grad:
        return local_part(t)
    with torch.no_grad():
        return local_part(t)


def one_node_adapter(layer, shard: AdapterShard, active: list[str], x, weight, bias) -> str | None:
    """The adapter `_ShardedLinearFn` computes with the base layer, else None (the two-node path): one PEFT-native
    adapter on a frozen base, in dtypes `one_node_dtypes` takes (autocast and fp32 adapter weights on a bf16 base
    included), dropout or not; on a row-parallel layer only a block-diagonal one (plain LoRA's B follows the
    all-reduce)."""
    if len(active) != 1 or shard.dense or (shard.style == ROW and not is_block_diagonal(shard.role)):
        return None
    adapter = active[0]
    base = layer.get_base_layer()
    if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        return None
    weight_a, weight_b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    if node_dropout(layer, adapter) is None:
        return None
    return adapter if one_node_dtypes(x, weight, bias, weight_a, weight_b) else None


def sharded_linear(layer, adapter: str, shard: AdapterShard, x, weight, bias) -> torch.Tensor:
    role = shard.role if is_block_diagonal(shard.role) else PLAIN
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
