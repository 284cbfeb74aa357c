"""Which LoRA factor is block-diagonal in each module, taken from the model's tensor-parallel plan.

Column-parallel layers (q, k, v, gate, up) get a block-diagonal B; row-parallel layers (o, down) a
block-diagonal A. The plan comes from transformers (`config.base_model_tp_plan`), so roles follow the
architecture rather than a list of names the user has to get right. Every check that keeps blocks aligned
with the TP shards of a serving engine lives here, and each failure is one line naming module, numbers, fix.
"""

from __future__ import annotations

import re

from torch import nn

BD_A = "bd_a"  # row-parallel layer: A is block-diagonal, B is sharded along the rank
BD_B = "bd_b"  # column-parallel layer: B is block-diagonal, A is sharded along the rank
ROLES = (BD_A, BD_B)

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


class BlockDiagLoraError(ValueError):
    """A BD-LoRA setting that would not line up with tensor-parallel shards, or is not supported."""


def tp_plan(model_config) -> dict[str, str]:
    """The base model's TP plan: transformers' own, else our small registry, else {}."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
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


def matches_name(name: str, pattern: str) -> bool:
    """PEFT's list semantics for target names: the full name, or a dotted suffix of it (never a substring)."""
    return name == pattern or name.endswith("." + pattern)


def plan_role(name: str, plan: dict[str, str]) -> str | None:
    for pattern, style in plan.items():
        if _plan_regex(pattern).search(name):
            return role_from_style(style)
    return None


def _is_quantized(module: nn.Module) -> bool:
    qualname = f"{type(module).__module__}.{type(module).__name__}".lower()
    if any(hint in qualname for hint in _QUANTIZED_CLASS_HINTS):
        return True
    weight = getattr(module, "weight", None)
    return weight is not None and not weight.dtype.is_floating_point


def check_module(name: str, module: nn.Module) -> None:
    """Refuse module types where BD-LoRA would be wrong or silently vanilla LoRA."""
    leaf = name.rsplit(".", 1)[-1]
    kind = type(module).__name__
    if _is_quantized(module):
        raise BlockDiagLoraError(
            f"{name}: quantized layer {kind} - PEFT's quantized LoRA layers ignore use_bdlora and train vanilla LoRA; "
            "load the base model unquantized (bf16/fp32) for BD-LoRA training"
        )
    if kind == "Conv1D":
        raise BlockDiagLoraError(
            f"{name}: GPT-2 style Conv1D layer - BD-LoRA supports nn.Linear only; target the model's Linear projections"
        )
    if leaf in FUSED_PROJECTIONS:
        raise BlockDiagLoraError(
            f"{name}: fused projection '{leaf}' - TP engines shard each fused segment separately, so contiguous "
            "blocks would not line up with TP shards; use a model with separate projections or drop it from target_modules"
        )
    if not isinstance(module, nn.Linear):
        raise BlockDiagLoraError(f"{name}: {kind} is not an nn.Linear - BD-LoRA supports Linear layers only")


def check_heads(model_config, nblocks: int) -> None:
    """nblocks (the TP degree) must divide the attention and KV heads, or engines replicate KV heads."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for label, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if value is not None and value % nblocks:
            divisors = [d for d in range(1, value + 1) if value % d == 0 and (heads or 0) % d == 0]
            raise BlockDiagLoraError(
                f"nblocks={nblocks} does not divide {label}={value}: TP shards would split heads "
                f"(or replicate KV heads) and blocks would not line up; use nblocks in {divisors}"
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
        raise BlockDiagLoraError(f"{name}: unknown role {sorted(bad)} in roles; use 'bd_a' (row-parallel) or 'bd_b' (column-parallel)")
    if len(hits) > 1:
        raise BlockDiagLoraError(f"{name}: matched by both a 'bd_a' and a 'bd_b' pattern in roles; make the patterns disjoint")
    return hits.pop() if hits else None


def resolve_roles(model: nn.Module, peft_config, nblocks: int, overrides: dict[str, str] | None = None) -> dict[str, str]:
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
                f"{name}: no tensor-parallel role in the {model_type} TP plan; pass roles={{'{name.rsplit('.', 1)[-1]}': "
                "'bd_b'}} for a column-parallel layer or 'bd_a' for a row-parallel one"
            )
        rank = _rank_for(peft_config, name)
        check_shape(name, role, base.in_features, base.out_features, rank, nblocks)
        roles[name] = role
    if not roles:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise BlockDiagLoraError(
            f"target_modules={_show(peft_config.target_modules)} match no module of the model; its Linear layers are {linear}"
        )
    if hasattr(model, "config"):
        check_heads(model.config, nblocks)
    return roles


def _rank_for(peft_config, name: str) -> int:
    from peft.utils.other import get_pattern_key

    pattern = getattr(peft_config, "rank_pattern", None) or {}
    return pattern.get(get_pattern_key(pattern.keys(), name), peft_config.r) if pattern else peft_config.r


def _show(targets) -> str:
    return repr(sorted(targets)) if isinstance(targets, (set, list)) else repr(targets)


def stock_roles(names, bdlora_config) -> dict[str, str | None]:
    """Roles exactly as stock PEFT assigns them: a substring test of each pattern on the full module name."""
    bd_a = list(_get(bdlora_config, "target_modules_bd_a") or [])
    bd_b = list(_get(bdlora_config, "target_modules_bd_b") or [])
    out = {}
    for name in names:
        in_a = any(p in name for p in bd_a)
        in_b = any(p in name for p in bd_b)
        if in_a and in_b:
            raise BlockDiagLoraError(f"{name}: matched by both target_modules_bd_a and target_modules_bd_b")
        out[name] = BD_A if in_a else BD_B if in_b else None
    return out


def _get(obj, key):
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def compact_patterns(roles: dict[str, str]) -> dict[str, list[str]]:
    """Shortest name suffixes that give exactly `roles` under PEFT's substring matching.

    PEFT tests `pattern in module_name`, so "up_proj" would also claim "gate_up_proj". For each module we
    take the shortest dotted suffix that is no substring of any module with the other role (falling back to
    the full name), and verify the result with `stock_roles`.
    """
    patterns: dict[str, set[str]] = {BD_A: set(), BD_B: set()}
    for name, role in roles.items():
        others = [n for n, r in roles.items() if r != role]
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            candidate = ".".join(parts[-k:])
            if not any(candidate in other for other in others):
                break
        patterns[role].add(candidate)
    result = {role: sorted(p) for role, p in patterns.items()}
    stock = stock_roles(roles, {"target_modules_bd_a": result[BD_A], "target_modules_bd_b": result[BD_B]})
    assert stock == roles, "compact_patterns produced patterns PEFT would read differently"
    return result
