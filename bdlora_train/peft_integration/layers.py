"""The toolkit's BD-LoRA layer: PEFT's modules and saved format, a faster exact forward and backward.

PEFT's native path (`BdLoraLinearVariant`) computes `result += lora_B(lora_A(x)) * scaling` with an einsum over
reshaped activations: the adapter output is materialised, scaled, and added, and autograd then walks the same
(tokens x d_out) tensors again backward. Here one autograd Function accumulates `scaling * (x A^T) B^T` straight
into the base layer's output (`addmm_` / `baddbmm_` with alpha=scaling), computes the block-diagonal factor as one
batched GEMM over strided views of the packed weight (no permute copies of activations), and its backward reads
the output gradient once per GEMM it really needs. It saves the input and the rank-r intermediate, nothing else.

The modules are PEFT's own (`lora_A` / `lora_B`, `BlockDiagonalLinear` with its packed weight), so state dicts
and `save_pretrained` output are byte-for-byte PEFT's format, and stock PEFT loads them.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from peft.tuners.lora.variants import BdLoraLinearVariant, BlockDiagonalLinear

from bdlora_train.arch.targets import DENSE
from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.core.roles import BD_A, BD_B, PLAIN
from bdlora_train.peft_integration.masked import apply_masks, bd_a_bound, masked_factors, uniform_

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


def _project_in(x: torch.Tensor, weight_a: torch.Tensor, nblocks: int, role: str) -> torch.Tensor:
    """h = x A^T, (T, r): a transposed view of (A x^T), (r, T)."""
    if role != BD_A:
        return torch.mm(weight_a, x.t()).t()
    a = weight_a.view(nblocks, weight_a.shape[0] // nblocks, -1)  # (N, k, m)
    return _unblock_rank(torch.bmm(a, _blocks(x, nblocks).transpose(1, 2)))  # (N, k, m) @ (N, m, T)


def _accumulate_out_(
    out: torch.Tensor, h: torch.Tensor, weight_b: torch.Tensor, scaling: float, nblocks: int, role: str, beta: int = 1
):
    """out = beta * out + scaling * h B^T, in place (beta=0: out's contents are ignored, so it may be uninitialised)."""
    if role != BD_B:
        out.addmm_(h, weight_b.t(), beta=beta, alpha=scaling)
        return
    b = weight_b.view(nblocks, weight_b.shape[0] // nblocks, -1).transpose(1, 2)  # (N, k, n)
    _blocks(out, nblocks).baddbmm_(_blocks(h, nblocks), b, beta=beta, alpha=scaling)  # (N, T, k) @ (N, k, n)


def _delta(x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, nblocks: int, role: str) -> torch.Tensor:
    """h B^T as a new (T, d_out) tensor, differentiable by autograd (the torch.compile path)."""
    h = _project_in(x, weight_a, nblocks, role)
    if role != BD_B:
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


def _forward_into(result, x, weight_a, weight_b, scaling, nblocks, role, dtype):
    """Add the adapter into `result` in place; returns h. Operands are cast to `dtype` (a no-op in fp32)."""
    d_in, d_out = x.shape[-1], result.shape[-1]
    x2 = _cast(x.reshape(-1, d_in), dtype)
    h = _project_in(x2, _cast(weight_a, dtype), nblocks, role)
    out = result.view(-1, d_out)
    if out.dtype == dtype:
        _accumulate_out_(out, h, _cast(weight_b, dtype), scaling, nblocks, role)
    else:  # e.g. a bf16 base with fp32 adapter weights and no autocast: PEFT computes in fp32, so do we
        delta = torch.empty(out.shape, dtype=dtype, device=out.device)
        _accumulate_out_(delta, h, _cast(weight_b, dtype), scaling, nblocks, role, beta=0)
        out.add_(delta)
    return h


class _BlockDiagLoraAdd(torch.autograd.Function):
    """result += scaling * (x A^T) B^T in place, with a hand-written backward (autograd's would keep more)."""

    @staticmethod
    def forward(ctx, result, x, weight_a, weight_b, scaling, nblocks, role, dtype):
        h = _forward_into(result, x, weight_a, weight_b, scaling, nblocks, role, dtype)
        ctx.mark_dirty(result)
        ctx.save_for_backward(x, h, weight_a, weight_b)
        ctx.scaling, ctx.nblocks, ctx.role = scaling, nblocks, role
        return result

    @staticmethod
    def backward(ctx, grad_out):
        x, h, weight_a, weight_b = ctx.saved_tensors
        grads = adapter_grads(
            grad_out, x, h, weight_a, weight_b, ctx.scaling, ctx.nblocks, ctx.role, *ctx.needs_input_grad[1:4]
        )
        return (grad_out, *grads, None, None, None, None)


def adapter_grads(
    grad_out, x, h, weight_a, weight_b, scaling, nblocks, role, need_x, need_a, need_b, base_weight=None,
    keep=None, p=0.0,
) -> tuple:
    """(grad_x, grad_a, grad_b) of `scaling * (x A^T) B^T` (h = x A^T, as `linear_with_adapter` saved it); with
    `base_weight`, grad_x also holds the frozen base layer's input gradient g W, accumulated in place onto the
    adapter's part (no second (T, d_in) tensor, no add, and the big GEMM's beta=1 read of grad_x costs next to nothing
    under its arithmetic). With `keep`, the adapter read dropout(x) = x * keep / (1 - p): the 1 / (1 - p) goes into the
    (T, r) gradient of h, so the (T, d_in) side costs one pass for x * keep and one in-place pass for the mask on the
    adapter's input gradient, before g W is accumulated onto it."""
    dtype = h.dtype
    g = _cast(grad_out.reshape(-1, grad_out.shape[-1]), dtype).contiguous()
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
        grad_h.mul_(_keep_scale(p, grad_h))

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
    """

    @staticmethod
    def forward(ctx, x, dropout, drop_dtype, weight, bias, weight_a, weight_b, scaling, nblocks, role):
        adapter = weight_a, weight_b, scaling, nblocks, role
        result, h, mask = linear_with_adapter(x, dropout, drop_dtype, weight, bias, *adapter)
        ctx.save_for_backward(x, h, mask, weight, weight_a, weight_b)
        ctx.node = OneNode(scaling, nblocks, role, x, dropout, drop_dtype, result)
        return result

    @staticmethod
    def backward(ctx, grad_out):
        x, h, mask, weight, weight_a, weight_b = ctx.saved_tensors
        need = ctx.needs_input_grad
        factors = weight, weight_a, weight_b
        grad_x, grad_a, grad_b = ctx.node.grads(grad_out, x, h, mask, *factors, need[0], need[5], need[6])
        return grad_x, None, None, None, None, grad_a, grad_b, None, None, None


# Devices where torch's dropout is its fused kernel, `native_dropout` (the devices of `is_fused_kernel_acceptable` in
# aten/src/ATen/native/Dropout.cpp); elsewhere it draws a Bernoulli noise tensor and multiplies (`_dropout_impl`).
_FUSED_DROPOUT_DEVICES = ("cuda", "xpu", "lazy", "privateuseone")


def draw_dropout(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(nn.Dropout(p)(x) in training, its keep mask): the same random draw and the same values as torch's own dropout
    on x's device (the same calls, so the same masks as PEFT's path under one seed), 0 < p < 1. The mask is what
    torch's dropout keeps: bool where its kernel is fused; elsewhere 0 / 1 in x's dtype (CPU kernels cast a bool
    operand to a float copy before multiplying, which costs more than the mask saves)."""
    if x.device.type in _FUSED_DROPOUT_DEVICES:
        return torch.native_dropout(x, p, True)
    # _dropout_impl: noise = empty_like(x).bernoulli_(1 - p).div_(1 - p), then x * noise; the same draw without the
    # div_, and x * keep * (1 / (1 - p)) rounds as x * noise does, since x * 1 is exact
    keep = torch.empty_like(x).bernoulli_(1 - p)
    return apply_dropout_mask(x, keep, p), keep


def apply_dropout_mask(t: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """t times the noise `draw_dropout` drew (mask / (1 - p)), as torch's dropout backward computes it: the dropped-out
    input again from x, or an output gradient back through the dropout."""
    if t.device.type in _FUSED_DROPOUT_DEVICES:
        return torch.ops.aten.native_dropout_backward(t, mask, 1 / (1 - p))
    return torch.mul(t, mask).mul_(_keep_scale(p, t))


def _keep_scale(p: float, like: torch.Tensor) -> torch.Tensor:
    """1 / (1 - p) as a 0-dim tensor in `like`'s dtype, rounded as `_dropout_impl` rounds its noise (a div_ in the
    tensor's dtype), so that x * keep * scale equals torch's x * noise."""
    return torch.ones((), dtype=like.dtype, device=like.device).div_(1 - p)


def linear_with_adapter(x, dropout, drop_dtype, weight, bias, weight_a, weight_b, scaling, nblocks, role) -> tuple:
    """(x W^T + bias + scaling * (drop(x) A^T) B^T, h = drop(x) A^T, the dropout's keep mask or None) with no autograd:
    the forward of a frozen base layer and its adapter as one node (`_BlockDiagLoraLinearFn`; its sharded twin is in
    tp_runtime/node.py);
    `OneNode.grads` is its backward. `dropout`: p (0.0: none), drawn on x cast to `drop_dtype` (PEFT casts the input
    to the adapter's dtype first). The base layer computes as its own forward would (under autocast, in the autocast
    dtype), the adapter in `bdlora_add_`'s dtype."""
    dtype = _compute_dtype(x, weight_a)
    x_adapter, mask = x, None
    if dropout:
        x_adapter, mask = draw_dropout(_cast(x, drop_dtype), dropout)
        if mask.is_floating_point() and mask.element_size() > dtype.itemsize:
            mask = _cast(mask, dtype)  # 0 and 1 are exact in every float dtype: keep the narrower (bf16 under autocast)
    if _compute_dtype(x, weight) != dtype:  # e.g. a bf16 base with fp32 adapter weights and no autocast
        result = torch.nn.functional.linear(x, weight, bias)
        h = _forward_into(result, _cast(x_adapter, dtype), weight_a, weight_b, scaling, nblocks, role, dtype)
        return result, h, mask
    # The adapter's product is written first and the base GEMM accumulates onto it (beta=1): a GEMM reads its output
    # tile by tile under its own arithmetic, where a rank-r accumulate afterwards is one more memory-bound pass over
    # the (T, d_out) output. The same order backward, for g W onto the adapter's input gradient.
    x2 = _cast(x.reshape(-1, x.shape[-1]), dtype)  # what the base layer's F.linear computes on (autocast casts it)
    x_adapter = x2 if mask is None else _cast(x_adapter, dtype).view(x2.shape)
    h = _project_in(x_adapter, _cast(weight_a, dtype), nblocks, role)
    result = x2.new_empty(*x.shape[:-1], weight.shape[0])  # returned as is: a view would be no output of a node
    out = result.view(x2.shape[0], weight.shape[0])
    _accumulate_out_(out, h, _cast(weight_b, dtype), scaling, nblocks, role, beta=0)
    out.addmm_(x2, _cast(weight, dtype).t())
    if bias is not None:
        out.add_(_cast(bias, dtype))
    return result, h, mask


class OneNode:
    """What the backward of `linear_with_adapter` needs besides its saved tensors: the adapter's scaling, nblocks and
    role, its dropout and the dtype it was drawn in, x's shape and dtype and the base layer's compute dtype."""

    def __init__(self, scaling, nblocks, role, x, dropout, drop_dtype, result):
        self.scaling, self.nblocks, self.role = scaling, nblocks, role
        self.dropout, self.drop_dtype = dropout, drop_dtype
        self.x_shape, self.x_dtype, self.base_dtype = x.shape, x.dtype, result.dtype

    def grads(self, grad_out, x, h, mask, weight, weight_a, weight_b, need_x, need_a, need_b) -> tuple:
        """(grad_x, grad_a, grad_b). One input gradient, the adapter's part accumulated into the base layer's g W in
        place, when the adapter read x itself in the base's compute dtype. Else the two apart and added in x's dtype,
        as autograd adds them for two nodes: with dropout, the adapter's part goes back through the mask first (in
        the dtype the mask was drawn in); with the adapter in another dtype (a bf16 base, fp32 adapter weights, no
        autocast), it is cast to x's."""
        factors = (weight_a, weight_b, self.scaling, self.nblocks, self.role)
        if self.base_dtype == h.dtype and (not self.dropout or self.drop_dtype == h.dtype):
            base_weight = _cast(weight, self.base_dtype) if need_x else None
            keep = mask if self.dropout else None
            return adapter_grads(grad_out, x, h, *factors, need_x, need_a, need_b, base_weight, keep, self.dropout)
        x_adapter = x
        if self.dropout:  # the dropped-out input again, as the forward computed it
            x_adapter = _cast(apply_dropout_mask(_cast(x, self.drop_dtype), mask, self.dropout), h.dtype)
        grad_adapter, grad_a, grad_b = adapter_grads(grad_out, x_adapter, h, *factors, need_x, need_a, need_b)
        if not need_x:
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


def drops(module: PeftLoraLinear, adapter: str) -> bool:
    """Whether the adapter's dropout changes its input now (training, p > 0; not PEFT's Identity)."""
    dropout = module.lora_dropout[adapter]
    return isinstance(dropout, torch.nn.Dropout) and dropout.training and dropout.p > 0


def node_dropout(module: PeftLoraLinear, adapter: str) -> float | None:
    """The p the one-node layers draw themselves (`draw_dropout`): 0.0 when the dropout changes nothing, p for torch's
    own nn.Dropout with 0 < p < 1; None for anything else (a subclass, p = 1), which keeps the module's own forward."""
    if not drops(module, adapter):
        return 0.0
    dropout = module.lora_dropout[adapter]
    return float(dropout.p) if type(dropout) is torch.nn.Dropout and dropout.p < 1 else None


def bdlora_add_(
    result: torch.Tensor,
    x: torch.Tensor,
    weight_a: torch.Tensor,
    weight_b: torch.Tensor,
    scaling: float,
    nblocks: int,
    role: str,
) -> torch.Tensor:
    """`result += scaling * x A^T B^T` in place, with A or B block-diagonal as PEFT packs them; returns `result`.

    weight_a / weight_b are `lora_A.weight` / `lora_B.weight` exactly as PEFT stores them (packed for the
    block-diagonal factor); role is "bd_a", "bd_b" or "plain" (neither: a plain LoRA or a masked factor).
    """
    dtype = _compute_dtype(x, weight_a)
    if torch.compiler.is_compiling() or not result.is_contiguous():
        # The out-of-place form. Under torch.compile, inductor fuses the scale-and-add itself, and AOT
        # functionalization cannot replay in-place writes through transposed block views. A non-contiguous
        # base output (unusual) cannot be written through views either.
        delta = _delta(
            _cast(x.reshape(-1, x.shape[-1]), dtype), _cast(weight_a, dtype), _cast(weight_b, dtype), nblocks, role
        )
        return result + (delta * scaling).view(result.shape).to(result.dtype)
    if torch.is_grad_enabled() and (x.requires_grad or weight_a.requires_grad or weight_b.requires_grad):
        return _BlockDiagLoraAdd.apply(result, x, weight_a, weight_b, scaling, nblocks, role, dtype)
    with torch.no_grad():  # inference: same kernels, nothing saved
        _forward_into(result, x, weight_a, weight_b, scaling, nblocks, role, dtype)
    return result


def adapter_role(module: PeftLoraLinear, adapter_name: str) -> tuple[str, int]:
    """(role, nblocks) of one adapter in a LoRA layer, read from which factor PEFT made block-diagonal."""
    return _role(module.lora_A[adapter_name], module.lora_B[adapter_name])


def _role(lora_a: torch.nn.Module, lora_b: torch.nn.Module) -> tuple[str, int]:
    if isinstance(lora_a, BlockDiagonalLinear):
        return BD_A, lora_a.nblocks
    if isinstance(lora_b, BlockDiagonalLinear):
        return BD_B, lora_b.nblocks
    return PLAIN, 1


def check_prepared(config, target: str) -> None:
    """A BlockDiagLoraConfig must have resolved its roles (prepare_bdlora_config) before any layer is built."""
    resolved = getattr(config, "resolved_roles", None)
    if resolved is not None and not resolved:  # a BlockDiagLoraConfig that never saw the model
        raise BlockDiagLoraConfigError(
            f"layers: {target}: BlockDiagLoraConfig has no roles yet; use "
            "bdlora_train.get_peft_model(model, config), "
            "or call bdlora_train.prepare_bdlora_config(model, config) before PEFT's get_peft_model / add_adapter"
        )


def finish_init(module: PeftLoraLinear, adapter_name: str, config, target: str) -> None:
    """After the block-diagonal factor is built: the role PEFT's substring patterns gave must be the one resolved from
    the TP plan; then the optional `bd_a_init="lora"` redraw."""
    # A target stored densely (segment-aware blocks, adapters with experts) is plain LoRA to PEFT, masked here.
    resolved_target = (getattr(config, "resolved", None) or {}).get(target)
    expected = (getattr(config, "resolved_roles", None) or {}).get(target)
    if resolved_target is not None and resolved_target.storage == DENSE:
        expected = PLAIN
    role, _ = adapter_role(module, adapter_name)
    if expected is not None and expected != role:
        raise BlockDiagLoraConfigError(
            f"layers: {target} resolved to role {expected} but PEFT's use_bdlora patterns "
            f"give {role}; set BlockDiagLoraConfig(roles={{...}}) explicitly for this module"
        )
    if role == BD_A and hasattr(config, "lora_a_init_"):
        config.lora_a_init_(module.lora_A[adapter_name].weight, module.in_features)
    if expected == PLAIN:
        apply_masks(module, adapter_name, resolved_target, config)


class FastBlockDiagLoraVariant(BdLoraLinearVariant):
    """PEFT's BD-LoRA variant with the fused in-place forward; init, merge and unmerge are PEFT's (BD-aware)."""

    @staticmethod
    def init(module: PeftLoraLinear, adapter_name: str, config, **kwargs) -> None:
        target = kwargs.get("target_name", "")
        check_prepared(config, target)
        weight = module.get_base_layer().weight
        if weight.dtype == torch.float32:
            BdLoraLinearVariant.init(module, adapter_name, config, **kwargs)
        else:
            # PEFT draws a block-diagonal A in the base layer's dtype (`BlockDiagonalLinear`); redrawn in float32
            # (masked.uniform_, at PEFT's scale: masked.bd_a_bound) on the stream PEFT's draw would have taken in
            # float32, PEFT's own draw made on a forked stream
            kind = weight.device.type
            forked = [] if kind in ("cpu", "meta") else [weight.device]
            with torch.random.fork_rng(devices=forked, device_type="cuda" if not forked else kind):
                BdLoraLinearVariant.init(module, adapter_name, config, **kwargs)
            role, nblocks = adapter_role(module, adapter_name)
            if role == BD_A:  # bd_a_init="lora" redraws it after (finish_init), as in float32
                uniform_(module.lora_A[adapter_name].weight, bd_a_bound(config, module.in_features, nblocks))
        finish_init(module, adapter_name, config, target)

    @staticmethod
    def forward(
        module: PeftLoraLinear, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs
    ) -> torch.Tensor:
        if drops(module, active_adapter):
            x = module.lora_dropout[active_adapter](x)
        role, nblocks, weight_a, weight_b = _factors(module, active_adapter)
        return bdlora_add_(result, x, weight_a, weight_b, module.scaling[active_adapter], nblocks, role)


def _factors(module: PeftLoraLinear, adapter: str):
    """(role, nblocks, weight_a, weight_b) as the fused kernels take them."""
    lora_a, lora_b = module.lora_A[adapter], module.lora_B[adapter]
    role, nblocks = _role(lora_a, lora_b)
    if role == PLAIN:  # a densely stored block-diagonal factor: its masks (none for plain LoRA)
        return role, nblocks, *masked_factors(module, adapter)
    return role, nblocks, lora_a.weight, lora_b.weight


def _plain_tensor(t) -> bool:
    return t is None or (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) and type(t.data) is torch.Tensor


def _one_node(module: PeftLoraLinear, x, args, kwargs) -> tuple | None:
    """`linear_with_adapter`'s arguments when the base layer and its one active adapter can run as one node (with
    gradients, `_BlockDiagLoraLinearFn`), else None.

    The common training and inference case: one BD-LoRA adapter, unmerged, on a plain `nn.Linear` (no hooks, no
    quantized or distributed tensors), frozen when gradients are wanted, dtypes `one_node_dtypes` takes (autocast and
    fp32 adapter weights on a bf16 base included), eager; dropout or not. Anything else takes PEFT's `Linear.forward`
    and the variant, unchanged. The arguments are gathered in the pass that checks them, so the base layer, its
    parameters and the dropout are looked up once: on decode-sized inputs this dispatch is a fifth of the layer's
    time (`nn.Module.__getattr__` costs about a microsecond a lookup on CPU)."""
    if args or kwargs or module.disable_adapters or module.merged or torch.compiler.is_compiling():
        return None
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) != 1 or not isinstance(module.lora_variant.get(active[0]), FastBlockDiagLoraVariant):
        return None
    adapter = active[0]
    base = module.base_layer
    if type(base) is not torch.nn.Linear or base._forward_hooks or base._forward_pre_hooks:
        return None
    weight, bias = base.weight, base.bias
    if torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad)):
        return None  # the node computes no gradient for the base layer
    if not (_plain_tensor(x) and _plain_tensor(weight) and _plain_tensor(bias)):
        return None
    dropout = node_dropout(module, adapter)
    stored = module.lora_A[adapter].weight, module.lora_B[adapter].weight  # as stored (before any masks)
    if dropout is None or not one_node_dtypes(x, weight, bias, *stored):
        return None
    role, nblocks, weight_a, weight_b = _factors(module, adapter)
    # as PEFT's Linear.forward: the input cast to the adapter's dtype, then dropout (the same mask)
    drop_dtype = weight_a.dtype if module.cast_input_dtype_enabled else x.dtype
    return x, dropout, drop_dtype, weight, bias, weight_a, weight_b, module.scaling[adapter], nblocks, role


