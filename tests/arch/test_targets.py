"""arch.targets: from a request to exactly what gets adapted (Target, Request, resolve_targets), or one line why not.

Parameter counts are worked out by hand for the tiny Llama (hidden 64, intermediate 128, KV width 2 x 16 = 32,
2 layers) at r=4, nblocks=2:
  BD-B (column) r*d_in + r*d_out/N: q 4*64 + 4*64/2 = 384, k/v 256 + 64 = 320, gate/up 256 + 256 = 512
  BD-A (row)    r*d_in/N + r*d_out: o 128 + 256 = 384, down 4*128/2 + 4*64 = 512
  per layer 384 + 320 + 320 + 384 + 512 + 512 + 512 = 2944; two layers 5888.
  Dense LoRA r(d_in + d_out): q 512, k/v 384, o 512, gate/up/down 768: 4096 per layer, 8192 in all.

And every TP-alignment check fails loudly, in one line, naming the module, the numbers and the fix.
"""

import pytest
import torch
from torch import nn

from bdlora_train import BlockDiagLoraConfig, BlockDiagLoraConfigError, build_tiny_model, get_peft_model
from bdlora_train.arch.plans import parallel_of, plan_style, tp_plan
from bdlora_train.arch.targets import (
    DENSE,
    PACKED,
    Request,
    Target,
    expert_mode,
    is_default,
    resolve_targets,
)
from bdlora_train.core.layout import Layout, role_of
from bdlora_train.core.roles import BD_A, BD_B, module_params
from bdlora_train.models import probe_model

L0 = "model.layers.0."


@pytest.fixture(scope="module")
def llama():
    return build_tiny_model("llama")


def _request(target_modules=None, r=4, **kwargs):
    return Request(target_modules=target_modules, rank_of=lambda name: r, **kwargs)


def _one_line(err, *parts):
    message = str(err)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, (part, message)


# ----------------------------------------------------------------------------------------- small helpers


@pytest.mark.parametrize(
    "value, mode", [("tp", "tp"), (True, "tp"), ("ep", "ep"), ("none", "none"), (False, "none"), (None, "none")]
)
def test_expert_mode(value, mode):
    assert expert_mode(value) == mode


@pytest.mark.parametrize("value", ["TP", "yes", 1])
def test_expert_mode_refuses_other_values(value):
    with pytest.raises(BlockDiagLoraConfigError) as info:
        expert_mode(value)
    _one_line(info.value, f"experts={value!r}", "use 'tp'", "'ep'", "False")


def test_is_default():
    assert is_default(None)
    assert is_default("all-linear") and is_default("ALL-LINEAR")
    assert is_default(["down_proj", "up_proj", "gate_proj", "o_proj", "v_proj", "k_proj", "q_proj"])  # any order
    assert not is_default(["q_proj", "v_proj"])
    assert not is_default(r".*q_proj")  # a regex is an explicit request


def test_target_params_and_stored_numbers():
    q = Layout("q", "colwise", BD_B, (64,), d_in=64, d_out=64)
    assert Target(q, 2, 4, PACKED).params == 384
    assert Target(q, 2, 4, PACKED).stored == 384
    assert Target(q, 2, 4, DENSE).stored == 512  # plus the 128 explicit zeros off the blocks
    down = Layout("down", "rowwise", BD_A, (128,), d_in=128, d_out=64)
    assert Target(down, 2, 4, PACKED).params == 512
    # Mixtral-style gate_up (E=4, 64 -> 128) at r=4, N=2: per expert 4*64 + 4*128/2 = 512, x4 experts
    gate_up = Layout("e.gate_up_proj", "packed_colwise", BD_B, (64, 64), d_in=64, d_out=128, experts=4)
    target = Target(gate_up, 2, 4, DENSE)
    assert (target.params, target.stored, target.kind, target.name) == (2048, 3072, "expert", "e.gate_up_proj")


# ------------------------------------------------------------------------------------------ resolve_targets


def test_default_request_adapts_every_projection_of_the_decoder_layers(llama):
    targets = resolve_targets(llama, _request(), nblocks=2)
    assert len(targets) == 14 and not any("lm_head" in name for name in targets)
    roles = {name[len(L0) :]: t.role for name, t in targets.items() if name.startswith(L0)}
    assert roles == {
        "self_attn.q_proj": "bd_b", "self_attn.k_proj": "bd_b", "self_attn.v_proj": "bd_b", "self_attn.o_proj": "bd_a",
        "mlp.gate_proj": "bd_b", "mlp.up_proj": "bd_b", "mlp.down_proj": "bd_a",
    }  # fmt: skip
    assert {t.storage for t in targets.values()} == {PACKED}
    assert sum(t.params for t in targets.values()) == 5888
    lay = [t.layout for t in targets.values()]
    assert sum(module_params(None, x.d_in, x.d_out, 4) for x in lay) == 8192  # LoRA at r=4


def test_the_paper_names_and_all_linear_are_the_default_request(llama):
    paper = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert resolve_targets(llama, _request(paper), 2).keys() == resolve_targets(llama, _request("all-linear"), 2).keys()


def test_explicit_names_adapt_exactly_those(llama):
    targets = resolve_targets(llama, _request(["q_proj", "down_proj"]), nblocks=2)
    assert sorted(targets) == [
        "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj",
        "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.q_proj",
    ]  # fmt: skip


