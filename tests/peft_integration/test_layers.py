"""The toolkit's BD-LoRA layer against PEFT's native BdLoraLinearVariant: math, format, merging, compile, memory.

And peft_integration.masked (block masks on densely stored factors) and peft_integration.quant_layers (BD-LoRA layers
for quantized bases), on CPU only: bitsandbytes 8-bit and torchao int8 weight-only both build and run there.
"""

import copy
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft import BdLoraConfig, LoraConfig, PeftModel, get_peft_model_state_dict
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from peft.tuners.lora.variants import BdLoraLinearVariant
from torch import nn

from bdlora_train import BlockDiagLoraConfig, get_peft_model, prepare_bdlora_config
from bdlora_train.arch.targets import DENSE, Target
from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.core.layout import Layout
from bdlora_train.core.roles import BD_A, BD_B
from bdlora_train.kernels.bdlora import bdlora_add_
from bdlora_train.models import build_tiny_model
from bdlora_train.peft_integration.layers import BlockDiagLoraLinear, FastBlockDiagLoraVariant
from bdlora_train.peft_integration.masked import apply_masks, bd_a_bound, block_init_, masked_factors
from bdlora_train.peft_integration.quant_layers import (
    BlockDiagLoraTorchaoLinear,
    TorchaoLinear,
    custom_modules,
    dense_delta_weight,
)

ROLES = {"up": "bd_b", "down": "bd_a"}
D_IN, D_HID = 32, 64


class MLP(nn.Module):
    """One column-parallel (up, BD-B) and one row-parallel (down, BD-A) layer: both roles in one model."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D_IN, D_HID, bias=True)
        self.down = nn.Linear(D_HID, D_IN, bias=False)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def toolkit_config(r=16, nblocks=4, **kw):
    return BlockDiagLoraConfig(r=r, lora_alpha=2 * r, nblocks=nblocks, target_modules=["up", "down"], roles=ROLES, **kw)


def stock_config(r=16, nblocks=4, **kw):
    bd = BdLoraConfig(target_modules_bd_a=["down"], target_modules_bd_b=["up"], nblocks=nblocks, match_strict=True)
    return LoraConfig(r=r, lora_alpha=2 * r, target_modules=["up", "down"], use_bdlora=bd, **kw)


def randomize(model, seed=1):
    """Non-zero A and B (B starts at zero), so every gradient path carries signal."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def twin_models(r=16, nblocks=4, **kw):
    """(toolkit, stock) PEFT models on the same base weights with the same adapter weights."""
    base = MLP()
    ours = get_peft_model(copy.deepcopy(base), toolkit_config(r, nblocks, **kw))
    randomize(ours)
    stock = get_peft_model(copy.deepcopy(base), stock_config(r, nblocks, **kw))
    missing = stock.load_state_dict(ours.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    return ours, stock


def run(model, x, seed=123):
    """Output and gradients of x and every trainable parameter for loss = sum(out * w)."""
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)  # same dropout masks in both models
    out = model(x)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * weights).sum().backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def close(got, want, tol=1e-5, msg=None):
    """Equal up to `tol` relative to the tensor's scale (fp32 sums in another order differ in the last bits)."""
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item(), msg=msg)


def assert_same(a, b, tol=1e-5):
    out_a, gx_a, g_a = a
    out_b, gx_b, g_b = b
    close(out_a, out_b, tol)
    close(gx_a, gx_b, tol)
    assert g_a.keys() == g_b.keys() and len(g_a) == 4  # lora_A and lora_B of up and down
    for name in g_a:
        close(g_a[name], g_b[name], tol, msg=name)


