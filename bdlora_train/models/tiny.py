"""Tiny random models of real families, built from configs (no download), and the tokenizer they share.

Tiny but TP-shaped: hidden 64, 2 layers, 4 heads / 2 KV heads (nblocks 2 lines up), vocab 256. Every family in
`TINY_FAMILIES` is built and run by tests/test_families.py; multimodal ones (gemma3) get the tiny dimensions in their
text config plus a tiny vision tower; llama4 is its text model (Llama4ForCausalLM).
"""

from __future__ import annotations

import string

import torch

from bdlora_train.core.naming import family_name

TINY_SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A character-level tokenizer (101 tokens, ChatML template) that fits the tiny models' 256-token vocab.

    Hand-built because tiny random models come from a config and have no tokenizer; characters keep the
    vocab small without any download.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = list(string.printable[:-2])  # printable ASCII, space, \t, \n, \r; not \x0b \x0c
    vocab = {token: i for i, token in enumerate(TINY_SPECIALS + chars)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token per char
    backend.add_special_tokens(TINY_SPECIALS)
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token="<unk>",
        chat_template=CHATML_TEMPLATE,
    )


# Tiny but TP-shaped: 4 heads / 2 KV heads so nblocks 2 lines up; dims divisible by 4.
TINY_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=256,
)
_NO_GQA = dict(num_key_value_heads=None, head_dim=None)  # families whose config has no such fields
_NO_MLP_SIZE = dict(num_key_value_heads=None, head_dim=None, intermediate_size=None)
# What each family needs on top of TINY_DIMS (None drops a key the family's config does not take). Every entry is
# built and run by tests/test_families.py; multimodal families get these dimensions in their text config.
TINY_FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "gemma": {},
    "gemma2": {},
    "gemma3_text": {},
    "cohere": {},
    "granite": {},
    "smollm3": {},
    "starcoder2": {},
    "olmo2": {},
    "phi3": {},
    "glm4": {},
    "phi": dict(num_key_value_heads=4, head_dim=None),
    "gptj": dict(_NO_GQA, intermediate_size=None, n_inner=128, rotary_dim=8),
    "gpt_neox": dict(_NO_GQA, rotary_pct=0.5),
    "bloom": _NO_MLP_SIZE,
    "mpt": dict(_NO_MLP_SIZE, expansion_ratio=2),
    "gpt2": _NO_MLP_SIZE,
    "opt": dict(_NO_MLP_SIZE, ffn_dim=128, word_embed_proj_dim=64),
    # Falcon-40B/180B style: grouped query_key_value, 2 KV groups (Falcon-7B's single KV head cannot be TP-sharded)
    "falcon": dict(_NO_GQA, new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=128),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64
    ),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "llama4": dict(num_local_experts=4, intermediate_size=32, intermediate_size_mlp=64, attention_chunk_size=64),
    "deepseek_v3": dict(
        head_dim=None,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
    ),
    "gemma3": {},  # multimodal (Gemma-3 4B/12B/27B): tiny text config and a tiny SigLIP vision tower
}
# Multimodal families: the vision tower of a tiny model (its own plan is not the language model's).
TINY_VISION = {
    "gemma3": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    ),
}
TINY_MULTIMODAL = {
    "gemma3": dict(mm_tokens_per_image=1, image_token_index=255, boi_token_index=253, eoi_token_index=254)
}
# Families whose text model is built from the text config alone (AutoModelForCausalLM maps them to a text-only class).
_TEXT_ONLY = {"llama4": "llama4_text"}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def _token_id_overrides(model_type: str, dims: dict) -> dict:
    """pad/bos/eos of the family's full-size defaults that the tiny vocabulary cannot hold (Phi-3's pad 32000):
    pad -> 0, bos/eos -> None, passed up front so transformers' config validation has nothing to warn about."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    out = {}
    for key in _TOKEN_IDS:
        default = getattr(cls, key, None)
        values = default if isinstance(default, list) else [default]
        if key not in dims and any(isinstance(v, int) and v >= dims["vocab_size"] for v in values):
            out[key] = 0 if key == "pad_token_id" else None
    return out


def _fit_token_ids(config, vocab_size: int) -> None:
    """Special-token ids of a full-size config (Phi-3's pad 32000, ...) that fall outside the tiny vocabulary."""
    for key in _TOKEN_IDS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= vocab_size:
            setattr(config, key, 0 if key == "pad_token_id" else None)
        elif isinstance(value, list) and any(v >= vocab_size for v in value):
            setattr(config, key, None)


def tiny_config(model_type: str = "llama", **overrides):
    """The config of a tiny random model of a real family: hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 256.

    Families in `TINY_FAMILIES` get the few keys their config needs; multimodal ones (gemma3) get the tiny
    dimensions in their text config plus a tiny vision tower; llama4 is its text model (Llama4ForCausalLM).
    """
    from transformers import AutoConfig

    model_type = _TEXT_ONLY.get(model_type, model_type)
    family = family_name(model_type)
    dims = {**TINY_DIMS, **TINY_FAMILIES.get(family, {}), **overrides}
    dims = {key: value for key, value in dims.items() if value is not None}
    text_type = f"{family}_text" if family in TINY_VISION else model_type
    dims.update(_token_id_overrides(text_type, dims))
    if family in TINY_VISION:
        text = AutoConfig.for_model(text_type, **dims)
        _fit_token_ids(text, dims["vocab_size"])
        config = AutoConfig.for_model(
            family, text_config=text.to_dict(), vision_config=TINY_VISION[family], **TINY_MULTIMODAL.get(family, {})
        )
    else:
        config = AutoConfig.for_model(model_type, **dims)
    _fit_token_ids(config.get_text_config(), dims["vocab_size"])
    return config


def build_tiny_model(model_type: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A small random causal LM of a real family, built from a config (no download). Initialised in float32 and then
    cast, so one seed gives the same model in every dtype (up to the cast's rounding): a float64 run is the float32
    run's exact-arithmetic twin, not a model drawn from other random numbers."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=torch.float32).to(dtype)
    model.config.dtype = dtype
    model.name_or_path = f"tiny:{model_type}"
    return model.eval()




def probe_model(family: str):
    """A tiny model of `family` for layout probing (arch/fused.py), or None when the zoo has none."""
    family = family_name(family)
    return build_tiny_model(family) if family in TINY_FAMILIES else None
