"""Every error a user can cause, under one base class, so the CLI can print it as one line and exit 1.

Anything that is not a `BlockDiagLoraError` (a bug, an unexpected library failure) keeps its traceback. Messages name
the module or key, the value and the fix; `first_line` turns a foreign exception into text fit to quote in one.
"""

from __future__ import annotations


class BlockDiagLoraError(ValueError):
    """A user-facing error: bad input, a setting that cannot work, a file that is not what it should be.

    Subclasses ValueError so code that caught ValueError before the hierarchy existed keeps working.
    """


BdloraError = BlockDiagLoraError  # its name before the product had one spelling in class names; kept for callers


class BlockDiagLoraConfigError(BlockDiagLoraError):
    """A BD-LoRA setting that would not line up with tensor-parallel shards, or is not supported."""


class ModelSpecError(BlockDiagLoraError):
    """A --model spec that names no model we can load."""


class AdapterError(BlockDiagLoraError):
    """An adapter directory that is missing, unreadable or inconsistent."""


class RecipeError(BlockDiagLoraError):
    """A recipe key or value that cannot work; the message names the key, the value and the fix."""


class DataError(BlockDiagLoraError):
    """A dataset that cannot be turned into training examples."""


class ExportError(BlockDiagLoraError):
    """An export the adapter cannot satisfy, or an output path that would lose data."""


class ServingError(BlockDiagLoraError):
    """A serving check that cannot run (bad TP degree, unknown base)."""


class HubError(BlockDiagLoraError):
    """A push that cannot work (no token, offline mode, bad repo id, network failure)."""


class TPError(BlockDiagLoraError):
    """A model / adapter / TP degree combination that cannot be sharded."""


class CompareError(BlockDiagLoraError):
    """A compare argument or output directory that cannot work."""


class TaskError(BlockDiagLoraError):
    """A --task value or task file that cannot be turned into a task."""


class RewardError(BlockDiagLoraError):
    """A reward function that cannot be found, loaded or called (RL runs); the message names the function and row."""


class RolloutError(BlockDiagLoraError):
    """A rollout server (vLLM) that cannot serve the RL run's policy: unreachable, misconfigured, another base, or
    a sync that did not take effect."""


def first_line(err: BaseException | str, limit: int | None = 200) -> str:
    """The first non-empty line of an exception (or text), cut to `limit` (None: whole); the type name when it has no
    text."""
    text = err if isinstance(err, str) else str(err)
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:limit]
    return "" if isinstance(err, str) else type(err).__name__