def test_blockdiagloraconfig_builds_toolkit_layers_and_stock_config_does_not():
    ours, stock = twin_models()
    for name in ("up", "down"):
        layer = ours.base_model.model.get_submodule(name)
        assert type(layer) is BlockDiagLoraLinear
        assert isinstance(layer.lora_variant["default"], FastBlockDiagLoraVariant)
        stock_layer = stock.base_model.model.get_submodule(name)
        assert type(stock_layer) is PeftLoraLinear
        assert type(stock_layer.lora_variant["default"]) is BdLoraLinearVariant
    # PEFT's module names and packed shapes: BD-B packs B to (d_out, r/N), BD-A packs A to (r, d_in/N).
    shapes = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(ours).items()}
    assert shapes == {
        "base_model.model.up.lora_A.weight": (16, D_IN),
        "base_model.model.up.lora_B.weight": (D_HID, 4),
        "base_model.model.down.lora_A.weight": (16, D_HID // 4),
        "base_model.model.down.lora_B.weight": (D_IN, 16),
    }


@pytest.mark.parametrize("nblocks", [1, 2, 4, 8])
@pytest.mark.parametrize("use_rslora", [False, True])
def test_forward_backward_match_peft(nblocks, use_rslora):
    ours, stock = twin_models(r=16, nblocks=nblocks, use_rslora=use_rslora)
    ours.train()
    stock.train()
    x = torch.randn(3, 5, D_IN)  # 3-D input: the layer flattens tokens
    assert_same(run(ours, x), run(stock, x))


def test_frozen_linear_base_and_adapter_are_one_node_and_a_hooked_base_is_not():
    """The training case runs base layer and adapter as one autograd node; a base layer with a module hook keeps
    PEFT's forward (the hook runs), and both match PEFT."""
    ours, stock = twin_models(r=16, nblocks=4)
    ours.train()
    stock.train()
    x = torch.randn(3, 5, D_IN, requires_grad=True)
    up = ours.base_model.model.get_submodule("up")
    assert type(up(x).grad_fn).__name__ == "_BlockDiagLoraLinearFnBackward"
    calls = []
    handle = up.base_layer.register_forward_pre_hook(lambda m, a: calls.append(1))
    assert type(up(x).grad_fn).__name__ != "_BlockDiagLoraLinearFnBackward" and calls
    assert_same(run(ours, x.detach()), run(stock, x.detach()))
    handle.remove()
    assert_same(run(ours, x.detach()), run(stock, x.detach()))


def test_the_node_output_takes_in_place_ops_like_the_base_layer_output():
    """Models add into a projection's output in place (Llama-4's MoE: `out.add_(routed)`). The node's output must be
    a tensor of its own, not a view of one it made, or autograd refuses the in-place op."""

    class AddsInPlace(MLP):
        def forward(self, x):
            hidden = self.up(x)
            hidden.add_(1.0)
            return self.down(torch.tanh(hidden))

    base = AddsInPlace()
    ours = get_peft_model(copy.deepcopy(base), toolkit_config())
    randomize(ours)
    stock = get_peft_model(copy.deepcopy(base), stock_config())
    stock.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3, D_IN)
    assert node_name(ours, x) == "_BlockDiagLoraLinearFnBackward"
    assert_same(run(ours, x), run(stock, x))


def node_name(model, x, name="up") -> str:
    """The autograd node that one adapted layer's output comes from, on an input like x of the layer's width."""
    layer = model.base_model.model.get_submodule(name)
    x = torch.randn(*x.shape[:-1], layer.in_features, dtype=x.dtype, requires_grad=True)
    return type(layer(x).grad_fn).__name__


@pytest.mark.parametrize("train", [False, True])
def test_dropout_matches_peft(train):
    """With dropout > 0: eval mode is the dropout-free fast path, train mode draws the same masks as PEFT; both are
    one node with the base layer."""
    ours, stock = twin_models(r=8, nblocks=2, lora_dropout=0.3)
    ours.train(train)
    stock.train(train)
    x = torch.randn(4, 7, D_IN)
    assert node_name(ours, x) == node_name(ours, x, "down") == "_BlockDiagLoraLinearFnBackward"
    a, b = run(ours, x), run(stock, x)
    assert_same(a, b)
    ours.eval()
    with torch.no_grad():
        no_dropout = ours(x)
    assert torch.equal(no_dropout, a[0]) is (not train)  # train mode really dropped something


