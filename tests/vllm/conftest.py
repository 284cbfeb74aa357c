"""Real-engine tests of the BD-LoRA vLLM plugin (marker `vllm`; run in .venv-vllm: `make test-vllm`).

Each engine runs in its own subprocess (`tools.vllm_harness.engine_job`), one at a time, and every
session-scoped engine fixture groups all checks that need the same engine configuration: an engine start is
~50 s at TP 1 and ~2 min at TP 3 on 2 CPU cores. Models, adapters and HF+PEFT references are built once per
session (set BDLORA_VLLM_CACHE=DIR to keep them across runs).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from vllm_helpers import with_references

from bdlora_train.serving.engines import serving_status
from tools.vllm_harness import fixtures as fx

# Not find_spec("vllm"): with pytest's rootdir on sys.path, this very folder (tests/vllm) is a namespace package
# named vllm. The engine is installed iff its distribution is.
HAVE_VLLM = serving_status().engine is not None


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: runs the real vLLM engine (CPU build); `make test-vllm`")


def pytest_collection_modifyitems(items):
    skip = pytest.mark.skip(reason="vLLM is not installed here (build .venv-vllm: scripts/vllm_env.sh)")
    for item in items:
        if "tests/vllm/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.vllm)
            if not HAVE_VLLM:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    cache = os.environ.get("BDLORA_VLLM_CACHE")
    if cache:
        Path(cache).mkdir(parents=True, exist_ok=True)
        return Path(cache)
    return tmp_path_factory.mktemp("bdlora-vllm")


@pytest.fixture(scope="session")
def smollm2(workdir) -> dict:
    """SmolLM2-135M (9 heads / 3 KV heads -> nblocks 3) and its adapters, dense exports, prompts, references."""
    model = fx.smollm2_dir(workdir / "smollm2")
    adapters = {
        "bd48": fx.random_adapter(model, workdir / "smol-bd48", r=48, nblocks=3, seed=1),
        "bd24": fx.random_adapter(model, workdir / "smol-bd24", r=24, nblocks=3, seed=2),
        "plain8": fx.random_adapter(model, workdir / "smol-plain8", r=8, nblocks=None, seed=3),
        # nblocks 2 cannot be cut into 3 TP shards: refused at TP 3
        "bd2": fx.random_adapter(model, workdir / "smol-bd2", r=16, nblocks=2, seed=4),
        "bd24b": fx.random_adapter(model, workdir / "smol-bd24b", r=24, nblocks=3, seed=5),  # loaded at run time
    }
    _dense_exports(workdir, "smol", adapters, ("bd48", "bd24"))
    return with_references(workdir, "smollm2", model, adapters, ["bd48", "bd24", "plain8", "bd24b"])


@pytest.fixture(scope="session")
def tiny(workdir, smollm2) -> dict:
    """A random tiny Llama (4 heads / 2 KV heads) with SmolLM2's tokenizer, for TP 2."""
    model = fx.tiny_model_dir(workdir / "tiny-llama", smollm2["model"], "llama")
    adapters = {
        "bd2": fx.random_adapter(model, workdir / "tiny-bd2", r=16, nblocks=2, seed=11),  # TP 2 = nblocks
        "bd4": fx.random_adapter(model, workdir / "tiny-bd4", r=32, nblocks=4, seed=12),  # TP 2 divides nblocks
        "plain8": fx.random_adapter(model, workdir / "tiny-plain8", r=8, nblocks=None, seed=13),
        # trained under TP 2 (torchrun, recipes/tiny/bdlora_tp2.yaml: each rank trained only its blocks)
        "tp_trained": fx.trained_adapter(model, workdir / "run-tiny-tp2", recipe="bdlora_tp2.yaml", nproc=2,
                                         max_steps=20),
        # roles swapped (block-diagonal A on q/k/v/gate/up, B on o/down): no rank-local form, refused at TP 2
        "swapped": fx.random_adapter(model, workdir / "tiny-swapped", r=16, nblocks=2, seed=14,
                                     bd_a=fx.BD_B_PATTERNS, bd_b=fx.BD_A_PATTERNS),
    }
    _dense_exports(workdir, "tiny", adapters, ("bd2", "bd4"))
    return with_references(workdir, "tiny", model, adapters, ["bd2", "bd4", "plain8", "tp_trained"])


GLM4_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]


@pytest.fixture(scope="session")
def fused(workdir, smollm2) -> dict:
    """Tiny Phi-3 (fused qkv_proj and gate_up_proj) and GLM-4 (fused gate_up_proj) with SmolLM2's tokenizer, each with
    a BD-LoRA adapter trained by `bdlora train` (the tiny recipe, nblocks 2, r 16: the fused layers densely stored
    with segment-aware blocks, bdlora_layout.json); GLM-4 also with a plain LoRA on its fused gate_up_proj."""
    out = {}
    for family in ("phi3", "glm4"):
        model = fx.tiny_model_dir(workdir / f"tiny-{family}", smollm2["model"], family)
        adapters = {"bd": fx.trained_adapter(model, workdir / f"run-{family}", lora_r=16, nblocks=2, max_steps=20)}
        if family == "glm4":
            adapters["plain8"] = fx.random_adapter(model, workdir / "glm4-plain8", r=8, nblocks=None, seed=21,
                                                   targets=GLM4_TARGETS)
        out[family] = with_references(workdir, family, model, adapters, list(adapters))
    return out


def _dense_exports(workdir, prefix, adapters, names):
    for name in names:
        adapters[f"{name}_dense"] = fx.dense_export(adapters[name], workdir / f"{prefix}-{name}-dense")


def pytest_terminal_summary(terminalreporter):
    """Print what the engine tests measured (log-prob diffs, collective counts, refusals, engine times)."""
    import json
    import sys

    measured = getattr(sys.modules.get("vllm_helpers"), "MEASURED", None)
    if measured:
        terminalreporter.write_sep("-", "measured (tests/vllm)")
        terminalreporter.write_line(json.dumps(measured, indent=1))