def test_a_regex_request_is_a_full_match(llama):
    targets = resolve_targets(llama, _request(r".*\.0\.self_attn\.(q|v)_proj"), nblocks=2)
    assert sorted(targets) == [L0 + "self_attn.q_proj", L0 + "self_attn.v_proj"]


def test_keeps_leaves_modules_out(llama):
    targets = resolve_targets(llama, _request(keeps=lambda name: ".1." not in name), nblocks=2)
    assert len(targets) == 7 and all(name.startswith(L0) for name in targets)


def test_a_name_that_matches_nothing_fails_with_what_would_be_adapted(llama):
    with pytest.raises(BlockDiagLoraConfigError) as info:
        resolve_targets(llama, _request(["q_proj", "qkv_proj"]), nblocks=2)
    _one_line(info.value, "['qkv_proj'] match no module of llama", "would adapt ['self_attn.q_proj']", "leave")


def test_rank_of_a_module_must_split_into_the_blocks(llama):
    with pytest.raises(BlockDiagLoraConfigError) as info:
        resolve_targets(llama, _request(["q_proj"], r=3), nblocks=2)
    _one_line(info.value, "q_proj: r=3 is not a multiple of nblocks=2", "use r=2 or r=4")


def test_nblocks_above_the_kv_heads_is_refused_only_when_a_target_produces_kv_channels(llama):
    targets = resolve_targets(llama, _request(["q_proj", "o_proj"]), nblocks=4)  # 4 heads split in 4: fine
    assert {t.nblocks for t in targets.values()} == {4}
    with pytest.raises(BlockDiagLoraConfigError) as info:
        resolve_targets(llama, _request(["q_proj", "k_proj"]), nblocks=4)
    _one_line(info.value, "nblocks=4 does not divide num_key_value_heads=2", "use nblocks in [1, 2]")


def test_explicit_roles_beat_the_plan(llama):
    targets = resolve_targets(llama, _request(["o_proj"], roles={"o_proj": "bd_b"}), nblocks=2)
    o = targets[L0 + "self_attn.o_proj"]
    assert (o.role, o.layout.factor, o.layout.style) == ("bd_b", "B", "colwise")


def test_a_linear_outside_the_plan_needs_a_role():
    class WithHead(nn.Module):  # no config: no plan, no decoder
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

    with pytest.raises(BlockDiagLoraConfigError) as info:
        resolve_targets(WithHead(), _request(["proj"]), nblocks=2)
    _one_line(info.value, "proj: no tensor-parallel role", "roles={'proj': 'bd_b'}", "'bd_a'")
    targets = resolve_targets(WithHead(), _request(["proj"], roles={"proj": "bd_a"}), nblocks=2)
    assert targets["proj"].role == "bd_a" and targets["proj"].params == 4 * 8 // 2 + 4 * 8


def test_phi3_fused_projections_are_stored_dense_with_their_segments():
    targets = resolve_targets(build_tiny_model("phi3"), _request(), nblocks=2, probe_model=probe_model)
    qkv = targets[L0 + "self_attn.qkv_proj"]
    assert (qkv.storage, qkv.layout.segments) == (DENSE, (64, 32, 32))
    assert targets[L0 + "self_attn.o_proj"].storage == PACKED  # not fused: PEFT's packed BD-LoRA
    # qkv 64 -> 128 at r=4, N=2: 4*64 + 4*128/2 = 512 free, 4*(64 + 128) = 768 stored
    assert (qkv.params, qkv.stored) == (512, 768)


def test_mixtral_experts_are_adapted_per_expert_and_everything_is_stored_dense():
    mixtral = build_tiny_model("mixtral")
    targets = resolve_targets(mixtral, _request(), nblocks=2)
    gate_up = targets[L0 + "mlp.experts.gate_up_proj"]
    assert (gate_up.kind, gate_up.role, gate_up.nblocks, gate_up.layout.experts) == ("expert", "bd_b", 2, 4)
    assert gate_up.params == 4 * (4 * 64 + 4 * 128 // 2)  # 4 experts of 64 -> 128
    assert {t.storage for t in targets.values()} == {DENSE}  # PEFT cannot mix use_bdlora and target_parameters
    ep = resolve_targets(mixtral, _request(experts="ep"), nblocks=2)
    assert ep[L0 + "mlp.experts.gate_up_proj"].nblocks == 1  # whole experts per rank: dense per expert
    assert ep[L0 + "self_attn.q_proj"].nblocks == 2
    none = resolve_targets(mixtral, _request(experts="none"), nblocks=2)
    assert not any("experts" in name for name in none) and {t.storage for t in none.values()} == {PACKED}


def test_half_of_a_fused_expert_pair_is_refused():
    with pytest.raises(BlockDiagLoraConfigError) as info:
        resolve_targets(build_tiny_model("mixtral"), _request(["gate_proj"]), nblocks=2)
    _one_line(info.value, "'gate_proj' is fused with ['up_proj']", "target all of ['gate_proj', 'up_proj'] or none")


# ----------------------------------------------------------------------------------------------------
# Every TP-alignment check fails loudly, in one line, naming the module, the numbers and the fix.

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
