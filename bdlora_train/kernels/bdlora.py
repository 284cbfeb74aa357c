"""The BD-LoRA kernel: `scaling * (x A^T) B^T` with A or B block-diagonal as PEFT packs them, added in place into a
layer's output (`bdlora_add_`), or computed with a frozen dense base layer as one autograd node
(`linear_with_adapter`, `one_node`); plain torch, no PEFT (peft_integration/layers.py attaches it to PEFT's layers).

PEFT's native path (`BdLoraLinearVariant`) computes `result += lora_B(lora_A(x)) * scaling` with an einsum over
reshaped activations: the adapter output is materialised, scaled, and added, and autograd then walks the same
(tokens x d_out) tensors again backward. Here one autograd Function accumulates `scaling * (x A^T) B^T` straight
into the base layer's output (`addmm_` / `baddbmm_` with alpha=scaling), computes the block-diagonal factor as one
batched GEMM over strided views of the packed weight (no permute copies of activations), and its backward reads
the output gradient once per GEMM it really needs. It saves the input and the rank-r intermediate, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bdlora_train.core.roles import BD_A, BD_B, Role
from bdlora_train.kernels.dropout import apply_dropout_mask, draw_dropout, keep_scale


@dataclass(frozen=True, slots=True)
class AdapterFactors:
    """The factors of one adapter as the kernel takes them: `a` / `b` are `lora_A.weight` / `lora_B.weight` exactly as
    PEFT stores them (packed for the block-diagonal factor), `scaling` PEFT's alpha / r, `nblocks` the block count and
    `role` "bd_a", "bd_b" or "plain" (neither: a plain LoRA or a masked factor)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    nblocks: int
    role: Role

    def cast(self, dtype: torch.dtype) -> AdapterFactors:
        """The same factors with both weights in `dtype` (itself when they already are)."""
        if self.a.dtype == dtype and self.b.dtype == dtype:
            return self
        return AdapterFactors(_cast(self.a, dtype), _cast(self.b, dtype), self.scaling, self.nblocks, self.role)


