"""tp_runtime/preflight.py's checks, on meta-device models (no process group): which targets TP training computes, with
which plan style, and the one-line refusals (no TP plan, no EP plan, blocks or experts that do not split over the
ranks); tp_runtime/pieces.py's rank-local pieces against hand-written indices. The sharded forward,
the gather at save and the exactness against one process run under torchrun in tests/tp_runtime/test_tp_training.py."""

import pytest
import torch
from peft import LoraConfig

from bdlora_train.core.errors import TPError
from bdlora_train.models import meta_model, tiny_config
from bdlora_train.peft_integration.config import BlockDiagLoraConfig
from bdlora_train.peft_integration.resolve import resolve
from bdlora_train.tp_runtime.dispatch import MODIFIED_IN_PLACE
from bdlora_train.tp_runtime.pieces import expert_pieces, factor_pieces
from bdlora_train.tp_runtime.preflight import check_ep_model, check_tp_training
from bdlora_train.tp_runtime.styles import EXPERT_PARALLEL, REPLICATED, TRAINED_STYLES


def _targets(model_type: str, nblocks: int = 2, r: int = 4, method: str = "bdlora", **config):
    model = meta_model(tiny_config(model_type, **config))
    config = BlockDiagLoraConfig(r=r, nblocks=nblocks) if method == "bdlora" else LoraConfig(r=r)
    if method != "bdlora":
        config.target_modules = BlockDiagLoraConfig(r=r, nblocks=nblocks).target_modules
    return model, resolve(model, config, nblocks)


def test_llama_trains_every_projection_in_transformers_own_styles():
    model, targets = _targets("llama")
    styles = check_tp_training(model, targets, tp_size=2)
    assert len(styles) == 7 * model.config.num_hidden_layers
    kinds = {name.rsplit(".", 1)[-1]: style for name, style in styles.items()}
    # transformers' LlamaConfig.base_model_tp_plan: Megatron column-parallel q/k/v/gate/up, row-parallel o/down
    assert kinds == {
        "q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "gate_proj": "colwise", "up_proj": "colwise",
        "o_proj": "rowwise", "down_proj": "rowwise",
    }  # fmt: skip
    assert set(kinds.values()) <= set(TRAINED_STYLES)


def test_blocks_that_do_not_split_over_the_ranks_are_refused_in_one_line():
    heads = dict(num_attention_heads=4, num_key_value_heads=4)  # 4 KV heads: TP 4 splits the heads
    model, targets = _targets("llama", nblocks=2, r=4, **heads)
    with pytest.raises(TPError) as info:
        check_tp_training(model, targets, tp_size=4)  # 4 ranks, 2 blocks: a rank would hold half a block
    text = str(info.value)
    assert "\n" not in text and "tp_size=4" in text and "nblocks=2" in text
    # plain LoRA has no blocks: the same degree passes
    model, targets = _targets("llama", nblocks=2, r=4, method="lora", **heads)
    assert len(check_tp_training(model, targets, tp_size=4, block_diagonal=False)) == 14


def _layer0(styles: dict) -> dict:
    return {name.split("layers.0.", 1)[1]: style for name, style in styles.items() if "layers.0." in name}


def test_moe_and_fused_families_train_in_their_own_plan_styles():
    from bdlora_train.arch.scope import split_experts

    # the experts packed column-parallel (gate|up) and row-parallel, as transformers' plans said through 5.24; 5.25
    # names no expert entry (experts shard only by EP): a TP run adds the entries (split_experts), and without them
    # TP alone would leave the experts whole on every rank
    gate_up, down = "packed_colwise", "rowwise"
    model, targets = _targets("qwen3_moe")
    entries = split_experts(model)
    assert entries in ({}, {"model.layers.*.mlp.experts.gate_up_proj": gate_up,
                            "model.layers.*.mlp.experts.down_proj": down,
                            "model.layers.*.mlp.experts": "moe_tp_experts"})  # {}: the installed plan has them
    kinds = _layer0(check_tp_training(model, targets, 2))
    assert kinds["mlp.experts.gate_up_proj"] == gate_up and kinds["mlp.experts.down_proj"] == down
    assert kinds["self_attn.q_proj"] == "colwise" and kinds["self_attn.o_proj"] == "rowwise"
    # the expert factors' block-diagonal roles are the served ones either way (arch/plans.py): B on gate_up, A on down
    assert targets["model.layers.0.mlp.experts.gate_up_proj"].role == "bd_b"
    assert targets["model.layers.0.mlp.experts.down_proj"].role == "bd_a"
    model, targets = _targets("qwen2_moe")  # its plan names mlp.gate_proj, not the shared expert's: left whole
    split_experts(model)
    kinds = _layer0(check_tp_training(model, targets, 2))
    assert kinds["mlp.shared_expert.down_proj"] == REPLICATED and kinds["mlp.experts.gate_up_proj"] == gate_up
    model, targets = _targets("phi3")  # fused [q | k | v] and [gate | up], output gathered
    kinds = {n.rsplit(".", 1)[-1]: style for n, style in check_tp_training(model, targets, 2).items()}
    assert kinds["qkv_proj"] == kinds["gate_up_proj"] == "colwise_gather_output"


