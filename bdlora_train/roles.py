"""Which LoRA factor is block-diagonal in each module, taken from the model's tensor-parallel plan.

Column-parallel layers (q, k, v, gate, up) get a block-diagonal B; row-parallel layers (o, down) a
block-diagonal A. The plan comes from transformers (`config.base_model_tp_plan`), so roles follow the
architecture rather than a list of names the user has to get right. Every check that keeps blocks aligned
with the TP shards of a serving engine lives here, and each failure is one line naming module, numbers, fix.
"""

from __future__ import annotations

from torch import nn

from bdlora_train.errors import BlockDiagLoraError
from bdlora_train.families import PLAN_ADDITIONS, parallel_of, plan_style, text_config, tp_plan
from bdlora_train.patterns import BD_A, BD_B, ROLES, matches_name
from bdlora_train.targets import DEFAULT_TARGET_MODULES

__all__ = [
    "BD_A",
    "BD_B",
    "ROLES",
    "BlockDiagLoraError",
    "DEFAULT_TARGET_MODULES",
    "PLAN_ADDITIONS",
    "resolve_roles",
    "default_nblocks",
    "text_config",
    "tp_plan",
]

_QUANTIZED_CLASS_HINTS = ("bitsandbytes", "gptq", "hqq", "awq", "aqlm", "eetq", "torchao", "quant")


def role_from_style(style: str | None) -> str | None:
    """transformers' plan style -> BD-LoRA role of a Linear ("colwise*" -> bd_b, "rowwise*" -> bd_a)."""
    parallel = parallel_of(style)
    return BD_B if parallel == "column" else BD_A if parallel == "row" else None


def plan_role(name: str, plan: dict[str, str]) -> str | None:
    """Role of a module named relative to the text model (or with its `model.` prefix)."""
    return role_from_style(plan_style(name, plan))


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


def check_heads(
    model_config,
    degree: int,
    label: str = "nblocks",
    error: type[Exception] = BlockDiagLoraError,
    kv: bool = True,
) -> None:
    """`degree` (nblocks, or a TP degree) must divide the attention heads, and the KV heads when `kv` (an adapted
    layer produces key/value channels: engines replicate KV heads when TP exceeds them, splitting nothing else)."""
    n_heads, kv_heads = head_counts(model_config)
    checks = (
        (("num_attention_heads", n_heads), ("num_key_value_heads", kv_heads))
        if kv
        else (("num_attention_heads", n_heads),)
    )
    for key, value in checks:
        if value is not None and value % degree:
            raise error(
                f"{label}={degree} does not divide {key}={value}: TP shards would split heads "
                f"(or replicate KV heads) and blocks would not line up; use {label} in {head_divisors(model_config)}"
            )


def check_segments(layout, r: int, nblocks: int) -> None:
    """r and every segment of the block-diagonal factor's split dimension must divide into nblocks."""
    name = layout.name
    if r % nblocks:
        raise BlockDiagLoraError(
            f"{name}: rank r={r} is not a multiple of nblocks={nblocks}; use r={max(nblocks, r - r % nblocks)} "
            f"or r={r + nblocks - r % nblocks}"
        )
    side = "B" if layout.factor == "B" else "A"
    if layout.experts:
        label = f"dimension {layout.split} (split by TP)"
    else:
        label = "out_features" if side == "B" else "in_features"
    if len(layout.segments) == 1 and layout.split % nblocks:
        raise BlockDiagLoraError(
            f"{name}: {label}={layout.split} of the block-diagonal {side} is not divisible by nblocks={nblocks}; "
            "pick an nblocks that divides it"
        )
    if len(layout.segments) > 1 and any(size % nblocks for size in layout.segments):
        raise BlockDiagLoraError(
            f"{name}: fused segments {list(layout.segments)} of the block-diagonal {side} are not all divisible by "
            f"nblocks={nblocks}; pick an nblocks that divides each"
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
    model: nn.Module, peft_config, nblocks: int, overrides: dict[str, str] | None = None, experts="tp"
) -> dict[str, str]:
    """Role of every module (and expert parameter) `peft_config` targets in `model`, after every alignment check.

    The full resolution, with layouts and storage, is `bdlora_train.targets.resolve_targets`.
    """
    from bdlora_train.targets import resolve_targets

    targets = resolve_targets(model, peft_config, nblocks, overrides, experts)
    return {name: target.role for name, target in targets.items()}


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
