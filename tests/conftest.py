"""Shared test setup: offline, deterministic, small."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib.util  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# pytest puts tests/ on sys.path (for the helper modules beside this file), where the folder tests/vllm, having no
# __init__.py, would pass for an installed vLLM (a namespace package) in `find_spec("vllm")`: TRL then imports it
# and fails on its version. Where no vLLM is installed, `vllm` is marked absent (find_spec gives None, import fails).
_vllm = importlib.util.find_spec("vllm")
if _vllm is not None and _vllm.origin is None:
    sys.modules["vllm"] = None

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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run ~10x faster on one thread than on two contended ones (use via pytestmark)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_inputs():
    """(tiny Llama, tiny tokenizer, 64 sum rows): what train(recipe, model, tokenizer, rows) takes."""
    from datasets import Dataset

    from bdlora_train.models import build_tiny_model, tiny_tokenizer

    rows = Dataset.from_list([{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(8) for b in range(8)])
    return build_tiny_model("llama", seed=0), tiny_tokenizer(), rows


@pytest.fixture(scope="module")
def tiny_recipe():
    """tiny_recipe(output_dir, **overrides): a few-step BD-LoRA recipe on the tiny Llama (nblocks 2, r 4)."""
    from bdlora_train.train import Recipe

    def make(out, **overrides):
        base = dict(
            model="tiny:llama",
            nblocks=2,
            lora_r=4,
            max_steps=6,
            per_device_train_batch_size=8,
            learning_rate=3e-3,
            logging_steps=1,
            save_steps=0,
            output_dir=str(out),
            seed=0,
        )
        return Recipe(**{**base, **overrides})

    return make


def pytest_collection_modifyitems(config, items):
    """Everything under tests/vllm runs the real vLLM engine: marked `vllm`, run by `make test-vllm` only."""
    for item in items:
        if "vllm" in item.path.parent.parts[-1:]:
            item.add_marker(pytest.mark.vllm)
