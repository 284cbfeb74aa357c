"""BlockDiagLoraConfig with stock get_peft_model: roles from the TP plan, math against dense references."""

import json
import math

import pytest
import torch
from conftest import FAMILIES
from peft import BdLoraConfig, LoraConfig
from peft.tuners.lora import LoraLayer

from bdlora_train import (
    BD_A,
    BD_B,
    BlockDiagLoraConfig,
    BlockDiagLoraConfigError,
    build_tiny_model,
    count_adapter_params,
    get_peft_model,
)
from bdlora_train.adapters.reader import read_adapter

EXPECTED_ROLES = {
    "q_proj": BD_B,
    "k_proj": BD_B,
    "v_proj": BD_B,
    "gate_proj": BD_B,
    "up_proj": BD_B,
    "o_proj": BD_A,
    "down_proj": BD_A,
}


def lora_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def randomize_adapter(model, seed=1):
    """PEFT starts B at zero; tests need a non-trivial adapter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def dense_factors(layer, adapter="default"):
    """Dense A (r, d_in) and B (d_out, r) of a layer, from PEFT's packed storage."""
    A, B = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    nb = layer.lora_A[adapter].nblocks if hasattr(layer.lora_A[adapter], "nblocks") else 1
    if A.shape[1] != layer.in_features:
        A = torch.block_diag(*A.chunk(nb, 0))
    nb = layer.lora_B[adapter].nblocks if hasattr(layer.lora_B[adapter], "nblocks") else 1
    if B.shape[1] != A.shape[0]:
        B = torch.block_diag(*B.chunk(nb, 0))
    return A, B


