"""Which LoRA factor is block-diagonal in each module, taken from the model's tensor-parallel plan.

Column-parallel layers (q, k, v, gate, up) get a block-diagonal B; row-parallel layers (o, down) a
block-diagonal A. The plan comes from transformers (`config.base_model_tp_plan`), so roles follow the
architecture rather than a list of names the user has to get right. Every check that keeps blocks aligned
with the TP shards of a serving engine lives here, and each failure is one line naming module, numbers, fix.
"""

from __future__ import annotations

import re

from torch import nn

from bdlora_train.errors import BlockDiagLoraError
from bdlora_train.patterns import BD_A, BD_B, ROLES, matches_name

__all__ = ["BD_A", "BD_B", "ROLES", "BlockDiagLoraError", "DEFAULT_TARGET_MODULES", "resolve_roles", "default_nblocks"]

# The paper's setup: every attention and MLP projection of the decoder layers.
DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Architectures whose transformers config has no `base_model_tp_plan`: the Megatron/vLLM sharding.
EXTRA_TP_PLANS = {
    "opt": {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.out_proj": "rowwise",
        "layers.*.fc1": "colwise",
        "layers.*.fc2": "rowwise",
    },
    "gpt2": {
        "h.*.attn.c_attn": "colwise",
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
    "falcon": {
        "h.*.self_attention.query_key_value": "colwise",
        "h.*.self_attention.dense": "rowwise",
        "h.*.mlp.dense_h_to_4h": "colwise",
        "h.*.mlp.dense_4h_to_h": "rowwise",
    },
}

# Fused projections: engines shard each segment (q|k|v, gate|up) separately, so contiguous blocks over the
# fused output would straddle shards. We refuse them rather than train blocks that cannot be served.
FUSED_PROJECTIONS = {"qkv_proj", "gate_up_proj", "c_attn", "query_key_value", "Wqkv", "W_pack", "qkv"}

_QUANTIZED_CLASS_HINTS = ("bitsandbytes", "gptq", "hqq", "awq", "aqlm", "eetq", "torchao", "quant")


def text_config(model_config):
    """The language model's config (multimodal configs nest it)."""
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def tp_plan(model_config) -> dict[str, str]:
    """The base model's TP plan: transformers' own, else our small registry, else {}."""
    config = text_config(model_config)
    plan = getattr(config, "base_model_tp_plan", None) or getattr(type(config), "base_model_tp_plan", None)
    if plan:
        return dict(plan)
    return dict(EXTRA_TP_PLANS.get(getattr(config, "model_type", None), {}))


def role_from_style(style: str) -> str | None:
    """transformers' plan style -> BD-LoRA role ("colwise*" -> bd_b, "rowwise*" -> bd_a)."""
    if style.startswith("colwise") or style == "packed_colwise":
        return BD_B
    if style.startswith("rowwise"):
        return BD_A
    return None


def _plan_regex(pattern: str) -> re.Pattern:
    body = r"\.".join(r"\d+" if part == "*" else re.escape(part) for part in pattern.split("."))
    return re.compile(rf"(?:^|\.){body}$")


def plan_role(name: str, plan: dict[str, str]) -> str | None:
    for pattern, style in plan.items():
        if _plan_regex(pattern).search(name):
            return role_from_style(style)
    return None


def _qualname(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__name__}".lower()


def _is_quantized(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    if any(hint in _qualname(module) or hint in _qualname(weight) for hint in _QUANTIZED_CLASS_HINTS):
        return True  # the layer class or its weight's tensor subclass (torchao) comes from a quantization library
    return weight is not None and not weight.dtype.is_floating_point


def check_module(name: str, module: nn.Module) -> None:
    """Refuse module types where BD-LoRA would be wrong or silently vanilla LoRA."""
    from bdlora_train.quant.detect import quant_kind

    leaf = name.rsplit(".", 1)[-1]
    kind = type(module).__name__
    if quant_kind(module) is None and _is_quantized(module):  # bnb 4/8-bit, torchao int8 have BD layers (quant/)
        raise BlockDiagLoraError(
            f"{name}: quantized layer {kind} ({type(getattr(module, 'weight', None)).__name__} weight) - BD-LoRA "
            "supports bitsandbytes 4-bit / 8-bit and torchao int8 weight-only bases only (docs/quantization.md); "
            "load the base with load_in_4bit, load_in_8bit or torchao_int8, or unquantized"
        )
    if kind == "Conv1D":
        raise BlockDiagLoraError(
            f"{name}: GPT-2 style Conv1D layer - BD-LoRA supports nn.Linear only; target the model's Linear projections"
        )
    if leaf in FUSED_PROJECTIONS:
        raise BlockDiagLoraError(
            f"{name}: fused projection '{leaf}' - TP engines shard each fused segment separately, so contiguous "
            "blocks would not line up with TP shards; use a model with separate projections or drop it from "
            "target_modules"
        )
    if not isinstance(module, nn.Linear):
        raise BlockDiagLoraError(f"{name}: {kind} is not an nn.Linear - BD-LoRA supports Linear layers only")


def head_counts(model_config) -> tuple[int | None, int | None]:
    """(attention heads, KV heads) of the language model; KV heads default to the attention heads (no GQA)."""
    config = text_config(model_config)
    n_heads = getattr(config, "num_attention_heads", None)
    return n_heads, getattr(config, "num_key_value_heads", None) or n_heads


def head_divisors(model_config, limit: int | None = None) -> list[int]:
    """Degrees (<= limit) that split both the attention and the KV heads evenly: the TP degrees that line up."""
    n_heads, kv_heads = head_counts(model_config)
    if n_heads is None:
        return list(range(1, (limit or 1) + 1))
    top = min(kv_heads, limit) if limit else kv_heads
    return [d for d in range(1, top + 1) if kv_heads % d == 0 and n_heads % d == 0]


# TP degrees the default nblocks is chosen from: common serving degrees, all dividing the default rank 24.
DEFAULT_NBLOCKS_CHOICES = (8, 6, 4, 3, 2, 1)


def default_nblocks(model_config) -> int:
    """The largest of 8, 6, 4, 3, 2, 1 that splits both attention and KV heads: 8 for Llama-3.1, 4 for Qwen2.5-7B
    (4 KV heads), 3 for SmolLM2-135M (9 / 3), 2 for the tiny test models (4 / 2)."""
    divisors = set(head_divisors(model_config, limit=8))
    return next(d for d in DEFAULT_NBLOCKS_CHOICES if d in divisors)


def check_heads(model_config, degree: int, label: str = "nblocks", error: type[Exception] = BlockDiagLoraError) -> None:
    """`degree` (nblocks, or a TP degree) must divide the attention and KV heads, or engines replicate KV heads."""
    n_heads, kv_heads = head_counts(model_config)
    for key, value in (("num_attention_heads", n_heads), ("num_key_value_heads", kv_heads)):
        if value is not None and value % degree:
            raise error(
                f"{label}={degree} does not divide {key}={value}: TP shards would split heads "
                f"(or replicate KV heads) and blocks would not line up; use {label} in {head_divisors(model_config)}"
            )


def check_shape(name: str, role: str, in_features: int, out_features: int, r: int, nblocks: int) -> None:
    if r % nblocks:
        raise BlockDiagLoraError(
            f"{name}: rank r={r} is not a multiple of nblocks={nblocks}; use r={max(nblocks, r - r % nblocks)} "
            f"or r={r + nblocks - r % nblocks}"
        )
    features, label = (out_features, "out_features") if role == BD_B else (in_features, "in_features")
    if features % nblocks:
        raise BlockDiagLoraError(
            f"{name}: {label}={features} of the block-diagonal {'B' if role == BD_B else 'A'} is not divisible by "
            f"nblocks={nblocks}; pick an nblocks that divides it"
        )


def override_role(name: str, overrides: dict[str, str] | None) -> str | None:
    """Explicit user roles; a name matched by patterns of both roles is an error."""
    if not overrides:
        return None
    hits = {role for pattern, role in overrides.items() if matches_name(name, pattern)}
    bad = hits - set(ROLES)
    if bad:
        raise BlockDiagLoraError(
            f"{name}: unknown role {sorted(bad)} in roles; use 'bd_a' (row-parallel) or 'bd_b' (column-parallel)"
        )
    if len(hits) > 1:
        raise BlockDiagLoraError(
            f"{name}: matched by both a 'bd_a' and a 'bd_b' pattern in roles; make the patterns disjoint"
        )
    return hits.pop() if hits else None


def resolve_roles(
    model: nn.Module, peft_config, nblocks: int, overrides: dict[str, str] | None = None
) -> dict[str, str]:
    """Role of every module `peft_config` targets in `model`, after every TP-alignment check.

    Targets are matched with PEFT's own matcher (exact names or dotted suffixes, layers_to_transform, exclude).
    Works on meta-device models: only module types and shapes are read.
    """
    from peft.tuners.tuners_utils import check_target_module_exists

    plan = tp_plan(model.config) if hasattr(model, "config") else {}
    roles: dict[str, str] = {}
    for name, module in model.named_modules():
        if not name or not check_target_module_exists(peft_config, name):
            continue
        if ".lora_" in name or name.endswith(".base_layer"):
            continue  # adapter internals of a model that already has an adapter
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        check_module(name, base)
        role = override_role(name, overrides) or plan_role(name, plan)
        if role is None:
            model_type = getattr(getattr(model, "config", None), "model_type", "this model")
            raise BlockDiagLoraError(
                f"{name}: no tensor-parallel role in the {model_type} TP plan; "
                f"pass roles={{'{name.rsplit('.', 1)[-1]}': "
                "'bd_b'}} for a column-parallel layer or 'bd_a' for a row-parallel one"
            )
        rank = rank_for(peft_config, name)
        check_shape(name, role, base.in_features, base.out_features, rank, nblocks)
        roles[name] = role
    if not roles:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise BlockDiagLoraError(
            f"target_modules={_show(peft_config.target_modules)} match no module of the model; its Linear "
            f"layers are {linear}"
        )
    if hasattr(model, "config"):
        check_heads(model.config, nblocks)
    return roles


def rank_for(peft_config, name: str) -> int:
    """The rank PEFT gives module `name`: `rank_pattern` (PEFT's own pattern lookup) or `r`."""
    return _pattern_value(getattr(peft_config, "rank_pattern", None), name, peft_config.r)


def alpha_for(peft_config, name: str) -> float:
    """The lora_alpha PEFT gives module `name`: `alpha_pattern` or `lora_alpha`."""
    return _pattern_value(getattr(peft_config, "alpha_pattern", None), name, peft_config.lora_alpha)


def _pattern_value(pattern: dict | None, name: str, default):
    if not pattern:
        return default
    from peft.utils.other import get_pattern_key

    return pattern.get(get_pattern_key(pattern.keys(), name), default)


def _show(targets) -> str:
    return repr(sorted(targets)) if isinstance(targets, (set, list)) else repr(targets)
