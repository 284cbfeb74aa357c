"""The LoRA delta of MoE expert weights (kernels/experts.py), in float64: PEFT's stacked factors read per expert
(rows e*r.. of lora_A, rank column k at k*E + e of lora_B), in the parameter's own layout."""

from __future__ import annotations

import pytest
import torch

from bdlora_train.kernels.experts import expert_delta, expert_delta_factors


def _stacked(experts, r, d_in, d_out, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(experts * r, d_in, generator=gen, dtype=torch.float64),
            torch.randn(d_out, r * experts, generator=gen, dtype=torch.float64))


def _by_hand(weight_a, weight_b, experts, scaling):
    """scaling * B_e A_e, expert by expert, from the indices PEFT's ParamWrapper documents."""
    r = weight_a.shape[0] // experts
    deltas = []
    for e in range(experts):
        a_e = weight_a[e * r:(e + 1) * r]  # (r, d_in)
        b_e = weight_b[:, [k * experts + e for k in range(r)]]  # (d_out, r)
        deltas.append(scaling * b_e @ a_e)
    return torch.stack(deltas)  # (E, d_out, d_in)


@pytest.mark.parametrize("transposed", [False, True])
def test_expert_delta_is_each_experts_b_times_a_in_the_parameters_layout(transposed):
    weight_a, weight_b = _stacked(experts=3, r=4, d_in=10, d_out=6)
    want = _by_hand(weight_a, weight_b, 3, 0.5)
    got = expert_delta(weight_a, weight_b, 3, 0.5, transposed)
    torch.testing.assert_close(got, want.transpose(1, 2) if transposed else want, rtol=0, atol=1e-12)
    lhs, rhs = expert_delta_factors(weight_a, weight_b, 3, transposed)
    torch.testing.assert_close(0.5 * torch.bmm(lhs, rhs), got, rtol=0, atol=1e-12)


def test_expert_delta_computes_in_the_dtype_asked():
    weight_a, weight_b = _stacked(experts=2, r=2, d_in=4, d_out=4, seed=1)
    got = expert_delta(weight_a.float(), weight_b.float(), 2, 2.0, False, torch.float64)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _by_hand(weight_a.float().double(), weight_b.float().double(), 2, 2.0))
