"""Attention and KV head counts of a model config, and the TP degrees that split them.

Read from the config alone (duck-typed: no transformers import), for the language model of a multimodal config.
"""

from __future__ import annotations

from bdlora_train.core.degrees import heads_split
from bdlora_train.core.errors import BlockDiagLoraConfigError

# TP degrees the default nblocks is chosen from: common serving degrees, all dividing the default rank 24.
DEFAULT_NBLOCKS_CHOICES = (8, 6, 4, 3, 2, 1)


def text_config(model_config):
    """The language model's config (multimodal configs nest it)."""
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def head_counts(model_config) -> tuple[int | None, int | None]:
    """(attention heads, KV heads) of the language model; KV heads default to the attention heads (no GQA).

    KV heads: `num_key_value_heads` (Llama-style GQA), else `kv_n_heads` (MPT-style), else the attention heads.
    """
    config = text_config(model_config)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or getattr(config, "kv_n_heads", None) or heads
    return heads, kv


def head_dim(model_config) -> int | None:
    """Channels per head: `head_dim`, else hidden_size / heads."""
    config = text_config(model_config)
    heads, _ = head_counts(config)
    return getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)


def head_divisors(model_config, limit: int | None = None) -> list[int]:
    """Degrees (<= limit) that split both the attention and the KV heads evenly: the TP degrees that line up."""
    heads, kv = head_counts(model_config)
    if heads is None:
        return list(range(1, (limit or 1) + 1))
    top = min(kv, limit) if limit else kv
    return [d for d in range(1, top + 1) if heads_split(heads, kv, d)]


def default_nblocks(model_config) -> int:
    """The largest of 8, 6, 4, 3, 2, 1 that splits both attention and KV heads: 8 for Llama-3.1, 4 for Qwen2.5-7B
    (4 KV heads), 3 for SmolLM2-135M (9 / 3), 2 for the tiny test models (4 / 2)."""
    divisors = set(head_divisors(model_config, limit=8))
    return next(d for d in DEFAULT_NBLOCKS_CHOICES if d in divisors)


def choose_nblocks(model_config, nblocks: int | None = None, tp_size: int = 1) -> int:
    """The nblocks a BD-LoRA adapter gets, one precedence everywhere (train, compare, budget): an explicit `nblocks`;
    else the TP degree when training under TP (`tp_size` > 1: every rank then holds whole blocks); else
    `default_nblocks` (the largest common serving degree that splits the heads)."""
    for name, value in (("nblocks", nblocks), ("tp_size", tp_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise BlockDiagLoraConfigError(f"{name}={value!r} must be a positive int (or unset for the default)")
    if nblocks is not None:
        return nblocks
    if tp_size is not None and tp_size > 1:
        return tp_size
    return default_nblocks(model_config)
