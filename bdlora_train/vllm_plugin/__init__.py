"""vLLM plugin: serve PEFT's native BD-LoRA adapters in released vLLM with tensor parallelism.

Registered through vLLM's `vllm.general_plugins` entry point (`bdlora = "bdlora_train.vllm_plugin:register"`),
which vLLM calls in every process (API server, engine core, each worker). Importing this package changes
nothing and does not import vLLM; only `register()` patches, and only a tested vLLM version. With it,

    vllm serve BASE --enable-lora --tensor-parallel-size N --max-lora-rank R/N --lora-modules name=ADAPTER

loads a BD-LoRA adapter (adapter_config.json with `use_bdlora`) and each TP rank holds and computes only its
own rank-slice: a local LoRA of rank R/TP, no collective of its own. See docs/serving-vllm.md and `patch.py`
for what is patched and why.
"""

from __future__ import annotations

import logging
import os

from bdlora_train.serving.engines import (
    ALLOW_UNTESTED_ENV,
    SUPPORTED_VLLM_VERSIONS,
    TESTED_VLLM_VERSIONS,
    VERIFIED_VLLM_VERSIONS,
    base_version,
)

logger = logging.getLogger("bdlora_train.vllm_plugin")
_registered = False


def register() -> None:
    """vLLM's general-plugin hook. Patches vLLM's adapter loading if the installed vLLM is engine-tested or verified
    against its sources (serving/engines.py); otherwise logs one line and leaves vLLM untouched (base and plain-LoRA
    serving keep working, and vLLM refuses BD-LoRA adapters with its own message)."""
    global _registered
    if _registered:
        return
    _registered = True
    import vllm

    version = base_version(getattr(vllm, "__version__", "unknown"))
    if version not in SUPPORTED_VLLM_VERSIONS and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        logger.warning(
            "bdlora plugin: vLLM %s is neither engine-tested (%s) nor verified against its sources (%s); BD-LoRA "
            "adapters are NOT enabled. Fix: install vLLM %s, or set %s=1 to patch anyway.",
            version, ", ".join(TESTED_VLLM_VERSIONS), ", ".join(VERIFIED_VLLM_VERSIONS), SUPPORTED_VLLM_VERSIONS[-1],
            ALLOW_UNTESTED_ENV)
        return
    from bdlora_train.vllm_plugin import patch

    patch.apply()


__all__ = ["register"]
