"""kernels/: the BD-LoRA kernel's dropout draws torch's own mask, and its factors object costs nothing when it can."""

import torch

from bdlora_train.kernels.bdlora import AdapterFactors, NodeInputs, one_node
from bdlora_train.kernels.dropout import apply_dropout_mask, draw_dropout


def test_the_node_draws_torchs_own_dropout_mask_and_values():
    x = torch.randn(64, 32)
    torch.manual_seed(3)
    want = torch.nn.functional.dropout(x, 0.25, training=True)
    torch.manual_seed(3)
    got, keep = draw_dropout(x, 0.25)
    assert torch.equal(got, want) and torch.equal(apply_dropout_mask(x, keep, 0.25), want)


def test_factors_cast_to_their_own_dtype_are_themselves():
    factors = AdapterFactors(torch.randn(4, 8), torch.randn(6, 2), 0.5, 2, "bd_b")
    assert factors.cast(torch.float32) is factors
    half = factors.cast(torch.bfloat16)
    assert half.a.dtype == half.b.dtype == torch.bfloat16
    assert (half.scaling, half.nblocks, half.role) == (0.5, 2, "bd_b")


def test_one_node_without_gradients_is_the_base_layer_plus_the_adapter():
    x, weight = torch.randn(5, 8), torch.randn(6, 8)
    a, b = torch.randn(4, 8), torch.randn(6, 4)
    with torch.no_grad():
        out = one_node(NodeInputs(x, weight, None, AdapterFactors(a, b, 0.5, 1, "plain"), 0.0, x.dtype))
    torch.testing.assert_close(out, x @ weight.t() + 0.5 * (x @ a.t()) @ b.t())
