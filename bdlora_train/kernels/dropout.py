"""Dropout drawn inside the one-node layer: the same random draw, mask and values as torch's own `nn.Dropout`, with
the keep mask handed back so the node's backward can reuse it (the kernel's copy of torch's dropout)."""

from __future__ import annotations

import torch

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
    return torch.mul(t, mask).mul_(keep_scale(p, t))


def keep_scale(p: float, like: torch.Tensor) -> torch.Tensor:
    """1 / (1 - p) as a 0-dim tensor in `like`'s dtype, rounded as `_dropout_impl` rounds its noise (a div_ in the
    tensor's dtype), so that x * keep * scale equals torch's x * noise."""
    return torch.ones((), dtype=like.dtype, device=like.device).div_(1 - p)
