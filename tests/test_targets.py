"""Every TP-alignment check fails loudly, in one line, naming the module, the numbers and the fix."""

import pytest
import torch
from torch import nn

from bdlora_train import BlockDiagLoraConfig, BlockDiagLoraConfigError, build_tiny_model, get_peft_model
from bdlora_train.arch.plans import parallel_of, plan_style, tp_plan
from bdlora_train.core.layout import role_of
from bdlora_train.core.roles import BD_A, BD_B


def inject(model, **kwargs):
    return get_peft_model(model, BlockDiagLoraConfig(**{"r": 4, "nblocks": 2, **kwargs}))


def one_line(excinfo):
    text = str(excinfo.value)
    assert "\n" not in text
    return text


def test_plan_patterns_match_full_module_names():
    plan = tp_plan(build_tiny_model("llama").config)
    assert role_of(parallel_of(plan_style("model.layers.11.self_attn.q_proj", plan))) == BD_B
    assert role_of(parallel_of(plan_style("model.layers.3.mlp.down_proj", plan))) == BD_A
    assert role_of(parallel_of(plan_style("model.layers.3.mlp.down_proj_extra", plan))) is None
    assert role_of(parallel_of(plan_style("lm_head", plan))) is None


def test_nblocks_must_divide_attention_heads():
    model = build_tiny_model(
        "llama", num_attention_heads=6, num_key_value_heads=6, head_dim=16, hidden_size=96, intermediate_size=192
    )
    with pytest.raises(BlockDiagLoraConfigError) as err:
        inject(model, r=4, nblocks=4)
    assert "nblocks=4 does not divide num_attention_heads=6" in one_line(err)
    assert "[1, 2, 3, 6]" in str(err.value)