def test_pieces_hold_each_ranks_entries():
    # a fused B (d_out 8 = [gate 4 | up 4], r 2) over 2 ranks: rank 0 holds rows 0,1 (gate) and 4,5 (up), column 0
    piece_a, piece_b = factor_pieces((2, 3), (8, 2), (4, 4), r=2, world=2, experts=0, factor="B", block_diagonal=True)
    assert piece_b.rows[0].tolist() == [0, 1, 4, 5] and piece_b.rows[1].tolist() == [2, 3, 6, 7]
    assert piece_b.cols[0].tolist() == [0] and piece_b.cols[1].tolist() == [1]
    assert piece_a.rows[0].tolist() == [0] and piece_a.cols[0] is None
    # expert factors, E 2, r 4, 2 ranks: A's rows e*r + j (rank 0: j 0,1 of each expert), B's columns j*E + e
    piece_a, piece_b = factor_pieces((8, 6), (6, 8), (6,), r=4, world=2, experts=2, factor="A", block_diagonal=True)
    assert piece_a.rows[0].tolist() == [0, 1, 4, 5] and piece_a.cols[1].tolist() == [3, 4, 5]
    assert piece_b.rows[0] is None and piece_b.cols[1].tolist() == [4, 5, 6, 7]
    full = torch.arange(48.0).view(8, 6)
    packed = piece_a.pack(full)
    assert packed.shape == (2, 4, 3) and packed[1, 0].tolist() == [15.0, 16.0, 17.0]  # row 2, columns 3..5
    back = piece_a.unpack(packed)
    assert back[2, 3] == 15.0 and back[2, 0] == 0.0  # off the pieces: zero (the off-block entries)
    # plain LoRA: the factor along the split is sliced, the other replicated
    assert factor_pieces((2, 6), (8, 2), (8,), 2, 2, 0, "B", block_diagonal=False)[0] is None


def test_expert_parallel_pieces_hold_whole_experts():
    # E 4, r 2 over 2 EP ranks: rank 1 holds experts 2 and 3 - A's rows 4..7, B's columns j*E + e = 2, 3, 6, 7
    piece_a, piece_b = expert_pieces((8, 5), (3, 8), r=2, experts=4, world=2)
    assert piece_a.rows[0].tolist() == [0, 1, 2, 3] and piece_a.rows[1].tolist() == [4, 5, 6, 7]
    assert piece_a.cols[1] is None and piece_b.rows[1] is None
    assert piece_b.cols[0].tolist() == [0, 1, 4, 5] and piece_b.cols[1].tolist() == [2, 3, 6, 7]
    full = torch.arange(24.0).view(3, 8)
    assert torch.equal(piece_b.unpack(piece_b.pack(full)), full)  # every entry on exactly one rank
    with pytest.raises(ValueError, match="not 4 experts of rank 4"):  # a rank that is not PEFT's: never sliced
        expert_pieces((8, 5), (3, 8), r=4, experts=4, world=2)


def test_expert_parallel_styles_and_refusals_before_any_weight_loads():
    model, targets = _targets("qwen3_moe")
    check_ep_model(model, 2)
    kinds = _layer0(check_tp_training(model, targets, tp_size=1, ep_size=2))
    # EP alone: whole experts per rank; attention trains data-parallel (no style: PEFT's own layer)
    assert kinds == {"mlp.experts.gate_up_proj": EXPERT_PARALLEL, "mlp.experts.down_proj": EXPERT_PARALLEL}
    kinds = _layer0(check_tp_training(model, targets, tp_size=2, ep_size=2))  # TP attention, EP experts
    assert kinds["self_attn.q_proj"] == "colwise" and kinds["mlp.experts.down_proj"] == EXPERT_PARALLEL
    with pytest.raises(TPError, match=r"ep_size=3 does not divide the 4 experts of qwen3_moe: .* ep_size in \[2, 4\]"):
        check_ep_model(model, 3)
    with pytest.raises(TPError, match="no expert-parallel plan for llama"):
        check_ep_model(meta_model(tiny_config("llama")), 2)
    dense = {name: t for name, t in targets.items() if t.kind != "expert"}
    with pytest.raises(TPError, match="ep_size=2 but the adapter adapts no expert parameter"):
        check_tp_training(model, dense, tp_size=1, ep_size=2)


def test_the_in_place_adds_the_tp_runtime_copies_for_are_still_in_transformers():
    """tp_runtime/dispatch.py copies the output of each MODIFIED_IN_PLACE child because transformers' forward of the
    parent
    adds into it in place (autograd refuses that on a TP layer's output); if transformers stops, the copy can go."""
    import inspect

    from transformers.models.llama4 import modeling_llama4

    for parent, child in MODIFIED_IN_PLACE.items():
        source = inspect.getsource(getattr(modeling_llama4, parent).forward)
        assert f"out = self.{child}(" in source and "out.add_(" in source


def test_a_family_without_a_tp_plan_is_refused_before_any_weight_loads():
    model, targets = _targets("opt")  # transformers ships no TP plan for OPT (the toolkit's addition is not one)
    with pytest.raises(TPError, match="no tensor-parallel plan for opt"):
        check_tp_training(model, targets, tp_size=2)


def test_nblocks_a_refusal_suggests_pass_every_rule():
    """tp_size=2 nblocks=4 on the tiny Llama (4 heads, 2 KV heads): 4 is a multiple of 2 but cannot split 2 KV heads;
    the one line suggests only nblocks=2 (1 is no multiple of tp_size, 4 splits no KV head)."""
    from bdlora_train.tp_runtime.preflight import check_tp_blocks

    model = meta_model(tiny_config("llama"))
    with pytest.raises(TPError) as info:
        check_tp_blocks(model, 2, 4, 8)
    assert str(info.value) == (
        "recipe: nblocks=4 does not split the 4 attention / 2 KV heads: blocks must hold whole heads; use nblocks=2 "
        "(or drop it: it defaults to tp_size=2)"
    )
    check_tp_blocks(model, 2, 2, 8)  # passes
