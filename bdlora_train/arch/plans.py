"""transformers' tensor-parallel plans: the style vocabulary, the plan of a config, a module's style and role.

The plan is the text model's `base_model_tp_plan` (transformers/distributed/tensor_parallel.py), plus
`PLAN_ADDITIONS` for families transformers ships without one (OPT, Bloom, MPT, Falcon, GPT-2) or where it leaves a
sharded layer out (Qwen2-MoE's shared expert, DeepSeek-V3's MLA up-projections), and `EXPERTS_SERVED_BY_TP` (the
MoE experts, which transformers 5.25's plans leave out; `expert_tp_entries` gives a TP run the entries that split
them). Plan patterns are written relative to the text model and
anchored, so a vision tower's `encoder.layers.0.self_attn.q_proj` never matches the text
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

# MoE experts as vLLM serves them under TP (FusedMoE, not expert-parallel): every rank holds the i-th 1/N of each
# expert's intermediate dimension, so `gate_up_proj` (E, 2I, H) splits its gate and up halves by output
# (`packed_colwise`: BD-B) and `down_proj` (E, H, I) by input (`rowwise`: BD-A). transformers' own plans said so
# through 5.24; 5.25 dropped these entries (its experts shard only through the EP plan, and the `moe_tp_experts`
# style is deprecated), so the roles are given here, {family: the experts module's parent under `layers.*`}.
# A TP training run loads the base with those entries added (`expert_tp_entries`, arch/scope.py `split_experts`), so
# the experts split under TP on 5.25 as through 5.24. Llama-4 (experts stored transposed) keeps its own entries.
EXPERTS_SERVED_BY_TP = {
    **dict.fromkeys(
        (
            "mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_vl_moe_text", "deepseek_v2", "deepseek_v3",
            "olmoe", "flex_olmo", "phimoe", "glm4_moe", "glm4v_moe_text", "minimax", "ernie4_5_moe",
            "hunyuan_v1_moe", "dots1", "longcat_flash", "afmoe",
        ),
        "mlp",
    ),
    **dict.fromkeys(("granitemoe", "granitemoeshared", "granitemoehybrid"), "block_sparse_moe"),
    **dict.fromkeys(("jamba", "lfm2_moe"), "feed_forward"),
}


def _served_experts(family: str | None) -> dict[str, str]:
    parent = EXPERTS_SERVED_BY_TP.get(family)
    if parent is None:
        return {}
    experts = f"layers.*.{parent}.experts"
    return {f"{experts}.gate_up_proj": "packed_colwise", f"{experts}.down_proj": "rowwise"}


def expert_tp_entries(model_config) -> dict[str, str]:
    """The plan entries that split the experts under TP where the installed transformers' plan has none (5.25 dropped
    them: its experts shard only through the EP plan, and under `tp_size` alone every rank held every expert whole):
    each rank holds the i-th 1/N of every expert's intermediate dimension, as through 5.24 and as vLLM serves them
    (`packed_colwise` gate_up, `rowwise` down, and `moe_tp_experts`, the style that all-reduces the experts' partial
    output, which transformers 5.25 still runs for Llama-4; deprecated for removal in 5.28). Patterns relative to the
    text model; {} for a family without routed experts or whose plan already splits them."""
    config = text_config(model_config)
    plan = getattr(config, "base_model_tp_plan", None) or {}
    entries = _served_experts(family_name(getattr(config, "model_type", None)))
    if not entries or any(".experts" in key for key in plan):
        return {}
    experts = next(iter(entries)).rsplit(".", 1)[0]
    return {**entries, experts: "moe_tp_experts"}


def model_type(model_config) -> str:
    return getattr(text_config(model_config), "model_type", None) or getattr(model_config, "model_type", "model")


def tp_plan(model_config) -> dict[str, str]:
    """The text model's TP plan: transformers' own plus `PLAN_ADDITIONS` and the served experts' entries (patterns
    relative to the text model)."""
    config = text_config(model_config)
    plan = getattr(config, "base_model_tp_plan", None) or getattr(type(config), "base_model_tp_plan", None) or {}
    family = family_name(getattr(config, "model_type", None))
    return {**dict(plan), **PLAN_ADDITIONS.get(family, {}), **_served_experts(family)}


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