def test_nblocks_must_divide_kv_heads():
    # 8 heads, 2 KV heads: nblocks 4 divides the heads but an engine at TP 4 would replicate KV heads.
    model = build_tiny_model("llama", num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    with pytest.raises(BlockDiagLoraConfigError) as err:
        inject(model, r=4, nblocks=4)
    assert "num_key_value_heads=2" in one_line(err)


def test_block_diagonal_features_must_be_divisible():
    # 3 heads of dim 10 -> q out_features 30, heads divisible by 3 but features of down_proj (100) are not.
    model = build_tiny_model(
        "llama", num_attention_heads=3, num_key_value_heads=3, head_dim=10, hidden_size=30, intermediate_size=100
    )
    with pytest.raises(BlockDiagLoraConfigError) as err:
        inject(model, r=6, nblocks=3)
    assert "model.layers.0.mlp.gate_proj: out_features=100" in one_line(err) and "nblocks=3" in str(err.value)


def test_rank_pattern_must_be_multiple_of_nblocks():
    with pytest.raises(BlockDiagLoraConfigError) as err:
        inject(build_tiny_model("llama"), rank_pattern={"q_proj": 3})
    assert "q_proj: r=3 is not a multiple of nblocks=2; use r=2 or r=4" in one_line(err)


def test_targets_matching_nothing():
    with pytest.raises(BlockDiagLoraConfigError) as err:
        inject(build_tiny_model("llama"), target_modules=["query", "value"])
    assert "match no module" in one_line(err) and "q_proj" in str(err.value)


def test_module_matching_both_roles():
    with pytest.raises(BlockDiagLoraConfigError) as err:
        inject(build_tiny_model("llama"), roles={"q_proj": "bd_a", "self_attn.q_proj": "bd_b"})
    assert "both" in one_line(err) and "q_proj" in str(err.value)


def test_overrides_change_roles_and_unknown_roles_fail():
    cfg = BlockDiagLoraConfig(r=4, nblocks=2, roles={"v_proj": "bd_a"})
    get_peft_model(build_tiny_model("llama"), cfg)
    assert cfg.resolved_roles["model.layers.0.self_attn.v_proj"] == BD_A
    with pytest.raises(BlockDiagLoraConfigError, match="unknown role"):
        inject(build_tiny_model("llama"), roles={"v_proj": "rows"})


def test_module_without_tp_role_needs_override():
    with pytest.raises(BlockDiagLoraConfigError) as err:
        inject(build_tiny_model("llama"), target_modules=["q_proj", "lm_head"])
    assert "lm_head: no tensor-parallel role" in one_line(err)
    assert "pass roles={'lm_head': 'bd_b'} for a column-parallel layer" in str(err.value)  # no stray braces


def test_quantized_layers_are_refused():
    class Linear8bitLt(nn.Linear):  # stands in for bitsandbytes' layer, which subclasses nn.Linear
        pass

    Linear8bitLt.__module__ = "bitsandbytes.nn.modules"
    model = build_tiny_model("llama")
    old = model.model.layers[0].self_attn.q_proj
    model.model.layers[0].self_attn.q_proj = Linear8bitLt(old.in_features, old.out_features, bias=False)
    with pytest.raises(BlockDiagLoraConfigError) as err:
        inject(model)
    assert "model.layers.0.self_attn.q_proj: quantized layer Linear8bitLt" in one_line(err)


def test_segment_contiguous_fused_projections_get_segment_aware_blocks():
    """Phi-3's qkv_proj is [q | k | v] (H*d, KV*d, KV*d): rank i's block is the i-th half of each segment,
    stored densely (stock PEFT's use_bdlora has contiguous blocks only) and matched by no use_bdlora pattern."""
    cfg = BlockDiagLoraConfig(r=4, nblocks=2, target_modules=["qkv_proj", "gate_up_proj", "o_proj"])
    get_peft_model(build_tiny_model("phi3"), cfg)
    qkv = cfg.resolved["model.layers.0.self_attn.qkv_proj"]
    assert (qkv.role, qkv.layout.segments, qkv.storage) == (BD_B, (64, 32, 32), "dense")
    assert cfg.resolved["model.layers.0.mlp.gate_up_proj"].layout.segments == (128, 128)
    assert cfg.use_bdlora.target_modules_bd_b == [] and cfg.use_bdlora.match_strict is False
    assert cfg.use_bdlora.target_modules_bd_a == ["o_proj"]


def test_head_interleaved_qkv_takes_contiguous_blocks():
    """GPT-NeoX interleaves q, k, v per head: contiguous blocks are whole-head TP shards (PEFT-native, packed)."""
    cfg = BlockDiagLoraConfig(r=4, nblocks=2, target_modules=["query_key_value", "dense"])
    get_peft_model(build_tiny_model("gpt_neox"), cfg)
    qkv = cfg.resolved["gpt_neox.layers.0.attention.query_key_value"]
    assert (qkv.role, qkv.layout.segments, qkv.storage) == (BD_B, (192,), "packed")


def test_up_proj_pattern_never_claims_gate_up_proj():
    """GLM-4 has q/k/v (packed) next to the fused gate_up_proj (dense): no pattern may be a substring of it."""
    cfg = BlockDiagLoraConfig(r=4, nblocks=2)
    get_peft_model(build_tiny_model("glm4"), cfg)
    patterns = cfg.use_bdlora.target_modules_bd_a + cfg.use_bdlora.target_modules_bd_b
    assert not any(p in "model.layers.0.mlp.gate_up_proj" for p in patterns)


def test_gpt2_conv1d_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128, n_positions=64))
    with pytest.raises(BlockDiagLoraConfigError) as err:
        inject(model, target_modules=["c_proj"])
    assert "Conv1D" in one_line(err)


def test_registry_covers_architectures_without_a_plan():
    from transformers import OPTConfig, OPTForCausalLM

    model = OPTForCausalLM(
        OPTConfig(
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            vocab_size=128,
            word_embed_proj_dim=64,
        )
    )
    cfg = BlockDiagLoraConfig(r=4, nblocks=2, target_modules=["q_proj", "out_proj", "fc1", "fc2"])
    get_peft_model(model, cfg)
    leaf_roles = {n.rsplit(".", 1)[-1]: r for n, r in cfg.resolved_roles.items()}
    assert leaf_roles == {"q_proj": BD_B, "out_proj": BD_A, "fc1": BD_B, "fc2": BD_A}


def test_meta_device_models_resolve_without_weights():
    from bdlora_train.models import load_config, meta_model

    model = meta_model(load_config("meta-llama/Llama-3.1-70B"))
    assert next(model.parameters()).device == torch.device("meta")
    from bdlora_train.peft_integration.resolve import resolve_roles

    roles = resolve_roles(model, BlockDiagLoraConfig(r=32, nblocks=8), 8)
    assert len(roles) == 80 * 7
