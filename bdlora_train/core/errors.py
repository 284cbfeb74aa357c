"""Every error a user can cause, under one base class, so the CLI can print it as one line and exit 1.

Anything that is not a `BdloraError` (a bug, an unexpected library failure) keeps its traceback. Messages name
the module or key, the value and the fix; `first_line` turns a foreign exception into text fit to quote in one.
"""

from __future__ import annotations


class BdloraError(ValueError):
    """A user-facing error: bad input, a setting that cannot work, a file that is not what it should be.

    Subclasses ValueError so code that caught ValueError before the hierarchy existed keeps working.
    """


class BlockDiagLoraError(BdloraError):
    """A BD-LoRA setting that would not line up with tensor-parallel shards, or is not supported."""


class ModelSpecError(BdloraError):
    """A --model spec that names no model we can load."""


class AdapterError(BdloraError):
    """An adapter directory that is missing, unreadable or inconsistent."""


class RecipeError(BdloraError):
    """A recipe key or value that cannot work; the message names the key, the value and the fix."""


class DataError(BdloraError):
    """A dataset that cannot be turned into training examples."""


class ExportError(BdloraError):
    """An export the adapter cannot satisfy, or an output path that would lose data."""


class ServingError(BdloraError):
    """A serving check that cannot run (bad TP degree, unknown base)."""


class HubError(BdloraError):
    """A push that cannot work (no token, offline mode, bad repo id, network failure)."""


class TPError(BdloraError):
    """A model / adapter / TP degree combination that cannot be sharded."""


class CompareError(BdloraError):
    """A compare argument or output directory that cannot work."""


class TaskError(BdloraError):
    """A --task value or task file that cannot be turned into a task."""


def first_line(err: BaseException | str, limit: int = 200) -> str:
    """The first non-empty line of an exception (or text), cut to `limit`; the type name when it has no text."""
    text = err if isinstance(err, str) else str(err)
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:limit]
    return "" if isinstance(err, str) else type(err).__name__
