"""arch.checks (every alignment check: one passing case, one refusal naming the value and the fix), arch.scope
(the decoder, routers, consumers, ModelView) and arch.plan_layouts (TP layouts of Linears and expert parameters).

The tiny Llama: hidden 64, intermediate 128, 4 attention heads / 2 KV heads of 16 channels, 2 layers."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from bdlora_train.arch.checks import check_heads, check_module, check_segments, override_role, touches_kv_heads
from bdlora_train.arch.plan_layouts import column_segments, expert_layout, linear_layout, plan_layouts
from bdlora_train.arch.scope import ModelView, consumer_of, decoder_prefix, is_router
from bdlora_train.core.errors import BlockDiagLoraConfigError, BlockDiagLoraError, TPError
from bdlora_train.core.layout import COLUMN, ROW, Layout
from bdlora_train.core.roles import BD_A, BD_B
from bdlora_train.models import build_tiny_model, tiny_config

Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def llama():
    return build_tiny_model("llama")


def _one_line(err: BaseException, *parts: str) -> str:
    message = str(err)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, (part, message)
    return message


# ---------------------------------------------------------------------------------------------- check_module


def test_check_module_accepts_a_linear():
    check_module(Q, nn.Linear(64, 64))


def test_check_module_refuses_gpt2_conv1d():
    from transformers.pytorch_utils import Conv1D

    with pytest.raises(BlockDiagLoraConfigError) as info:
        check_module("transformer.h.0.attn.c_attn", Conv1D(192, 64))
    _one_line(info.value, "transformer.h.0.attn.c_attn", "Conv1D", "nn.Linear only", "target the model's Linear")


def test_check_module_refuses_a_non_linear():
    with pytest.raises(BlockDiagLoraConfigError) as info:
        check_module("model.embed_tokens", nn.Embedding(10, 4))
    _one_line(info.value, "model.embed_tokens", "Embedding is not an nn.Linear", "Linear layers only")


def test_check_module_refuses_a_linear_with_an_integer_weight():
    layer = nn.Linear(4, 4)
    layer.weight = nn.Parameter(torch.zeros(4, 4, dtype=torch.int8), requires_grad=False)
    with pytest.raises(BlockDiagLoraConfigError) as info:
        check_module(Q, layer)
    _one_line(info.value, Q, "quantized layer Linear", "load_in_4bit, load_in_8bit or torchao_int8")


def test_check_module_refuses_a_layer_class_from_a_quantization_library():
    gptq = type("QuantLinear", (nn.Linear,), {"__module__": "auto_gptq.nn_modules.qlinear"})
    with pytest.raises(BlockDiagLoraConfigError, match=r"quantized layer QuantLinear .*supports bitsandbytes 4-bit"):
        check_module(Q, gptq(4, 4))


# ----------------------------------------------------------------------------------------------- check_heads


def test_check_heads_accepts_a_degree_dividing_heads_and_kv_heads():
    config = tiny_config("llama")  # 4 heads, 2 KV heads
    check_heads(config, 1)
    check_heads(config, 2)
    check_heads(config, 4, kv=False)  # no adapted layer produces KV channels: only the 4 heads count


def test_check_heads_refuses_a_degree_above_the_kv_heads():
    with pytest.raises(BlockDiagLoraConfigError) as info:
        check_heads(tiny_config("llama"), 4)
    _one_line(info.value, "nblocks=4", "num_key_value_heads=2", "use nblocks in [1, 2]")


def test_check_heads_refuses_a_degree_not_dividing_the_attention_heads_with_the_caller_label_and_error():
    with pytest.raises(TPError) as info:
        check_heads(tiny_config("llama"), 3, label="tp", error=TPError, kv=False)
    _one_line(info.value, "tp=3", "num_attention_heads=4", "use tp in [1, 2]")


def test_check_heads_of_a_config_without_head_counts_checks_nothing():
    check_heads(SimpleNamespace(), 7)


# -------------------------------------------------------------------------------------------- check_segments


def _layout(segments, factor="B", experts=0, name=Q):
    split = sum(segments)
    return Layout(
        name,
        "colwise" if factor == "B" else "rowwise",
        BD_B if factor == "B" else BD_A,
        segments,
        d_in=64 if factor == "B" else split,
        d_out=split if factor == "B" else 64,
        experts=experts,
    )


def test_check_segments_accepts_divisible_rank_and_segments():
    check_segments(_layout((64,)), r=4, nblocks=2)
    check_segments(_layout((64, 32, 32)), r=8, nblocks=4)
    check_segments(_layout((128,), factor="A"), r=4, nblocks=4)


def test_check_segments_refuses_a_rank_the_blocks_cannot_split_and_names_the_nearest_ranks():
    with pytest.raises(BlockDiagLoraConfigError) as info:
        check_segments(_layout((64,)), r=6, nblocks=4)
    _one_line(info.value, Q, "r=6 is not a multiple of nblocks=4", "use r=4 or r=8")


def test_check_segments_refuses_an_indivisible_out_features_of_block_diagonal_b():
    with pytest.raises(BlockDiagLoraConfigError) as info:
        check_segments(_layout((66,)), r=4, nblocks=4)
    _one_line(info.value, Q, "out_features=66 of the block-diagonal B", "nblocks=4", "pick an nblocks that divides it")


def test_check_segments_names_in_features_for_block_diagonal_a():
    with pytest.raises(
        BlockDiagLoraConfigError, match=r"in_features=66 of the block-diagonal A is not divisible by nblocks=4"
    ):
        check_segments(_layout((66,), factor="A", name="model.layers.0.self_attn.o_proj"), r=4, nblocks=4)


def test_check_segments_refuses_a_fused_segment_the_blocks_cannot_split():
    # 34 is not a multiple of 4 (64 and 32 are)
    with pytest.raises(BlockDiagLoraConfigError) as info:
        check_segments(_layout((64, 32, 34)), r=4, nblocks=4)
    _one_line(info.value, "fused segments [64, 32, 34]", "nblocks=4", "pick an nblocks that divides each")


def test_check_segments_refuses_a_split_whose_total_divides_but_a_segment_does_not():
    # 6 + 10 = 16 divides into 4 blocks, but rank i must hold the i-th quarter of each segment
    with pytest.raises(BlockDiagLoraConfigError, match=r"fused segments \[6, 10\]"):
        check_segments(_layout((6, 10)), r=4, nblocks=4)


def _expert_refusal() -> str:
    with pytest.raises(BlockDiagLoraConfigError) as info:
        check_segments(_layout((66,), experts=4, name="model.layers.0.mlp.experts.down_proj"), r=4, nblocks=4)
    return str(info.value)


def test_check_segments_of_an_expert_parameter_names_the_tp_split_dimension():
    message = _expert_refusal()
    assert message.startswith("model.layers.0.mlp.experts.down_proj: the dimension TP splits=66")
    assert "of the block-diagonal B is not divisible by nblocks=4; pick an nblocks that divides it" in message


def test_check_segments_of_an_expert_parameter_says_the_value_once():
    assert _expert_refusal().count("66") == 1


# --------------------------------------------------------------------------------------------- override_role


def test_override_role_matches_dotted_suffixes():
    assert override_role(Q, None) is None
    assert override_role(Q, {}) is None
    assert override_role(Q, {"q_proj": "bd_b"}) == "bd_b"
    assert override_role(Q, {"self_attn.q_proj": "bd_a", "o_proj": "bd_b"}) == "bd_a"
    assert override_role(Q, {"proj": "bd_b"}) is None  # not a dotted suffix: no match (unlike use_bdlora patterns)


def test_override_role_refuses_an_unknown_role():
    with pytest.raises(BlockDiagLoraConfigError) as info:
        override_role(Q, {"q_proj": "bd_c"})
    _one_line(info.value, Q, "unknown role ['bd_c']", "use 'bd_a' (row-parallel) or 'bd_b' (column-parallel)")


def test_override_role_refuses_a_name_matched_by_both_roles():
    with pytest.raises(BlockDiagLoraConfigError) as info:
        override_role(Q, {"q_proj": "bd_a", "self_attn.q_proj": "bd_b"})
    _one_line(info.value, Q, "matched by both", "make the patterns disjoint")


# ------------------------------------------------------------------------------------------ touches_kv_heads


def _target(d_out, parallel=COLUMN, segments=None, experts=0):
    role = BD_B if parallel == COLUMN else BD_A
    return SimpleNamespace(
        layout=Layout("x", "colwise", role, segments or (d_out,), d_in=64, d_out=d_out, experts=experts)
    )


def test_touches_kv_heads_only_for_outputs_holding_key_value_channels():
    config = tiny_config("llama")  # KV channels: 2 heads x 16 = 32; fused q|k|v: (4 + 2 + 2) x 16 = 128
    assert touches_kv_heads(config, [_target(32)])  # k_proj / v_proj
    assert touches_kv_heads(config, [_target(128)])  # fused qkv
    assert touches_kv_heads(config, [_target(160, segments=(64, 32, 64))])  # a segment of KV width
    assert not touches_kv_heads(config, [_target(64)])  # q_proj
    assert not touches_kv_heads(config, [_target(32, parallel=ROW)])  # row-parallel: its output is not split
    assert not touches_kv_heads(config, [_target(32, experts=4)])  # expert parameters hold no heads
    assert not touches_kv_heads(config, [])


def test_touches_kv_heads_without_gqa_is_always_true():
    assert touches_kv_heads(tiny_config("llama", num_key_value_heads=4), [_target(64)])


# --------------------------------------------------------------------------------------------------- scope


def test_decoder_prefix_of_a_causal_lm_and_of_a_bare_decoder(llama):
    from transformers import LlamaModel

    assert decoder_prefix(llama) == "model"
    assert decoder_prefix(LlamaModel(tiny_config("llama"))) == ""


def test_decoder_prefix_of_a_multimodal_model_is_its_language_model():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("gemma3"))
    prefix = decoder_prefix(model)
    assert prefix and "vision" not in prefix
    assert hasattr(model.get_submodule(prefix), "layers") and len(model.get_submodule(prefix).layers) == 2


@pytest.mark.parametrize(
    "name, module, expected",
    [
        ("model.layers.0.mlp.gate", nn.Linear(64, 4), True),  # scores of the 4 experts
        ("model.layers.0.mlp.shared_expert_gate", nn.Linear(64, 1), True),  # one gate value
        ("model.layers.0.mlp.router", nn.Linear(64, 4), True),
        ("model.layers.0.mlp.gate_proj", nn.Linear(64, 128), False),  # an MLP projection called gate
        ("model.layers.0.mlp.up_proj", nn.Linear(64, 4), False),  # expert-count width, but not a gate
        ("model.layers.0.mlp.gate", nn.Embedding(4, 64), False),  # no out_features
    ],
)
def test_is_router(name, module, expected):
    assert is_router(name, module, SimpleNamespace(num_local_experts=4)) is expected


def test_consumer_of_is_the_row_parallel_sibling(llama):
    plan = ModelView(llama).plan
    assert consumer_of(Q, plan, llama, "model") == "model.layers.0.self_attn.o_proj"
    assert consumer_of("model.layers.1.mlp.gate_proj", plan, llama, "model") == "model.layers.1.mlp.down_proj"


def test_model_view_of_the_tiny_llama(llama):
    view = ModelView(llama)
    assert (view.family, view.prefix) == ("llama", "model")
    assert view.style(Q) == "colwise"
    assert view.style("model.layers.1.mlp.down_proj") == "rowwise"
    assert view.style("lm_head") is None  # outside the decoder
    assert view.in_layers(Q) and not view.in_layers("model.embed_tokens") and not view.in_layers("lm_head")
    assert view.short("model.layers.1.self_attn.k_proj") == "self_attn.k_proj"
    assert view.catalogue() == [
        "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj",
        "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj",
    ]  # fmt: skip
    assert view.experts == {}


def test_model_view_of_a_peft_model_sees_canonical_names_and_base_linears():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_tiny_model("llama"), LoraConfig(r=2, target_modules=["q_proj"]))
    view = ModelView(model)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert type(view.modules[q]) is nn.Linear
    assert not any(".lora_" in name or name.endswith(".base_layer") for name in view.modules)


def test_model_view_finds_mixtral_expert_parameters():
    view = ModelView(build_tiny_model("mixtral"))
    assert sorted(k for k in view.experts if ".0." in k) == [
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.experts.gate_up_proj",
    ]
    module, pname = view.experts["model.layers.0.mlp.experts.gate_up_proj"]
    assert pname == "gate_up_proj" and tuple(getattr(module, pname).shape) == (4, 128, 64)  # (E, 2 x 64, hidden)
    assert view.style("model.layers.0.mlp.experts.gate_up_proj") == "packed_colwise"


# -------------------------------------------------------------------------------------------------- layouts


def test_linear_layout_by_style():
    col = linear_layout("k", nn.Linear(64, 32), "colwise")
    assert (col.parallel, col.factor, col.segments, col.d_in, col.d_out) == (COLUMN, "B", (32,), 64, 32)
    row = linear_layout("down", nn.Linear(128, 64), "rowwise")
    assert (row.parallel, row.factor, row.segments, row.d_in, row.d_out) == (ROW, "A", (128,), 128, 64)
    packed = linear_layout("gate_up", nn.Linear(64, 256), "packed_colwise")
    assert packed.segments == (128, 128) and packed.fused
    given = linear_layout("qkv", nn.Linear(64, 128), "colwise_gather_output", (64, 32, 32))
    assert given.segments == (64, 32, 32)


class _Experts(nn.Module):
    def __init__(self, shape, transposed=False):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(shape))
        self.is_transposed = transposed


def test_expert_layout_of_mixtral_style_parameters():
    # gate_up (E, 2 x inter, hidden) = (4, 128, 64) read as (E, out, in); packed_colwise splits dim 1 in halves
    gate_up = _Experts((4, 128, 64))
    lay = expert_layout("e.w", gate_up, gate_up.w, "packed_colwise")
    assert (lay.parallel, lay.factor, lay.segments, lay.d_in, lay.d_out, lay.experts) == (
        COLUMN, "B", (64, 64), 64, 128, 4,
    )  # fmt: skip
    # down (E, hidden, inter) = (4, 64, 32); rowwise splits dim 2 (the input): block-diagonal A
    down = _Experts((4, 64, 32))
    lay = expert_layout("e.w", down, down.w, "rowwise")
    assert (lay.parallel, lay.factor, lay.segments, lay.d_in, lay.d_out) == (ROW, "A", (32,), 32, 64)


def test_expert_layout_of_a_transposed_experts_module():
    # stored (E, in, out) = (4, 64, 128): dim 2 is the output, so a split of dim 2 makes B block-diagonal
    gate_up = _Experts((4, 64, 128), transposed=True)
    lay = expert_layout("e.w", gate_up, gate_up.w, "packed_rowwise")
    assert (lay.parallel, lay.factor, lay.segments, lay.d_in, lay.d_out) == (COLUMN, "B", (64, 64), 64, 128)


def test_expert_layout_is_none_for_unsharded_styles_or_2d_parameters():
    experts = _Experts((4, 64, 32))
    assert expert_layout("e.w", experts, experts.w, "moe_tp_experts") is None
    assert expert_layout("e.w", experts, torch.zeros(64, 32), "rowwise") is None


def test_column_segments_of_a_plain_colwise_layer_is_contiguous(llama):
    view = ModelView(llama)
    assert column_segments(view, Q, view.modules[Q], "colwise") is None


def test_plan_layouts_of_the_tiny_llama(llama):
    layouts = plan_layouts(llama)
    assert len(layouts) == 14  # 7 projections x 2 layers
    k = layouts["model.layers.0.self_attn.k_proj"]
    assert (k.factor, k.segments, k.d_in, k.d_out) == ("B", (32,), 64, 32)
    down = layouts["model.layers.1.mlp.down_proj"]
    assert (down.factor, down.segments, down.d_in, down.d_out) == ("A", (128,), 128, 64)
    assert "lm_head" not in layouts


def test_plan_layouts_of_phi3_probes_the_fused_layouts():
    from bdlora_train.models import probe_model

    phi3 = build_tiny_model("phi3")
    # gather-output qkv of width 128: q|k|v, gate|up or contiguous
    with pytest.raises(BlockDiagLoraConfigError) as info:
        plan_layouts(phi3)
    _one_line(info.value, "qkv_proj", "width 128", "drop it from target_modules")
    layouts = plan_layouts(phi3, probe_model)
    assert layouts["model.layers.0.self_attn.qkv_proj"].segments == (64, 32, 32)  # q 4x16, k 2x16, v 2x16
    assert layouts["model.layers.0.mlp.gate_up_proj"].segments == (128, 128)  # gate | up, 128 each
    assert layouts["model.layers.0.mlp.down_proj"].segments == (128,)


def test_every_check_error_is_a_bdlora_error():
    assert issubclass(BlockDiagLoraConfigError, BlockDiagLoraError) and issubclass(TPError, BlockDiagLoraError)