@pytest.mark.parametrize("family", FAMILIES)
def test_roles_come_from_the_tp_plan(family):
    model = build_tiny_model(family)
    cfg = BlockDiagLoraConfig(r=4, nblocks=2, lora_alpha=8)
    expected_params = count_adapter_params(model, cfg)
    peft_model = get_peft_model(model, cfg)
    layers = lora_layers(peft_model)
    assert len(layers) == 7 * 2
    for name in layers:
        leaf = name.rsplit(".", 1)[-1]
        key = name.removeprefix("base_model.model.")
        assert cfg.resolved_roles[key] == EXPECTED_ROLES[leaf], name
    trainable, _ = peft_model.get_nb_trainable_parameters()
    assert trainable == expected_params
    # Block-diagonal factor packed per role: BD-B keeps A dense, BD-A keeps B dense.
    q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    o = peft_model.base_model.model.model.layers[0].self_attn.o_proj
    assert q.lora_B["default"].weight.shape == (q.out_features, 2)
    assert q.lora_A["default"].weight.shape == (4, q.in_features)
    assert o.lora_A["default"].weight.shape == (4, o.in_features // 2)
    assert o.lora_B["default"].weight.shape == (o.out_features, 4)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_forward_equals_dense_reference(family):
    model = build_tiny_model(family)
    cfg = BlockDiagLoraConfig(r=4, nblocks=2, lora_alpha=6, use_rslora=(family == "qwen3"))
    peft_model = get_peft_model(model, cfg)
    randomize_adapter(peft_model)
    scaling = 6 / math.sqrt(4) if family == "qwen3" else 6 / 4
    for layer in lora_layers(peft_model).values():
        x = torch.randn(3, 5, layer.in_features)
        A, B = dense_factors(layer)
        expected = layer.base_layer(x) + (x @ A.T @ B.T) * scaling
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


def test_packed_and_dense_are_the_same_matrix():
    model = get_peft_model(build_tiny_model("llama"), BlockDiagLoraConfig(r=4, nblocks=2))
    randomize_adapter(model)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    packed = q.lora_B["default"].weight  # (d_out, r/N): blocks stacked along dim 0
    dense = torch.block_diag(*packed.chunk(2, 0))
    d_out = q.out_features
    # Off-diagonal blocks are zero; diagonal blocks are the packed rows.
    assert torch.count_nonzero(dense[: d_out // 2, 2:]) == 0 and torch.count_nonzero(dense[d_out // 2 :, :2]) == 0
    torch.testing.assert_close(dense[d_out // 2 :, 2:], packed[d_out // 2 :])
    h = torch.randn(7, 4)
    torch.testing.assert_close(q.lora_B["default"](h), h @ dense.T)


def test_merge_unmerge_is_exact():
    base = build_tiny_model("llama")
    ids = torch.randint(0, 256, (2, 9))
    model = get_peft_model(base, BlockDiagLoraConfig(r=4, nblocks=2, lora_alpha=8))
    randomize_adapter(model)
    model.eval()
    with torch.no_grad():
        unmerged = model(ids).logits
        model.merge_adapter()
        merged = model(ids).logits
        model.unmerge_adapter()
        back = model(ids).logits
        with model.disable_adapter():
            plain = model(ids).logits
    torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(back, unmerged, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, unmerged, atol=1e-3)  # the adapter really changes the output


def test_saved_config_is_stock_lora_with_exact_roles(tmp_path):
    model = get_peft_model(build_tiny_model("llama"), BlockDiagLoraConfig(r=4, nblocks=2))
    model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "adapter_config.json").read_text())
    assert raw["peft_type"] == "LORA"
    assert not {"nblocks", "roles", "bd_a_init"} & raw.keys()
    assert raw["use_bdlora"]["nblocks"] == 2
    adapter = read_adapter(tmp_path)
    assert {n.rsplit(".", 1)[-1]: m.role for n, m in adapter.modules.items()} == EXPECTED_ROLES


def test_substring_trap_is_avoided():
    """A model with both `up_proj` and `gate_up_proj`: PEFT's substring rule would give gate_up_proj up's role."""
    from bdlora_train.peft_integration.patterns import compact_patterns, stock_roles

    roles = {"m.0.up_proj": BD_B, "m.0.gate_up_proj": BD_A, "m.0.down_proj": BD_A}
    patterns = compact_patterns(roles)
    assert "up_proj" not in patterns[BD_B]  # it is a substring of gate_up_proj
    assert stock_roles(roles, {"target_modules_bd_a": patterns[BD_A], "target_modules_bd_b": patterns[BD_B]}) == roles


def test_stock_bdlora_config_works_with_toolkit_functions(tmp_path):
    """An adapter made by stock LoraConfig(use_bdlora=...) is counted, read and loaded by the toolkit."""
    from bdlora_train.adapters.load import load_adapter

    base = build_tiny_model("llama")
    stock = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
        use_bdlora=BdLoraConfig(
            target_modules_bd_a=["o_proj", "down_proj"], target_modules_bd_b=["q_proj", "v_proj"], nblocks=2
        ),
    )
    expected = count_adapter_params(base, stock)
    model = get_peft_model(base, stock)
    assert model.get_nb_trainable_parameters()[0] == expected
    randomize_adapter(model)
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        reference = model(ids).logits
    adapter = read_adapter(tmp_path)
    assert adapter.params == expected and adapter.nblocks == 2
    loaded = load_adapter(build_tiny_model("llama"), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference, rtol=1e-6, atol=1e-6)


def test_init_of_block_diagonal_factors():
    torch.manual_seed(0)
    base = build_tiny_model("llama", hidden_size=256, intermediate_size=512, head_dim=64)
    peft_init = get_peft_model(base, BlockDiagLoraConfig(r=8, nblocks=2))
    down = peft_init.base_model.model.model.layers[0].mlp.down_proj
    q = peft_init.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.count_nonzero(q.lora_B["default"].weight) == 0  # BD-B starts at zero: the adapter starts as identity
    assert torch.count_nonzero(down.lora_B["default"].weight) == 0
    peft_bound = math.sqrt(6 / (down.in_features // 2))  # kaiming_uniform(a=0) on the packed (r, d_in/N) weight
    assert down.lora_A["default"].weight.abs().max() <= peft_bound
    assert down.lora_A["default"].weight.abs().max() > 0.9 * peft_bound

    base = build_tiny_model("llama", hidden_size=256, intermediate_size=512, head_dim=64)
    lora_init = get_peft_model(base, BlockDiagLoraConfig(r=8, nblocks=2, bd_a_init="lora"))
    down = lora_init.base_model.model.model.layers[0].mlp.down_proj
    lora_bound = 1 / math.sqrt(down.in_features)  # what vanilla LoRA's A draws from
    assert down.lora_A["default"].weight.abs().max() <= lora_bound
    assert down.lora_A["default"].weight.abs().max() > 0.9 * lora_bound
    assert peft_bound / lora_bound == pytest.approx(math.sqrt(12))  # ~3.5x at nblocks 2


def _seeded_adapter(family: str, dtype: torch.dtype, seed: int = 1, **config) -> dict:
    base = build_tiny_model(family, dtype=dtype)  # seeds torch with 0
    torch.manual_seed(seed)
    model = get_peft_model(base, BlockDiagLoraConfig(r=8, nblocks=2, **config))
    return {n: p.detach().double() for n, p in model.named_parameters() if "lora_" in n}


# the packed BD-A (PEFT's BlockDiagonalLinear), the dense-stored ones (fused projections, MoE experts), bd_a_init=lora
@pytest.mark.parametrize(("family", "config"), [("llama", {}), ("phi3", {}), ("qwen3_moe", {}), ("llama", {
    "bd_a_init": "lora"})])  # fmt: skip
def test_one_seed_draws_one_adapter_in_every_dtype(family, config):
    """As vanilla LoRA's A (an nn.Linear built in float32, then cast), every factor is drawn in float32: a float64
    base gets the float32 run's adapter exactly (its exact-arithmetic twin, what the TP exactness tests compare
    against), a bf16 base the same adapter rounded. PEFT's BlockDiagonalLinear draws in the base's dtype, which takes
    other numbers from the random stream and so changes every factor drawn after it."""
    fp32 = _seeded_adapter(family, torch.float32, **config)
    fp64 = _seeded_adapter(family, torch.float64, **config)
    bf16 = _seeded_adapter(family, torch.bfloat16, **config)
    assert fp32.keys() == fp64.keys() == bf16.keys()
    assert all(torch.equal(fp32[k], fp64[k]) for k in fp32)
    for key, value in fp32.items():
        torch.testing.assert_close(bf16[key], value, rtol=2**-8, atol=0)  # bf16 keeps 8 significant bits
    assert any(v.abs().sum() > 0 for v in fp32.values())


def test_probing_a_fused_layout_leaves_the_seed_alone():
    """Resolving Phi-3's fused qkv_proj / gate_up_proj builds a tiny model to probe their layout (arch/fused.py);
    that build seeds torch, and the adapter drawn after it must still follow the caller's seed."""
    from bdlora_train.arch.fused import probed_layout

    probed_layout.cache_clear()
    probing = _seeded_adapter("phi3", torch.float32, seed=1)
    cached = _seeded_adapter("phi3", torch.float32, seed=1)
    probed_layout.cache_clear()
    other_seed = _seeded_adapter("phi3", torch.float32, seed=2)
    assert all(torch.equal(probing[k], cached[k]) for k in probing)
    o_proj_a = "base_model.model.model.layers.0.self_attn.o_proj.lora_A.default.weight"
    assert not torch.equal(probing[o_proj_a], other_seed[o_proj_a])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(r=5, nblocks=2), "r=5 is not a multiple of nblocks=2"),
        (dict(r=4, nblocks=0), "nblocks=0"),
        (dict(r=4, nblocks=2, bd_a_init="xavier"), "bd_a_init='xavier'"),
        (dict(r=4, nblocks=2, init_lora_weights="pissa"), "init_lora_weights='pissa'"),
        (dict(r=4, nblocks=2, use_dora=True), "use_dora"),
    ],
)
def test_config_errors(kwargs, message):
    with pytest.raises(BlockDiagLoraConfigError, match=message):
        BlockDiagLoraConfig(**kwargs)
