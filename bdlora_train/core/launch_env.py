"""What the launcher says about this process: torchrun and accelerate launch set RANK, LOCAL_RANK and WORLD_SIZE;
read here and nowhere else (tests/core/test_core_rules.py holds the package to it)."""

from __future__ import annotations

import os


def _number(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else None


def rank() -> int:
    """This process's global rank (0 when no launcher set one)."""
    return _number("RANK") or 0


def is_main_process() -> bool:
    """Rank 0: the process that writes, reports and holds a run's lock."""
    return rank() == 0


def local_rank() -> int | None:
    """This process's rank on its node, or None when no launcher started it."""
    return _number("LOCAL_RANK")


def launched_world_size() -> int | None:
    """How many processes the launcher started, or None when no launcher set WORLD_SIZE."""
    return _number("WORLD_SIZE")


def world_size() -> int:
    """How many processes the launcher started (1 without a launcher)."""
    return launched_world_size() or 1
