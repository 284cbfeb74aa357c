"""peft_integration.masked (block masks on densely stored factors) and peft_integration.quant_layers (BD-LoRA layers
for quantized
bases), on CPU only: bitsandbytes 8-bit and torchao int8 weight-only both build and run there."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from bdlora_train import BlockDiagLoraConfig, get_peft_model
from bdlora_train.arch.targets import DENSE, Target
from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.core.layout import Layout
from bdlora_train.core.roles import BD_A, BD_B
from bdlora_train.models import build_tiny_model
from bdlora_train.peft_integration.masked import apply_masks, bd_a_bound, block_init_, masked_factors
from bdlora_train.peft_integration.quant_layers import (
    BlockDiagLoraTorchaoLinear,
    TorchaoLinear,
    custom_modules,
    dense_delta_weight,
)

pytestmark = pytest.mark.usefixtures("one_thread")
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


# ------------------------------------------------------------------------------------------------------ masked


def test_bd_a_bound():
    # PEFT's packed A: kaiming-uniform over fan_in d_in/N -> sqrt(6 N / d_in); 64 inputs, 2 blocks: sqrt(0.1875)
    assert bd_a_bound(SimpleNamespace(bd_a_init="peft"), 64, 2) == pytest.approx(0.4330127)
    assert bd_a_bound(SimpleNamespace(), 64, 2) == pytest.approx(0.4330127)  # "peft" is the default
    assert bd_a_bound(SimpleNamespace(bd_a_init="lora"), 64, 2) == pytest.approx(0.125)  # 1/sqrt(64)


def test_block_init_draws_on_block_entries_and_zeroes_the_rest():
    weight = torch.full((4, 6), 9.0)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[:2, :3] = mask[2:, 3:] = True
    block_init_(weight, mask, bound=0.5)
    assert torch.all(weight[~mask] == 0)
    assert torch.all(weight[mask].abs() <= 0.5) and torch.all(weight[mask] != 0)


class _Lora(nn.Module):
    """The two factor containers of a PEFT LoRA layer."""

    def __init__(self, d_in, d_out, r):
        super().__init__()
        self.lora_A = nn.ModuleDict({"default": nn.Linear(d_in, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, d_out, bias=False)})
        with torch.no_grad():
            self.lora_A["default"].weight.fill_(1.0)
            self.lora_B["default"].weight.fill_(1.0)


def _fused_b_target():
    # a fused column-parallel output [32 | 32], r=4, 2 blocks: rank 0 owns rows 0-15 and 32-47 with rank columns 0-1,
    # rank 1 rows 16-31 and 48-63 with columns 2-3
    layout = Layout("qkv", "colwise_gather_output", BD_B, (32, 32), d_in=16, d_out=64)
    return Target(layout, nblocks=2, r=4, storage=DENSE)


def _expected_b_mask():
    mask = torch.zeros(64, 4, dtype=torch.bool)
    for rows in (slice(0, 16), slice(32, 48)):
        mask[rows, 0:2] = True
    for rows in (slice(16, 32), slice(48, 64)):
        mask[rows, 2:4] = True
    return mask


def test_apply_masks_registers_the_block_mask_and_zeroes_off_block_entries():
    module = _Lora(16, 64, 4)
    apply_masks(module, "default", _fused_b_target(), SimpleNamespace(init_lora_weights=True))
    expected = _expected_b_mask()
    assert torch.equal(module.bdmask_B_default, expected)
    assert "bdmask_B_default" not in module.state_dict()  # non-persistent: never saved
    assert not hasattr(module, "bdmask_A_default")
    weight_b = module.lora_B["default"].weight
    assert torch.all(weight_b[~expected] == 0) and torch.all(weight_b[expected] == 1)
    assert torch.all(module.lora_A["default"].weight == 1)  # A of a BD-B target is dense: untouched


def test_apply_masks_redraws_a_block_diagonal_a():
    # row-parallel 32 inputs, r=4, 2 blocks: rank 0 rank rows 0-1 x inputs 0-15, rank 1 rows 2-3 x inputs 16-31
    layout = Layout("o", "rowwise", BD_A, (32,), d_in=32, d_out=8)
    module = _Lora(32, 8, 4)
    apply_masks(module, "default", Target(layout, 2, 4, DENSE), SimpleNamespace(init_lora_weights=True))
    expected = torch.zeros(4, 32, dtype=torch.bool)
    expected[0:2, 0:16] = expected[2:4, 16:32] = True
    assert torch.equal(module.bdmask_A_default, expected)
    weight_a = module.lora_A["default"].weight
    bound = (6.0 * 2 / 32) ** 0.5
    assert torch.all(weight_a[~expected] == 0) and torch.all(weight_a[expected].abs() <= bound)
    assert not torch.all(weight_a[expected] == 1)  # redrawn, not only masked


def test_apply_masks_without_init_only_masks():
    layout = Layout("o", "rowwise", BD_A, (32,), d_in=32, d_out=8)
    module = _Lora(32, 8, 4)
    apply_masks(module, "default", Target(layout, 2, 4, DENSE), SimpleNamespace(init_lora_weights=False))
    weight_a = module.lora_A["default"].weight
    assert weight_a.sum() == 2 * 2 * 16  # the 64 on-block ones are kept


def test_apply_masks_refuses_a_mask_that_does_not_fit_the_factor():
    module = _Lora(16, 48, 4)  # lora_B (48, 4), the target says 64 outputs
    with pytest.raises(BlockDiagLoraConfigError) as info:
        apply_masks(module, "default", _fused_b_target(), SimpleNamespace(init_lora_weights=True))
    message = str(info.value)
    assert "\n" not in message and "qkv: block mask (64, 4) does not fit lora_B (48, 4)" in message


def test_masked_factors_keep_off_block_gradients_at_zero():
    module = _Lora(16, 64, 4)
    apply_masks(module, "default", _fused_b_target(), SimpleNamespace(init_lora_weights=True))
    a, b = masked_factors(module, "default")
    assert a is module.lora_A["default"].weight  # no A mask
    (b @ a).sum().backward()
    grad = module.lora_B["default"].weight.grad
    expected = _expected_b_mask()
    assert torch.all(grad[~expected] == 0) and torch.all(grad[expected] != 0)


def test_masked_factors_of_an_unmasked_layer_are_the_factors():
    module = _Lora(4, 4, 2)
    a, b = masked_factors(module, "default")
    assert a is module.lora_A["default"].weight and b is module.lora_B["default"].weight


# ------------------------------------------------------------------------------------------------- quant_layers


def _randomized(model):
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.1)
    return model


def test_dense_delta_weight_expands_the_packed_block_diagonal_factor():
    model = _randomized(get_peft_model(build_tiny_model("llama"), BlockDiagLoraConfig(r=4, nblocks=2, lora_alpha=8)))
    layer = model.base_model.model.model.layers[0]
    q, o = layer.self_attn.q_proj, layer.self_attn.o_proj
    packed_b = q.lora_B["default"].weight  # (64, 2): block i is rows 32i..32i+31, rank columns 2i, 2i+1
    dense_b = torch.zeros(64, 4)
    dense_b[:32, :2], dense_b[32:, 2:] = packed_b[:32], packed_b[32:]
    expected = 2.0 * dense_b @ q.lora_A["default"].weight  # scaling alpha / r = 8 / 4
    assert torch.allclose(dense_delta_weight(q, "default"), expected, atol=1e-6)
    packed_a = o.lora_A["default"].weight  # (4, 32): block i is rank rows 2i, 2i+1 over inputs 32i..32i+31
    dense_a = torch.zeros(4, 64)
    dense_a[:2, :32], dense_a[2:, 32:] = packed_a[:2], packed_a[2:]
    assert torch.allclose(dense_delta_weight(o, "default"), 2.0 * o.lora_B["default"].weight @ dense_a, atol=1e-6)


def test_torchao_linear_is_a_virtual_dispatch_class():
    assert not isinstance(nn.Linear(4, 4), TorchaoLinear)
    assert not isinstance(nn.Conv1d(4, 4, 1), TorchaoLinear)


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao not installed")
def test_a_torchao_int8_linear_is_a_torchao_linear():
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = nn.Sequential(nn.Linear(64, 64))
    quantize_(model, Int8WeightOnlyConfig())
    assert isinstance(model[0], TorchaoLinear) and type(model[0]) is nn.Linear


def test_custom_modules_put_the_quantized_layers_first():
    mapping = custom_modules()
    keys = list(mapping)
    assert mapping[TorchaoLinear] is BlockDiagLoraTorchaoLinear
    assert nn.Linear not in mapping  # the toolkit's nn.Linear entry comes after these (peft_integration/config.py)
    if HAS_BNB:
        import bitsandbytes as bnb

        from bdlora_train.peft_integration.quant_layers import BlockDiagLoraLinear4bit, BlockDiagLoraLinear8bitLt

        assert keys == [bnb.nn.Linear4bit, bnb.nn.Linear8bitLt, TorchaoLinear]
        assert mapping[bnb.nn.Linear4bit] is BlockDiagLoraLinear4bit
        assert mapping[bnb.nn.Linear8bitLt] is BlockDiagLoraLinear8bitLt
    else:
        assert keys == [TorchaoLinear]


@pytest.fixture(scope="module")
def bd_8bit():
    pytest.importorskip("bitsandbytes")
    from bdlora_train.models import load_model
    from bdlora_train.quant.keys import QuantKeys
    from bdlora_train.quant.quantized import quantization_config

    base = load_model("tiny:llama", quantization=quantization_config(QuantKeys(load_in_8bit=True)))[0]
    return _randomized(get_peft_model(base, BlockDiagLoraConfig(r=4, nblocks=2, lora_alpha=8)))


def test_bitsandbytes_8bit_base_gets_real_block_diagonal_factors_in_float(bd_8bit):
    from peft.tuners.lora.variants import BlockDiagonalLinear

    from bdlora_train.peft_integration.quant_layers import BlockDiagLoraLinear8bitLt, QuantBlockDiagLoraVariant

    layer = bd_8bit.base_model.model.model.layers[0]
    q, o = layer.self_attn.q_proj, layer.self_attn.o_proj
    assert type(q) is BlockDiagLoraLinear8bitLt and isinstance(q.lora_variant["default"], QuantBlockDiagLoraVariant)
    assert repr(q).startswith("bdlora.")
    assert isinstance(q.lora_B["default"], BlockDiagonalLinear) and not isinstance(
        q.lora_A["default"], BlockDiagonalLinear
    )
    assert tuple(q.lora_B["default"].weight.shape) == (64, 2) and q.lora_B["default"].weight.dtype is torch.float32
    assert isinstance(o.lora_A["default"], BlockDiagonalLinear) and tuple(o.lora_A["default"].weight.shape) == (4, 32)
    assert o.lora_A["default"].weight.dtype is torch.float32  # never the base's int8 storage dtype


def test_bitsandbytes_delta_and_merges_use_the_dense_block_diagonal_delta(bd_8bit):
    from bdlora_train.peft_integration.quant_layers import QuantBlockDiagLoraVariant

    q = bd_8bit.base_model.model.model.layers[0].self_attn.q_proj
    packed_b = q.lora_B["default"].weight
    dense_b = torch.zeros(64, 4)
    dense_b[:32, :2], dense_b[32:, 2:] = packed_b[:32], packed_b[32:]
    expected = 2.0 * dense_b @ q.lora_A["default"].weight
    assert torch.allclose(q.get_delta_weight("default"), expected, atol=1e-6)
    weight = torch.zeros(64, 64)
    merged = QuantBlockDiagLoraVariant.merge_safe(q, "default", weight)
    assert torch.allclose(merged, expected, atol=1e-6) and torch.all(weight == 0)
    assert torch.allclose(QuantBlockDiagLoraVariant.unmerge(q, "default", merged), weight, atol=1e-6)
    QuantBlockDiagLoraVariant.merge_unsafe(q, "default", weight)
    assert torch.allclose(weight, expected, atol=1e-6)