def test_a_dropout_of_its_own_keeps_its_forward():
    """The node draws torch's nn.Dropout itself; a subclass (a user's own dropout) is called as PEFT calls it, in the
    two-node path, with the same masks and values as stock PEFT."""

    class OwnDropout(nn.Dropout):
        pass

    ours, stock = twin_models(r=8, nblocks=2, lora_dropout=0.3)
    for name in ("up", "down"):
        ours.base_model.model.get_submodule(name).lora_dropout["default"] = OwnDropout(0.3)
    ours.train()
    stock.train()
    x = torch.randn(4, 7, D_IN)
    assert "_BlockDiagLoraLinearFnBackward" not in (node_name(ours, x), node_name(ours, x, "down"))
    assert_same(run(ours, x), run(stock, x))


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_same_grads(use_reentrant):
    """Checkpointed layers run the adapter once without grad and again with it: same gradients."""
    model = build_tiny_model("llama")
    grads = []
    for checkpointing in (False, True):
        peft_model = get_peft_model(copy.deepcopy(model), BlockDiagLoraConfig(r=8, lora_alpha=16, nblocks=2))
        randomize(peft_model)
        peft_model.train()
        if checkpointing:
            peft_model.gradient_checkpointing_enable({"use_reentrant": use_reentrant})
            peft_model.enable_input_require_grads()
            assert all(layer.gradient_checkpointing for layer in peft_model.base_model.model.model.layers)
        ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
        peft_model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 28
    for name in grads[0]:
        close(grads[1][name], grads[0][name], msg=name)


def test_no_grad_inference_matches_peft():
    ours, stock = twin_models()
    x = torch.randn(6, D_IN)
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), stock(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_eval_forward_is_the_training_forward_to_the_last_bit(no_grad):
    """Evaluation and generation (no_grad) run the training node's forward, not PEFT's base-then-adapter sum: the
    outputs are bitwise equal, for both roles and a trainable base weight too (no gradient is taken under no_grad)."""
    ours, _ = twin_models()
    ours.eval()
    x = torch.randn(3, 50, D_IN)
    trained = run(ours, x)[0]
    with no_grad():
        assert torch.equal(ours(x), trained)
    ours.base_model.model.up.base_layer.weight.requires_grad_(True)  # e.g. a fully fine-tuned projection
    with no_grad():
        assert torch.equal(ours(x), trained)
    assert node_name(ours, x) != "_BlockDiagLoraLinearFnBackward"  # with gradients it takes PEFT's path, base included


@pytest.mark.parametrize("train", [False, True])
def test_an_input_with_no_tokens_gives_an_empty_output(train):
    """A batch of zero-length sequences: an empty output of the base layer's width, with gradients, and under no_grad
    (stock PEFT's BD-LoRA variant cannot reshape it)."""
    ours, _ = twin_models(lora_dropout=0.1)
    ours.train(train)
    x = torch.randn(2, 0, D_IN, requires_grad=True)
    out = ours(x)
    out.sum().backward()
    assert out.shape == x.grad.shape == (2, 0, D_IN)
    assert all(p.grad is not None and not p.grad.any() for n, p in ours.named_parameters() if "lora_" in n)
    with torch.no_grad():
        assert ours(x).shape == (2, 0, D_IN)


def dense_delta(layer, adapter="default"):
    """Independent reference: scaling * block_diag(B) @ A or B @ block_diag(A), from the packed weights."""
    a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    n = layer.lora_A[adapter].nblocks if hasattr(layer.lora_A[adapter], "nblocks") else layer.lora_B[adapter].nblocks
    if a.shape[1] != layer.in_features:
        a = torch.block_diag(*a.chunk(n, 0))
    if b.shape[1] != a.shape[0]:
        b = torch.block_diag(*b.chunk(n, 0))
    return layer.scaling[adapter] * b @ a


@pytest.mark.parametrize("safe_merge", [False, True])
def test_merge_unmerge_exact(safe_merge):
    ours, _ = twin_models()
    ours.eval()
    x = torch.randn(5, D_IN)
    with torch.no_grad():
        expected = ours(x)
        originals = {}
        for name in ("up", "down"):
            layer = ours.base_model.model.get_submodule(name)
            originals[name] = layer.base_layer.weight.clone()
            torch.testing.assert_close(layer.get_delta_weight("default"), dense_delta(layer), rtol=1e-6, atol=1e-6)
        ours.base_model.merge_adapter(safe_merge=safe_merge)
        for name in ("up", "down"):
            layer = ours.base_model.model.get_submodule(name)
            assert layer.merged
            torch.testing.assert_close(
                layer.base_layer.weight, originals[name] + dense_delta(layer), rtol=1e-6, atol=1e-6
            )
        torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)
        ours.base_model.unmerge_adapter()
        for name in ("up", "down"):
            torch.testing.assert_close(
                ours.base_model.model.get_submodule(name).base_layer.weight, originals[name], rtol=0, atol=1e-6
            )
        torch.testing.assert_close(ours(x), expected, rtol=1e-6, atol=1e-6)
        merged = ours.merge_and_unload()
        assert not any(isinstance(m, BlockDiagLoraLinear) for m in merged.modules())
        torch.testing.assert_close(merged(x), expected, rtol=1e-5, atol=1e-5)


