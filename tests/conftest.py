"""Shared test setup: offline, deterministic, small."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# The tiny families every core test is parametrized over.
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def embedded():
    """The real SmolLM2-135M (loaded once per session; ~15 s)."""
    from bdlora_train.models import load_embedded_model

    return load_embedded_model()