@dataclass(frozen=True, slots=True)
class NodeInputs:
    """What a frozen dense base layer and its adapter compute from as one node (`linear_with_adapter`, `one_node`):
    the input, the base layer's weight and bias, the adapter's factors, its dropout p (0.0: none) and the dtype the
    dropout is drawn in (PEFT casts the input to the adapter's dtype first)."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    factors: AdapterFactors
    dropout: float
    drop_dtype: torch.dtype


# --------------------------------------------------------------------------------------------------------------
# The math. Shapes: x (T, d_in), result (T, d_out), h = x A^T (T, r); N blocks, k = r/N.
#   BD-B (column-parallel): A dense (r, d_in); B packed (d_out, k): block i = B[i*n:(i+1)*n], n = d_out/N.
#   BD-A (row-parallel):    A packed (r, m): block i = A[i*k:(i+1)*k], m = d_in/N; B dense (d_out, r).
# A "blocks view" reshapes (T, N*c) to (N, T, c) without copying; bmm/baddbmm take such strided batches directly.
# Every GEMM is oriented so its output's last dimension is a long one (T, n or m), never r or k: the rank-r
# intermediates h and grad_h are computed and kept as (r, T) tensors and handed on as their (T, r) transposed views,
# never copied. On CPU (MKL, one thread, T=2048, 1024 -> 512, r=11) the r-wide orientations cost 1.3-6x more:
# x A^T 4.0 ms against (A x^T)^T 3.0 ms, g B 3.6 ms against (B^T g^T)^T 0.8 ms, g^T h 5.8 ms against (h^T g)^T
# 0.9 ms (scripts/bench_rank_gemms.py, eval/bench/rank_gemms_cpu.txt; scripts/bench_adapters.py times the layer).


def _blocks(t: torch.Tensor, nblocks: int) -> torch.Tensor:
    """(T, N*c) -> (N, T, c), a strided view (no copy). Sizes spelled out: a -1 beside T = 0 has no one value."""
    return t.view(t.shape[0], nblocks, t.shape[1] // nblocks).transpose(0, 1)


def _unblock_rank(t: torch.Tensor) -> torch.Tensor:
    """(N, k, T) -> (T, N*k), the transposed view of the contiguous (N*k, T) tensor (no copy)."""
    return t.view(t.shape[0] * t.shape[1], t.shape[2]).t()


def _project_in(x: torch.Tensor, factors: AdapterFactors) -> torch.Tensor:
    """h = x A^T, (T, r): a transposed view of (A x^T), (r, T)."""
    weight_a, nblocks = factors.a, factors.nblocks
    if factors.role != BD_A:
        return torch.mm(weight_a, x.t()).t()
    a = weight_a.view(nblocks, weight_a.shape[0] // nblocks, -1)  # (N, k, m)
    return _unblock_rank(torch.bmm(a, _blocks(x, nblocks).transpose(1, 2)))  # (N, k, m) @ (N, m, T)


def _accumulate_out_(out: torch.Tensor, h: torch.Tensor, factors: AdapterFactors, beta: int = 1):
    """out = beta * out + scaling * h B^T, in place (beta=0: out's contents are ignored, so it may be uninitialised)."""
    weight_b, scaling, nblocks = factors.b, factors.scaling, factors.nblocks
    if factors.role != BD_B:
        out.addmm_(h, weight_b.t(), beta=beta, alpha=scaling)
        return
    b = weight_b.view(nblocks, weight_b.shape[0] // nblocks, -1).transpose(1, 2)  # (N, k, n)
    _blocks(out, nblocks).baddbmm_(_blocks(h, nblocks), b, beta=beta, alpha=scaling)  # (N, T, k) @ (N, k, n)


def _delta(x: torch.Tensor, factors: AdapterFactors) -> torch.Tensor:
    """h B^T as a new (T, d_out) tensor, differentiable by autograd (the torch.compile path)."""
    h = _project_in(x, factors)
    weight_b, nblocks = factors.b, factors.nblocks
    if factors.role != BD_B:
        return h @ weight_b.t()
    b = weight_b.view(nblocks, weight_b.shape[0] // nblocks, -1)  # (N, n, k)
    return torch.bmm(b, _blocks(h, nblocks).transpose(1, 2)).permute(2, 0, 1).reshape(h.shape[0], weight_b.shape[0])


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _compute_dtype(x: torch.Tensor, weight_a: torch.Tensor) -> torch.dtype:
    """What PEFT's path would compute in: the autocast dtype if autocast is on, else the adapter's dtype."""
    device_type = x.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight_a.dtype


def _forward_into(result, x, factors: AdapterFactors, dtype):
    """Add the adapter into `result` in place; returns h. Operands are cast to `dtype` (a no-op in fp32)."""
    d_in, d_out = x.shape[-1], result.shape[-1]
    x2 = _cast(x.reshape(-1, d_in), dtype)
    factors = factors.cast(dtype)
    h = _project_in(x2, factors)
    out = result.view(-1, d_out)
    if out.dtype == dtype:
        _accumulate_out_(out, h, factors)
    else:  # e.g. a bf16 base with fp32 adapter weights and no autocast: PEFT computes in fp32, so do we
        delta = torch.empty(out.shape, dtype=dtype, device=out.device)
        _accumulate_out_(delta, h, factors, beta=0)
        out.add_(delta)
    return h


class _BlockDiagLoraAdd(torch.autograd.Function):
    """result += scaling * (x A^T) B^T in place, with a hand-written backward (autograd's would keep more). The
    factors come in twice: as tensors (autograd's inputs) and in `factors` (their scaling, nblocks and role)."""

    @staticmethod
    def forward(ctx, result, x, weight_a, weight_b, factors, dtype):
        h = _forward_into(result, x, factors, dtype)
        ctx.mark_dirty(result)
        ctx.save_for_backward(x, h, weight_a, weight_b)
        ctx.scaling, ctx.nblocks, ctx.role = factors.scaling, factors.nblocks, factors.role
        return result

    @staticmethod
    def backward(ctx, grad_out):
        x, h, weight_a, weight_b = ctx.saved_tensors
        factors = AdapterFactors(weight_a, weight_b, ctx.scaling, ctx.nblocks, ctx.role)
        grads = adapter_grads(grad_out, x, h, factors, ctx.needs_input_grad[1:4])
        return (grad_out, *grads, None, None)


def adapter_grads(
    grad_out, x, h, factors: AdapterFactors, need: tuple, *, base_weight=None, keep=None, p: float = 0.0
) -> tuple:
    """(grad_x, grad_a, grad_b) of `scaling * (x A^T) B^T` (h = x A^T, as `linear_with_adapter` saved it); `need`
    says which of the three to compute, (x, A, B). With `base_weight`, grad_x also holds the frozen base layer's input
    gradient g W, accumulated in place onto the adapter's part (no second (T, d_in) tensor, no add, and the big GEMM's
    beta=1 read of grad_x costs next to nothing under its arithmetic). With `keep`, the adapter read dropout(x) =
    x * keep / (1 - p): the 1 / (1 - p) goes into the (T, r) gradient of h, so the (T, d_in) side costs one pass for
    x * keep and one in-place pass for the mask on the adapter's input gradient, before g W is accumulated onto it."""
    need_x, need_a, need_b = need
    dtype = h.dtype
    g = _cast(grad_out.reshape(-1, grad_out.shape[-1]), dtype).contiguous()
    weight_a, weight_b, scaling, nblocks, role = factors.a, factors.b, factors.scaling, factors.nblocks, factors.role
    a, b = _cast(weight_a, dtype), _cast(weight_b, dtype)
    r = h.shape[1]
    grad_x = grad_a = grad_b = None

    # Output side: the two GEMMs that read the (T, d_out) gradient. Each takes the scaling as its alpha (beta=0, so
    # `unused`, a 0-dim tensor broadcast as the GEMM's input, is never read): one call where a GEMM and a mul_ were two.
    unused = g.new_empty(())
    if role == BD_B:
        g_blocks = _blocks(g, nblocks)  # (N, T, n)
        b_blocks = b.view(nblocks, b.shape[0] // nblocks, -1)  # (N, n, k)
        grad_h = torch.baddbmm(unused, b_blocks.transpose(1, 2), g_blocks.transpose(1, 2), beta=0, alpha=scaling)
        grad_h = _unblock_rank(grad_h)
        if need_b:  # only the diagonal blocks of g^T h, as (N, k, T) @ (N, T, n)
            grad_b = torch.baddbmm(unused, _blocks(h, nblocks).transpose(1, 2), g_blocks, beta=0, alpha=scaling)
            grad_b = grad_b.transpose(1, 2).reshape(b.shape)
    else:
        grad_h = torch.addmm(unused, b.t(), g.t(), beta=0, alpha=scaling).t()  # (B^T g^T)^T
        if need_b:
            grad_b = torch.addmm(unused, h.t(), g, beta=0, alpha=scaling).t()  # (h^T g)^T
    if keep is not None:  # dropout's 1 / (1 - p), for both of the input side's products
        grad_h.mul_(keep_scale(p, grad_h))

    # Input side: rank-r GEMMs against x and A.
    if need_a or need_x:
        x2 = _cast(x.reshape(-1, x.shape[-1]), dtype)
        if keep is not None and need_a:  # the dropped-out input that A read (grad_x needs only x's shape)
            x2 = x2 * keep.view(x2.shape)
    if role == BD_A:
        a_blocks = a.view(nblocks, r // nblocks, -1)  # (N, k, m)
        gh_blocks = _blocks(grad_h, nblocks)  # (N, T, k)
        if need_a:  # only the diagonal blocks of grad_h^T x, as (N, k, T) @ (N, T, m)
            grad_a = torch.bmm(gh_blocks.transpose(1, 2), _blocks(x2, nblocks)).view(a.shape)
        if need_x:  # written through the blocks view of the (T, d_in) gradient: no permute copy
            grad_x = x2.new_empty(x2.shape)
            _blocks(grad_x, nblocks).baddbmm_(gh_blocks, a_blocks, beta=0)
    else:
        if need_a:
            grad_a = torch.mm(grad_h.t(), x2)
        if need_x:
            grad_x = torch.mm(grad_h, a)
    if need_x and keep is not None:  # back through the dropout
        grad_x.mul_(keep.view(grad_x.shape))
    if need_x and base_weight is not None:  # g W last, onto the adapter's part (see linear_with_adapter's forward)
        grad_x.addmm_(g, base_weight)

    if grad_x is not None:
        grad_x = _cast(grad_x.view(x.shape), x.dtype)
    if grad_a is not None:
        grad_a = _cast(grad_a, weight_a.dtype)
    if grad_b is not None:
        grad_b = _cast(grad_b, weight_b.dtype)
    return grad_x, grad_a, grad_b


class _BlockDiagLoraLinearFn(torch.autograd.Function):
    """A frozen dense base layer and its adapter as one node: `x W^T + bias + scaling * (drop(x) A^T) B^T`.

    The forward writes the adapter's product first and the base GEMM accumulates onto it (beta=1), which costs it
    next to nothing, where accumulating the rank-r product after the base is one more pass over the output. As two
    autograd nodes, the base's g W and the adapter's input gradient are two (T, d_in) tensors that autograd then
    adds (a fresh allocation and a full read-read-write pass per layer, which the CPU profile shows costing about
    as much as one of the adapter's GEMMs); here g W accumulates onto the adapter's part in place (beta=1) whenever
    both read the same input in the same dtype. With dropout (`dropout` = p > 0) the node draws PEFT's mask itself
    (`draw_dropout`) and recomputes the dropped-out input from x for A's gradient. Saves x, h and that mask: as two
    nodes, the dropout kept its mask and the adapter a dropped-out copy of x, one per layer where q / k / v or
    gate / up read the same x.

    Its inputs are `node` and, for autograd, the tensors of it that it saves or differentiates: x, the base weight
    and the two factors (`one_node` passes them).
    """

    @staticmethod
    def forward(ctx, node, x, weight, weight_a, weight_b):
        result, h, mask = linear_with_adapter(node)
        ctx.save_for_backward(x, h, mask, weight, weight_a, weight_b)
        ctx.node = OneNode(node, result)
        return result

    @staticmethod
    def backward(ctx, grad_out):
        need = ctx.needs_input_grad
        grad_x, grad_a, grad_b = ctx.node.grads(grad_out, ctx.saved_tensors, (need[1], need[3], need[4]))
        return None, grad_x, None, grad_a, grad_b


def one_node(node: NodeInputs) -> torch.Tensor:
    """`x W^T + bias + scaling * (drop(x) A^T) B^T` of a frozen dense base layer and its adapter: one autograd node
    (`_BlockDiagLoraLinearFn`) with gradients, else the same forward without autograd (under no_grad: evaluation,
    generation), so eval and training outputs are equal to the last bit."""
    if not torch.is_grad_enabled():
        return linear_with_adapter(node)[0]
    return _BlockDiagLoraLinearFn.apply(node, node.x, node.weight, node.factors.a, node.factors.b)


def linear_with_adapter(node: NodeInputs) -> tuple:
    """(x W^T + bias + scaling * (drop(x) A^T) B^T, h = drop(x) A^T, the dropout's keep mask or None) with no autograd:
    the forward of a frozen base layer and its adapter as one node (`_BlockDiagLoraLinearFn`; its sharded twin is in
    tp_runtime/node.py);
    `OneNode.grads` is its backward. The dropout is drawn on x cast to `node.drop_dtype`. The base layer computes as
    its own forward would (under autocast, in the autocast dtype), the adapter in `bdlora_add_`'s dtype."""
    x, weight, bias, factors = node.x, node.weight, node.bias, node.factors
    dtype = _compute_dtype(x, factors.a)
    x_adapter, mask = x, None
    if node.dropout:
        x_adapter, mask = draw_dropout(_cast(x, node.drop_dtype), node.dropout)
        if mask.is_floating_point() and mask.element_size() > dtype.itemsize:
            mask = _cast(mask, dtype)  # 0 and 1 are exact in every float dtype: keep the narrower (bf16 under autocast)
    if _compute_dtype(x, weight) != dtype:  # e.g. a bf16 base with fp32 adapter weights and no autocast
        result = torch.nn.functional.linear(x, weight, bias)
        h = _forward_into(result, _cast(x_adapter, dtype), factors, dtype)
        return result, h, mask
    # The adapter's product is written first and the base GEMM accumulates onto it (beta=1): a GEMM reads its output
    # tile by tile under its own arithmetic, where a rank-r accumulate afterwards is one more memory-bound pass over
    # the (T, d_out) output. The same order backward, for g W onto the adapter's input gradient.
    x2 = _cast(x.reshape(-1, x.shape[-1]), dtype)  # what the base layer's F.linear computes on (autocast casts it)
    x_adapter = x2 if mask is None else _cast(x_adapter, dtype).view(x2.shape)
    factors = factors.cast(dtype)
    h = _project_in(x_adapter, factors)
    result = x2.new_empty(*x.shape[:-1], weight.shape[0])  # returned as is: a view would be no output of a node
    out = result.view(x2.shape[0], weight.shape[0])
    _accumulate_out_(out, h, factors, beta=0)
    out.addmm_(x2, _cast(weight, dtype).t())
    if bias is not None:
        out.add_(_cast(bias, dtype))
    return result, h, mask


class OneNode:
    """What the backward of `linear_with_adapter` needs besides its saved tensors: the adapter's scaling, nblocks and
    role, its dropout and the dtype it was drawn in, x's shape and dtype and the base layer's compute dtype."""

    def __init__(self, node: NodeInputs, result: torch.Tensor):
        factors = node.factors
        self.scaling, self.nblocks, self.role = factors.scaling, factors.nblocks, factors.role
        self.dropout, self.drop_dtype = node.dropout, node.drop_dtype
        self.x_shape, self.x_dtype, self.base_dtype = node.x.shape, node.x.dtype, result.dtype

    def grads(self, grad_out, saved: tuple, need: tuple) -> tuple:
        """(grad_x, grad_a, grad_b), those `need` asks for ((x, A, B)), from the node's saved tensors (x, h, mask,
        weight, weight_a, weight_b). One input gradient, the adapter's part accumulated into the base layer's g W in
        place, when the adapter read x itself in the base's compute dtype. Else the two apart and added in x's dtype,
        as autograd adds them for two nodes: with dropout, the adapter's part goes back through the mask first (in
        the dtype the mask was drawn in); with the adapter in another dtype (a bf16 base, fp32 adapter weights, no
        autocast), it is cast to x's."""
        x, h, mask, weight, weight_a, weight_b = saved
        factors = AdapterFactors(weight_a, weight_b, self.scaling, self.nblocks, self.role)
        if self.base_dtype == h.dtype and (not self.dropout or self.drop_dtype == h.dtype):
            base_weight = _cast(weight, self.base_dtype) if need[0] else None
            keep = mask if self.dropout else None
            return adapter_grads(grad_out, x, h, factors, need, base_weight=base_weight, keep=keep, p=self.dropout)
        x_adapter = x
        if self.dropout:  # the dropped-out input again, as the forward computed it
            x_adapter = _cast(apply_dropout_mask(_cast(x, self.drop_dtype), mask, self.dropout), h.dtype)
        grad_adapter, grad_a, grad_b = adapter_grads(grad_out, x_adapter, h, factors, need)
        if not need[0]:
            return None, grad_a, grad_b
        if self.dropout:  # back through the dropout, then the cast to the dtype it was drawn in
            grad_adapter = apply_dropout_mask(_cast(grad_adapter, self.drop_dtype), mask, self.dropout)
        # the base layer's g W, in its compute dtype (autocast's cast node hands it on in x's)
        g = _cast(grad_out.reshape(-1, grad_out.shape[-1]), self.base_dtype)
        grad_x = _cast(torch.mm(g, _cast(weight, self.base_dtype)).view(self.x_shape), self.x_dtype)
        return grad_x + _cast(grad_adapter.view(self.x_shape), self.x_dtype), grad_a, grad_b


def one_node_dtypes(x, weight, bias, weight_a, weight_b) -> bool:
    """Whether `linear_with_adapter` computes what the base layer and `bdlora_add_` would as two nodes: one device and
    the two factors in one dtype; under autocast any float dtypes (autocast casts them, as it does the base layer's
    own F.linear), else the base layer's operands in one dtype (F.linear's own rule)."""
    if weight.device != x.device or weight_a.dtype != weight_b.dtype:
        return False
    if torch.amp.is_autocast_available(x.device.type) and torch.is_autocast_enabled(x.device.type):
        return True
    return x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype)


def bdlora_add_(
    result: torch.Tensor,
    x: torch.Tensor,
    weight_a: torch.Tensor,
    weight_b: torch.Tensor,
    scaling: float,
    nblocks: int,
    role: Role,
) -> torch.Tensor:
    """`result += scaling * x A^T B^T` in place, with A or B block-diagonal as PEFT packs them; returns `result`.

    weight_a / weight_b are `lora_A.weight` / `lora_B.weight` exactly as PEFT stores them (packed for the
    block-diagonal factor); role is "bd_a", "bd_b" or "plain" (neither: a plain LoRA or a masked factor).
    """
    return add_adapter_(result, x, AdapterFactors(weight_a, weight_b, scaling, nblocks, role))


def add_adapter_(result: torch.Tensor, x: torch.Tensor, factors: AdapterFactors) -> torch.Tensor:
    """`bdlora_add_` for factors already gathered (the PEFT variant's forward)."""
    weight_a, weight_b = factors.a, factors.b
    dtype = _compute_dtype(x, weight_a)
    if torch.compiler.is_compiling() or not result.is_contiguous():
        # The out-of-place form. Under torch.compile, inductor fuses the scale-and-add itself, and AOT
        # functionalization cannot replay in-place writes through transposed block views. A non-contiguous
        # base output (unusual) cannot be written through views either.
        delta = _delta(_cast(x.reshape(-1, x.shape[-1]), dtype), factors.cast(dtype))
        return result + (delta * factors.scaling).view(result.shape).to(result.dtype)
    if torch.is_grad_enabled() and (x.requires_grad or weight_a.requires_grad or weight_b.requires_grad):
        return _BlockDiagLoraAdd.apply(result, x, weight_a, weight_b, factors, dtype)
    with torch.no_grad():  # inference: same kernels, nothing saved
        _forward_into(result, x, factors, dtype)
    return result