def test_multiple_adapters_disable_and_plain_lora_like_peft():
    ours, stock = twin_models(r=8, nblocks=2)
    for model, second in ((ours, toolkit_config(r=16, nblocks=4)), (stock, stock_config(r=16, nblocks=4))):
        if isinstance(second, BlockDiagLoraConfig):
            prepare_bdlora_config(model, second)  # the explicit seam: roles are resolved against this model
        model.add_adapter("bd2", second)
        model.add_adapter("plain", LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"]))
        randomize(model, seed=2)
    assert type(ours.base_model.model.up.lora_variant["bd2"]) is FastBlockDiagLoraVariant
    assert "plain" not in ours.base_model.model.up.lora_variant  # a plain LoRA adapter stays PEFT's vanilla path
    x = torch.randn(2, 3, D_IN)
    ours.train()
    stock.train()
    for active in ("default", "bd2", "plain"):
        ours.set_adapter(active)
        stock.set_adapter(active)
        assert_same(run(ours, x), run(stock, x))
    ours.base_model.set_adapter(["default", "bd2", "plain"])  # several active at once: their sum
    stock.base_model.set_adapter(["default", "bd2", "plain"])
    with torch.no_grad():
        torch.testing.assert_close(ours(x), stock(x), rtol=1e-5, atol=1e-5)
        with ours.disable_adapter(), stock.disable_adapter():
            torch.testing.assert_close(ours(x), stock(x))
            up, down = ours.base_model.model.up.base_layer, ours.base_model.model.down.base_layer
            torch.testing.assert_close(ours(x), down(torch.tanh(up(x))))
        ours.base_model.merge_adapter(["bd2"])
        stock.base_model.merge_adapter(["bd2"])
        torch.testing.assert_close(ours(x), stock(x), rtol=1e-5, atol=1e-5)


def test_mixed_batch_adapter_names_like_peft():
    ours, stock = twin_models(r=8, nblocks=2)
    for model, second in ((ours, toolkit_config(r=16, nblocks=4)), (stock, stock_config(r=16, nblocks=4))):
        if isinstance(second, BlockDiagLoraConfig):
            prepare_bdlora_config(model, second)  # the explicit seam: roles are resolved against this model
        model.add_adapter("bd2", second)
        randomize(model, seed=3)
        model.eval()
    x = torch.randn(3, 4, D_IN)
    names = ["default", "bd2", "__base__"]
    with torch.no_grad():
        torch.testing.assert_close(ours(x, adapter_names=names), stock(x, adapter_names=names), rtol=1e-5, atol=1e-5)


def test_saved_by_toolkit_is_stock_peft_format(tmp_path):
    """Toolkit save -> stock PEFT load gives the same model; stock re-save is byte-identical."""
    model = build_tiny_model("llama")
    ours = get_peft_model(copy.deepcopy(model), BlockDiagLoraConfig(r=8, lora_alpha=16, nblocks=2))
    randomize(ours)
    ours.save_pretrained(tmp_path / "ours")
    stock = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "ours")
    assert not any(isinstance(m, BlockDiagLoraLinear) for m in stock.modules())
    assert any(
        isinstance(v, BdLoraLinearVariant) for m in stock.modules() for v in getattr(m, "lora_variant", {}).values()
    )
    ids = torch.randint(0, 256, (2, 12))
    ours.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)
    stock.save_pretrained(tmp_path / "stock")
    weights = "adapter_model.safetensors"
    assert (tmp_path / "ours" / weights).read_bytes() == (tmp_path / "stock" / weights).read_bytes()


