"""transformers' tensor-parallel plans: the style vocabulary, the plan of a config, a module's style and role.

The plan is the text model's `base_model_tp_plan` (transformers/distributed/tensor_parallel.py), plus
`PLAN_ADDITIONS` for families transformers ships without one (OPT, Bloom, MPT, Falcon, GPT-2) or where it leaves a
sharded layer out (Qwen2-MoE's shared expert, DeepSeek-V3's MLA up-projections). Plan patterns are written relative
to the text model and anchored, so a vision tower's `encoder.layers.0.self_attn.q_proj` never matches the text
model's `layers.*.self_attn.q_proj`.
"""

from __future__ import annotations

import re

from bdlora_train.core.heads import text_config
from bdlora_train.core.layout import COLUMN, ROW
from bdlora_train.core.naming import family_name

# transformers' styles (transformers/distributed/tensor_parallel.py) -> which side of a Linear TP splits.
COLUMN_STYLES = ("colwise", "colwise_gather_output", "colwise_rep", "packed_colwise")
ROW_STYLES = ("rowwise", "rowwise_split_input", "rowwise_rep")
GATHER_STYLES = ("colwise_gather_output", "colwise_rep")  # output all-gathered: the shard layout is not implied

# Families transformers ships without a TP plan, in its style vocabulary. Attention projections whose modeling code
# views them with the global head count (OPT, Bloom, MPT, Falcon) gather their output and split the next layer's
# input, as transformers does for Phi-3; the MLP is plain Megatron TP.
PLAN_ADDITIONS: dict[str, dict[str, str]] = {
    "opt": {
        "layers.*.self_attn.q_proj": "colwise_gather_output",
        "layers.*.self_attn.k_proj": "colwise_gather_output",
        "layers.*.self_attn.v_proj": "colwise_gather_output",
        "layers.*.self_attn.out_proj": "rowwise_split_input",
        "layers.*.fc1": "colwise",
        "layers.*.fc2": "rowwise",
    },
    "bloom": {
        "h.*.self_attention.query_key_value": "colwise_gather_output",
        "h.*.self_attention.dense": "rowwise_split_input",
        "h.*.mlp.dense_h_to_4h": "colwise",
        "h.*.mlp.dense_4h_to_h": "rowwise",
    },
    "mpt": {
        "blocks.*.attn.Wqkv": "colwise_gather_output",
        "blocks.*.attn.out_proj": "rowwise_split_input",
        "blocks.*.ffn.up_proj": "colwise",
        "blocks.*.ffn.down_proj": "rowwise",
    },
    "falcon": {
        "h.*.self_attention.query_key_value": "colwise_gather_output",
        "h.*.self_attention.dense": "rowwise_split_input",
        "h.*.mlp.dense_h_to_4h": "colwise",
        "h.*.mlp.dense_4h_to_h": "rowwise",
    },
    "gpt2": {
        "h.*.attn.c_attn": "colwise_gather_output",
        "h.*.attn.c_proj": "rowwise_split_input",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
    # DeepSeek MLA: transformers' plan covers only the MLP; vLLM shards the up-projections by head and o_proj by
    # input (q_a_proj / kv_a_proj_with_mqa, the low-rank down-projections, stay replicated: no role).
    "deepseek_v3": {
        "layers.*.self_attn.q_b_proj": "colwise",
        "layers.*.self_attn.kv_b_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
    },
    # transformers' plan leaves the shared expert replicated; vLLM shards it like a dense MLP.
    "qwen2_moe": {
        "layers.*.mlp.shared_expert.gate_proj": "colwise",
        "layers.*.mlp.shared_expert.up_proj": "colwise",
        "layers.*.mlp.shared_expert.down_proj": "rowwise",
    },
}




def model_type(model_config) -> str:
    return getattr(text_config(model_config), "model_type", None) or getattr(model_config, "model_type", "model")


def tp_plan(model_config) -> dict[str, str]:
    """The text model's TP plan: transformers' own plus `PLAN_ADDITIONS` (patterns relative to the text model)."""
    config = text_config(model_config)
    plan = getattr(config, "base_model_tp_plan", None) or getattr(type(config), "base_model_tp_plan", None) or {}
    return {**dict(plan), **PLAN_ADDITIONS.get(family_name(getattr(config, "model_type", None)), {})}


def _plan_regex(pattern: str) -> re.Pattern:
    body = r"\.".join(r"\d+" if part == "*" else re.escape(part) for part in pattern.split("."))
    return re.compile(rf"^(?:model\.)?{body}$")


def plan_style(relative_name: str, plan: dict[str, str]) -> str | None:
    """The plan style of a module/parameter named relative to the text model."""
    for pattern, style in plan.items():
        if _plan_regex(pattern).match(relative_name):
            return style
    return None


def parallel_of(style: str | None) -> str | None:
    """Which side of a Linear the style splits: COLUMN (output), ROW (input) or None."""
    if style in COLUMN_STYLES:
        return COLUMN
    if style in ROW_STYLES:
        return ROW
    return None

