"""Every check that keeps blocks aligned with the TP shards of an engine, each failing with one line that names the
module, the numbers and the fix."""

from __future__ import annotations

from torch import nn

from bdlora_train.core.degrees import SUGGEST_UP_TO, check_rank, divides, segments_split, splitting_degrees
from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.core.heads import head_counts, head_dim, head_divisors
from bdlora_train.core.layout import COLUMN
from bdlora_train.core.naming import matches_name
from bdlora_train.core.roles import ROLES, Role
from bdlora_train.quant.detect import quant_kind

_QUANTIZED_CLASS_HINTS = ("bitsandbytes", "gptq", "hqq", "awq", "aqlm", "eetq", "torchao", "quant")


def _qualname(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__name__}".lower()


def _is_quantized(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    if any(hint in _qualname(module) or hint in _qualname(weight) for hint in _QUANTIZED_CLASS_HINTS):
        return True  # the layer class or its weight's tensor subclass (torchao) comes from a quantization library
    return weight is not None and not weight.dtype.is_floating_point


def check_module(name: str, module: nn.Module) -> None:
    """Refuse module types where BD-LoRA would be wrong or silently vanilla LoRA."""
    kind = type(module).__name__
    if quant_kind(module) is None and _is_quantized(module):  # bnb 4/8-bit, torchao int8: BD layers exist
        raise BlockDiagLoraConfigError(
            f"{name}: quantized layer {kind} ({type(getattr(module, 'weight', None)).__name__} weight) - BD-LoRA "
            "supports bitsandbytes 4-bit / 8-bit and torchao int8 weight-only bases only (docs/quantization.md); "
            "load the base with load_in_4bit, load_in_8bit or torchao_int8, or unquantized"
        )
    if kind == "Conv1D":
        raise BlockDiagLoraConfigError(
            f"{name}: GPT-2 style Conv1D layer - BD-LoRA supports nn.Linear only; target the model's Linear projections"
        )
    if not isinstance(module, nn.Linear):
        raise BlockDiagLoraConfigError(f"{name}: {kind} is not an nn.Linear - BD-LoRA supports Linear layers only")


def check_heads(
    model_config,
    degree: int,
    label: str = "nblocks",
    error: type[Exception] = BlockDiagLoraConfigError,
    kv: bool = True,
    choices: list[int] | None = None,
) -> None:
    """`degree` (nblocks, or a TP degree) must divide the attention heads, and the KV heads when `kv` (an adapted
    layer produces key/value channels: engines replicate KV heads when TP exceeds them, splitting nothing else).
    `choices`: the values the message suggests when the caller knows more rules (default: the head divisors)."""
    n_heads, kv_heads = head_counts(model_config)
    checks = [("num_attention_heads", n_heads)] + ([("num_key_value_heads", kv_heads)] if kv else [])
    for key, value in checks:
        if value is not None and not divides(degree, value):
            fits = choices or head_divisors(model_config)
            raise error(
                f"{label}={degree} does not divide {key}={value}: TP shards would split heads "
                f"(or replicate KV heads) and blocks would not line up; use {label} in {fits}"
            )


def check_segments(layout, r: int, nblocks: int) -> None:
    """r and every segment of the block-diagonal factor's split dimension must divide into nblocks."""
    name = layout.name
    check_rank(r, nblocks, name)
    side = layout.factor
    # an expert parameter's split dimension has no Linear name: "the dimension TP splits=66"
    label = "the dimension TP splits" if layout.experts else ("out_features" if side == "B" else "in_features")
    fix = f"use nblocks in {splitting_degrees(max(SUGGEST_UP_TO, nblocks), r=r, segments=layout.segments)}"
    if len(layout.segments) == 1 and not divides(nblocks, layout.split):
        raise BlockDiagLoraConfigError(
            f"{name}: {label}={layout.split} of the block-diagonal {side} is not divisible by nblocks={nblocks}; "
            f"pick an nblocks that divides it: {fix}"
        )
    if len(layout.segments) > 1 and not segments_split(layout.segments, nblocks):
        raise BlockDiagLoraConfigError(
            f"{name}: fused segments {list(layout.segments)} of the block-diagonal {side} are not all divisible by "
            f"nblocks={nblocks}; pick an nblocks that divides each: {fix}"
        )


def override_role(name: str, overrides: dict[str, str] | None) -> Role | None:
    """Explicit user roles ("bd_a" / "bd_b", returned as `Role`); a name matched by patterns of both roles is an
    error."""
    if not overrides:
        return None
    hits = {role for pattern, role in overrides.items() if matches_name(name, pattern)}
    bad = hits - set(ROLES)
    if bad:
        raise BlockDiagLoraConfigError(
            f"{name}: unknown role {sorted(bad)} in roles; use 'bd_a' (row-parallel) or 'bd_b' (column-parallel)"
        )
    if len(hits) > 1:
        raise BlockDiagLoraConfigError(
            f"{name}: matched by both a 'bd_a' and a 'bd_b' pattern in roles; make the patterns disjoint"
        )
    return Role(hits.pop()) if hits else None


def touches_kv_heads(model_config, targets) -> bool:
    """Whether any target's output holds key/value-head channels (k_proj, v_proj, a fused qkv): only then must
    nblocks divide the KV heads (engines replicate KV heads when TP exceeds them, so q/o alone shard fine)."""
    heads, kv = head_counts(model_config)
    if not heads or kv == heads:
        return True
    size = head_dim(model_config)
    for target in targets:
        lay = target.layout
        if lay.parallel != COLUMN or lay.experts:
            continue
        if lay.d_out in (kv * size, (heads + 2 * kv) * size) or kv * size in lay.segments:
            return True
    return False


