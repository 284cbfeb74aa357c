"""The LoRA delta of MoE expert weights, in one place: PEFT's `ParamWrapper` stacks one (A_e, B_e) pair per expert
into one lora_A (E*r, d_in), expert e's rows e*r..(e+1)*r, and one lora_B (d_out, r*E), expert e's rank column k at
k*E + e (peft/tuners/lora/layer.py, `ParamWrapper.get_delta_factors`); an expert parameter (E, d1, d2) adds
scaling * B_e A_e to each expert's (d_out, d_in) weight, or to its transpose when the module stores (E, d_in, d_out)
(`transposed`: core/layout.py `is_transposed`). PEFT's wrapper, the TP runtime's rank-local delta, the saved
adapter's merge and the S-LoRA model's replicated experts all compute it here. Plain torch."""

from __future__ import annotations

import torch


def expert_factors(weight_a: torch.Tensor, weight_b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's stacked factors -> per expert: A (E, r, d_in), B (E, d_out, r) (views, no copy)."""
    a = weight_a.reshape(experts, -1, weight_a.shape[-1])
    b = weight_b.reshape(weight_b.shape[0], -1, experts).permute(2, 0, 1)
    return a, b


def expert_delta_factors(
    weight_a: torch.Tensor, weight_b: torch.Tensor, experts: int, transposed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lhs, rhs) with lhs @ rhs = B_e A_e per expert in the parameter's own layout: (E, d_out, d_in) as B_e, A_e,
    or, `transposed`, (E, d_in, d_out) as A_e^T, B_e^T (PEFT's `get_delta_factors`)."""
    a, b = expert_factors(weight_a, weight_b, experts)
    return (a.transpose(-2, -1), b.transpose(-2, -1)) if transposed else (b, a)


def expert_delta(
    weight_a: torch.Tensor,
    weight_b: torch.Tensor,
    experts: int,
    scaling: float,
    transposed: bool,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """scaling * B_e A_e for every expert, in the parameter's own layout (`expert_delta_factors`), computed in `dtype`
    (default: the factors' own)."""
    lhs, rhs = expert_delta_factors(weight_a, weight_b, experts, transposed)
    if dtype is not None:
        lhs, rhs = lhs.to(dtype), rhs.to(dtype)
    return torch.bmm(lhs, rhs) * scaling
