"""Block-diagonal factors PEFT stores densely (segment-aware fused layers, expert parameters), kept block-diagonal
by masks: the factors are PEFT's plain `lora_A` / `lora_B`, the entries outside the blocks start at zero and, because
every forward uses the masked factor, never receive a gradient. Masks are non-persistent buffers named
`bdmask_{A|B}_{adapter}` on the LoRA layer; their shapes follow PEFT's tensors (peft_integration/storage.py,
`peft_masks`).
"""

from __future__ import annotations

import torch

from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.peft_integration.storage import peft_masks


def uniform_(weight: torch.Tensor, bound: float) -> None:
    """Redraw `weight` U(-bound, bound) in place, drawn in float32 and cast, as vanilla LoRA's A is (an nn.Linear
    built in float32, then moved to the base's dtype): a float64 or bf16 draw takes other numbers from the random
    stream, so the same seed would give another adapter (and every factor drawn after it) in each dtype."""
    with torch.no_grad():
        weight.copy_(torch.empty(weight.shape, dtype=torch.float32, device=weight.device).uniform_(-bound, bound))


def block_init_(weight: torch.Tensor, mask: torch.Tensor, bound: float) -> None:
    """Redraw the on-block entries U(-bound, bound) and zero the rest, in place."""
    uniform_(weight, bound)
    with torch.no_grad():
        weight.mul_(mask.to(weight.dtype))


def bd_a_bound(config, d_in: int, nblocks: int) -> float:
    """PEFT's init scale of a packed block-diagonal A (kaiming-uniform over fan_in d_in/N), or vanilla LoRA's
    with `bd_a_init="lora"`, for an A stored densely."""
    if getattr(config, "bd_a_init", "peft") == "lora":
        return d_in**-0.5
    return (6.0 * nblocks / d_in) ** 0.5


def apply_masks(module, adapter_name: str, target, config) -> None:
    """Register the target's block masks on a LoRA layer (non-persistent buffers) and zero the off-block entries."""
    mask_a, mask_b = peft_masks(target)
    weight_a = module.lora_A[adapter_name].weight
    weight_b = module.lora_B[adapter_name].weight
    for label, mask, weight in (("A", mask_a, weight_a), ("B", mask_b, weight_b)):
        if mask is None:
            continue
        if tuple(mask.shape) != tuple(weight.shape):
            raise BlockDiagLoraConfigError(
                f"layers: {target.name}: block mask {tuple(mask.shape)} does not fit lora_{label} {tuple(weight.shape)}"
            )
        mask = mask.to(weight.device)
        module.register_buffer(f"bdmask_{label}_{adapter_name}", mask, persistent=False)
        if label == "A" and config.init_lora_weights is not False:
            block_init_(weight, mask, bd_a_bound(config, target.layout.d_in, target.nblocks))
        else:
            with torch.no_grad():
                weight.mul_(mask.to(weight.dtype))


def masked_factors(module, adapter_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A.weight, lora_B.weight) with the block masks applied (differentiable: off-block gradients are 0)."""
    weight_a = module.lora_A[adapter_name].weight
    weight_b = module.lora_B[adapter_name].weight
    mask_a = getattr(module, f"bdmask_A_{adapter_name}", None)
    mask_b = getattr(module, f"bdmask_B_{adapter_name}", None)
    return (weight_a if mask_a is None else weight_a * mask_a), (weight_b if mask_b is None else weight_b * mask_b)