class BlockDiagLoraLinear(PeftLoraLinear):
    """`peft.tuners.lora.Linear` whose BD-LoRA adapters take the fused path. Plain LoRA adapters stay PEFT's."""

    @property
    def lora_variants(self):
        return {**super().lora_variants, ("use_bdlora",): FastBlockDiagLoraVariant}

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """PEFT's, except that a dense base layer and its one BD-LoRA adapter run as one node: an autograd node in
        training; under no_grad (evaluation, generation) the same forward, so eval and training outputs are equal to
        the last bit."""
        node = _one_node(self, x, args, kwargs)
        if node is None:
            return super().forward(x, *args, **kwargs)
        if not torch.is_grad_enabled():
            return linear_with_adapter(*node)[0]
        return _BlockDiagLoraLinearFn.apply(*node)

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """BD-aware (PEFT's `Linear.get_delta_weight` multiplies the packed weights): scaling * B_dense @ A_dense."""
        if isinstance(self.lora_variant.get(adapter), BdLoraLinearVariant):
            weight = self.lora_B[adapter].weight
            delta = BdLoraLinearVariant._get_bdlora_delta_weight(self, adapter)
            return delta.to(weight.dtype)
        return super().get_delta_weight(adapter)

    def __repr__(self) -> str:
        return "bdlora." + super().__repr__()[len("lora.") :]


def block_diagonal_factors(model) -> list:
    """The trainable weight of every block-diagonal factor in `model`: PEFT's packed `BlockDiagonalLinear` weights and
    the densely stored, masked factors (segment-aware fused layers, expert parameters), nothing else."""
    found = {}
    for module in model.modules():
        if isinstance(module, BlockDiagonalLinear):
            found[id(module.weight)] = module.weight
        for buffer_name, _ in module.named_buffers(recurse=False):
            for label, factors in (("bdmask_A_", "lora_A"), ("bdmask_B_", "lora_B")):
                if buffer_name.startswith(label):
                    weight = getattr(module, factors)[buffer_name.removeprefix(label)].weight
                    found[id(weight)] = weight
    return [weight for weight in found.values() if weight.requires_grad]