def test_stock_peft_adapter_loads_into_toolkit_layers(tmp_path):
    ours_ref, stock = twin_models()
    stock.save_pretrained(tmp_path)
    config = BlockDiagLoraConfig.from_lora_config(
        LoraConfig.from_pretrained(tmp_path), roles=ROLES, init_lora_weights=False
    )
    base = MLP()
    loaded = PeftModel.from_pretrained(base, tmp_path, config=prepare_bdlora_config(base, config))
    assert type(loaded.base_model.model.up) is BlockDiagLoraLinear
    # the base weights of MLP() differ; put stock's back to compare the adapters alone
    loaded.base_model.model.load_state_dict(stock.base_model.model.state_dict())
    x = torch.randn(4, D_IN)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), stock(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_matches_peft(dtype):
    ours, stock = twin_models(r=16, nblocks=4)
    ours.train()
    stock.train()
    x = torch.randn(4, 8, D_IN)
    with torch.autocast("cpu", dtype=dtype):
        assert node_name(ours, x) == "_BlockDiagLoraLinearFnBackward"
        a, b = run(ours, x), run(stock, x)
    assert a[0].dtype == b[0].dtype == dtype
    assert all(g.dtype == torch.float32 for g in a[2].values())  # fp32 adapter weights keep fp32 grads
    assert_same(a, b, tol=3e-2)
    # and the bf16 result is close to the fp32 truth, not just to PEFT's
    fp32 = run(ours, x)
    close(a[0].float(), fp32[0], 5e-2)


def test_bf16_model_with_fp32_adapters_computes_like_peft():
    """PEFT keeps adapter weights fp32 on a bf16 base (autocast_adapter_dtype): both compute the adapter in fp32."""
    base = MLP().to(torch.bfloat16)
    ours = get_peft_model(copy.deepcopy(base), toolkit_config())
    randomize(ours)
    stock = get_peft_model(copy.deepcopy(base), stock_config())
    stock.load_state_dict(ours.state_dict())
    assert ours.base_model.model.up.lora_A["default"].weight.dtype == torch.float32
    x = torch.randn(3, D_IN, dtype=torch.bfloat16)
    assert node_name(ours, x) == "_BlockDiagLoraLinearFnBackward"
    a, b = run(ours, x), run(stock, x)
    assert a[0].dtype == torch.bfloat16
    assert_same(a, b, tol=1e-2)


@pytest.mark.parametrize("autocast, adapter_dtype", [(False, torch.float32), (True, torch.float32), (False, None)])
def test_bf16_base_fp32_adapter_with_dropout_draws_peft_masks(autocast, adapter_dtype):
    """The shipped recipes' case: a bf16 base, fp32 adapter weights, dropout, with or without bf16 autocast; and all
    in bf16 (the input-gradient accumulated in one tensor, through a bf16 mask). One node, the same masks as PEFT
    (PEFT casts the input to the adapter's dtype before dropout), the same outputs and gradients up to bf16
    rounding, and the gradients of x and the adapter weights in their own dtypes."""
    base = MLP().to(torch.bfloat16)
    ours = get_peft_model(copy.deepcopy(base), toolkit_config(r=8, nblocks=2, lora_dropout=0.3))
    randomize(ours)
    stock = get_peft_model(copy.deepcopy(base), stock_config(r=8, nblocks=2, lora_dropout=0.3))
    stock.load_state_dict(ours.state_dict())
    if adapter_dtype is None:
        ours.to(torch.bfloat16)
        stock.to(torch.bfloat16)
    adapter_dtype = adapter_dtype or torch.bfloat16
    x = torch.randn(4, 7, D_IN, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        assert node_name(ours, x) == node_name(ours, x, "down") == "_BlockDiagLoraLinearFnBackward"
        a, b = run(ours, x), run(stock, x)
        ours.eval()
        undropped = run(ours, x)
    assert a[1].dtype == torch.bfloat16 and all(g.dtype == adapter_dtype for g in a[2].values())
    assert_same(a, b, tol=2e-2)
    assert not torch.allclose(a[0].float(), undropped[0].float(), atol=1e-2)  # something was dropped


def saved_activation_bytes(layer, tokens=64):
    """Bytes of non-parameter tensors one layer's forward keeps for backward, by storage."""
    x = torch.randn(tokens, layer.in_features, requires_grad=True)
    params = {p.data_ptr() for p in layer.parameters()}
    saved = {}

    def pack(t):
        if t.data_ptr() not in params:
            saved[t.data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    out.sum().backward()  # the saved tensors are usable
    return saved, x


@pytest.mark.parametrize("name", ["up", "down"])
def test_saves_only_input_and_rank_r_intermediate(name):
    """Activations kept for backward by one adapted layer: x (the base layer's too) and h = x A^T, nothing else."""
    ours, stock = twin_models(r=16, nblocks=4)
    ours.train()
    stock.train()
    saved, x = saved_activation_bytes(ours.base_model.model.get_submodule(name))
    assert x.data_ptr() in saved and len(saved) == 2
    assert sum(saved.values()) == x.numel() * 4 + 64 * 16 * 4  # x and h (T x r), fp32
    peft_saved, _ = saved_activation_bytes(stock.base_model.model.get_submodule(name))
    assert sum(saved.values()) <= sum(peft_saved.values())


@pytest.mark.parametrize("name", ["up", "down"])
def test_with_dropout_saves_x_h_and_the_mask(name):
    """With dropout the one node keeps x itself, h and the dropout's keep mask (on CPU 0 / 1 in the input's dtype, as
    torch's own dropout keeps its noise there); PEFT's path keeps the noise and a dropped-out copy of x. The same bytes
    for one layer, but no copy of the input: layers that read one input (q / k / v, gate / up) share it. Under bf16
    autocast on an fp32 input h is bf16; the mask is drawn on the fp32 input, as PEFT draws it, and kept in bf16."""
    for autocast in (False, True):
        ours, stock = twin_models(r=16, nblocks=4, lora_dropout=0.1)
        ours.train()
        stock.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            saved, x = saved_activation_bytes(ours.base_model.model.get_submodule(name))
            peft_saved, peft_x = saved_activation_bytes(stock.base_model.model.get_submodule(name))
        assert x.data_ptr() in saved and len(saved) == 3, autocast
        assert peft_x.data_ptr() not in peft_saved, autocast
        h_bytes = 64 * 16 * (2 if autocast else 4)
        assert sum(saved.values()) == x.numel() * (4 + (2 if autocast else 4)) + h_bytes, autocast
        assert sum(saved.values()) <= sum(peft_saved.values()), autocast


def test_functional_entry_point_writes_in_place():
    torch.manual_seed(0)
    x = torch.randn(10, 16)
    a, b = torch.randn(8, 16), torch.randn(24, 2)  # BD-B with 4 blocks: B packed (24, 8/4)
    delta = 0.5 * x @ a.t() @ torch.block_diag(*b.chunk(4, 0)).t()
    result = torch.randn(10, 24)
    expected = result + delta
    out = bdlora_add_(result, x, a, b, 0.5, 4, "bd_b")
    assert out.data_ptr() == result.data_ptr()
    torch.testing.assert_close(out, expected)
    strided = torch.randn(24, 10).t()  # a non-contiguous base output takes the out-of-place path
    torch.testing.assert_close(
        bdlora_add_(strided.clone(memory_format=torch.preserve_format), x, a, b, 0.5, 4, "bd_b"), strided + delta
    )


@pytest.mark.parametrize("role", ["bd_a", "bd_b", "plain"])
def test_functional_matches_dense_autograd_reference(role):
    """Independent of PEFT: the packed factors expanded to dense matrices, differentiated by autograd."""
    torch.manual_seed(0)
    nblocks, r, d_in, d_out, scaling = 4, 8, 16, 24, 0.7
    a = torch.randn(r, d_in // nblocks if role == "bd_a" else d_in, requires_grad=True)
    b = torch.randn(d_out, r // nblocks if role == "bd_b" else r, requires_grad=True)
    x = torch.randn(2, 5, d_in, requires_grad=True)
    base = torch.randn(d_out, d_in)
    a_dense = torch.block_diag(*a.chunk(nblocks, 0)) if role == "bd_a" else a
    b_dense = torch.block_diag(*b.chunk(nblocks, 0)) if role == "bd_b" else b
    want = x @ base.t() + scaling * x @ a_dense.t() @ b_dense.t()
    want_grads = torch.autograd.grad(want.pow(2).sum(), (x, a, b))
    got = bdlora_add_(x @ base.t(), x, a, b, scaling, nblocks, role)
    got_grads = torch.autograd.grad(got.pow(2).sum(), (x, a, b))
    close(got, want)
    for g, w in zip(got_grads, want_grads):
        close(g, w)


def test_role_disagreeing_with_peft_patterns_is_refused():
    from bdlora_train.core.errors import BlockDiagLoraConfigError

    model = get_peft_model(MLP(), toolkit_config())
    config = copy.deepcopy(model.peft_config["default"])
    config.resolved_roles = {"up": "bd_a"}  # PEFT's patterns say bd_b
    with pytest.raises(
        BlockDiagLoraConfigError, match="up resolved to role bd_a but PEFT's use_bdlora patterns give bd_b",
    ):
        model.base_model.model.up.update_layer("other", 16, 32, config=config, target_name="up")


def test_torch_compile_no_graph_breaks_and_same_grads():
    model = build_tiny_model("llama", num_hidden_layers=1)
    peft_model = get_peft_model(model, BlockDiagLoraConfig(r=8, lora_alpha=16, nblocks=2))
    randomize(peft_model)
    ids = torch.randint(0, 256, (2, 8))
    explanation = torch._dynamo.explain(peft_model)(ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    for name in ("q_proj", "o_proj"):
        layer = peft_model.base_model.model.model.layers[0].self_attn.get_submodule(name)
        layer.train()
        x = torch.randn(2, 8, layer.in_features)
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")  # traces forward and backward
        got, want = run(compiled, x), run(layer, x)
        close(got[0], want[0])
        close(got[1], want[1])
        for key in want[2]:
            close(got[2][key], want[2][key], msg=key)


ZERO3_SCRIPT = """
import json, sys, copy, torch
sys.path.insert(0, sys.argv[1])
import deepspeed
from deepspeed.utils import safe_get_full_grad
from test_layers import twin_models
deepspeed.init_distributed(dist_backend="gloo")
ours, _ = twin_models()
ref = copy.deepcopy(ours)
x = torch.randn(4, 32)
cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
       "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "zero_allow_untested_optimizer": True}
trainable = [p for p in ours.parameters() if p.requires_grad]
engine, *_ = deepspeed.initialize(model=ours, config=cfg, model_parameters=trainable)
weight = ours.base_model.model.up.lora_A["default"].weight
out = engine(x)
engine.backward(out.pow(2).sum())
want = ref(x)
want.pow(2).sum().backward()
ref_grads = dict(ref.named_parameters())
grads = {  # relative to the gradient's largest entry (about 100 here): the two paths sum in different orders
    n: ((safe_get_full_grad(p) - ref_grads[n].grad).abs().max() / ref_grads[n].grad.abs().max()).item()
    for n, p in ours.named_parameters()
    if p.requires_grad
}
print(json.dumps(dict(partitioned=tuple(weight.shape) == (0,), out=(out - want).abs().max().item(), grads=grads)))
"""


def test_deepspeed_zero3_partitioned_adapter_weights():
    """ZeRO-3 frees the lora weights outside forward; the fused path reads them directly, which DeepSpeed's
    parameter dict gathers on access. One rank on gloo, every adapter weight partitioned (threshold 0)."""
    pytest.importorskip("deepspeed")
    root = Path(__file__).resolve().parents[2]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(root / ".venv" / "torch_extensions")),
    }
    proc = subprocess.run(
        [sys.executable, "-c", ZERO3_SCRIPT, str(Path(__file__).resolve().parent)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["partitioned"]
    assert result["out"] < 1e-6
    assert len(result["grads"]) == 4 and max(result["grads"].values()) < 1e-6, result["grads"]


@pytest.mark.slow
def test_torch_compile_inductor_matches_eager():
    ours, _ = twin_models()
    ours.train()
    x = torch.randn(4, 6, D_IN)
    compiled = torch.compile(ours, fullgraph=True)
    assert_same(run(compiled, x), run(ours, x), tol=1e-4)


# ----------------------------------------------------------------------------------------------------
# peft_integration.masked (block masks on densely stored factors) and peft_integration.quant_layers (BD-LoRA layers

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
