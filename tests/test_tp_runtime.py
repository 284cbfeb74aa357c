"""tp/training.py's checks, on meta-device models (no process group): which targets TP training computes, with
which plan style, and the one-line refusals (no TP plan, expert parameters, fused projections, blocks that do not
split over the ranks). The sharded forward, the gather at save and the exactness against one process run under
torchrun in tests/test_tp_training.py."""

import pytest
from peft import LoraConfig

from bdlora_train.core.errors import TPError
from bdlora_train.models import meta_model, tiny_config
from bdlora_train.peft_seam.config import BlockDiagLoraConfig
from bdlora_train.peft_seam.resolve import resolve
from bdlora_train.tp.training import TRAINED_STYLES, check_tp_training


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


def test_families_tp_training_cannot_compute_are_refused_before_any_weight_loads():
    model, targets = _targets("phi3")  # fused qkv_proj / gate_up_proj: segment-aware blocks
    with pytest.raises(TPError, match="fused projection"):
        check_tp_training(model, targets, tp_size=2)
    model, targets = _targets("opt")  # transformers ships no TP plan for OPT (the toolkit's addition is not one)
    with pytest.raises(TPError, match="no tensor-parallel plan for opt"):
        check_tp_training(model, targets, tp_size=2)
