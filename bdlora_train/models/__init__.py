"""Base models: the `--model` spec every command takes (specs.py), the embedded SmolLM2-135M (embedded.py) and the
tiny random models of real families that tests and layout probing build (tiny.py)."""

from bdlora_train.models.embedded import EMBEDDED, EMBEDDED_HUB_ID, EMBEDDED_NBLOCKS, load_embedded_model
from bdlora_train.models.specs import (
    base_spec,
    check_spec,
    load_config,
    load_model,
    load_tokenizer,
    load_trained_base,
    meta_model,
)
from bdlora_train.models.tiny import TINY_FAMILIES, build_tiny_model, probe_model, tiny_config, tiny_tokenizer

__all__ = [
    "EMBEDDED",
    "EMBEDDED_HUB_ID",
    "EMBEDDED_NBLOCKS",
    "TINY_FAMILIES",
    "base_spec",
    "build_tiny_model",
    "check_spec",
    "load_config",
    "load_embedded_model",
    "load_model",
    "load_tokenizer",
    "load_trained_base",
    "meta_model",
    "probe_model",
    "tiny_config",
    "tiny_tokenizer",
]
