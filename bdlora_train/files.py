"""Atomic writes: a file or directory appears under its final name only once it is complete.

Every output of the toolkit (adapters, checkpoints, metrics, reports, benchmark JSON) goes through here, so a
crash or a kill never leaves a half-written file that a later run would read. Temp names start with ".tmp-".
"""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_file(path):
    """Yield a temp sibling path to write; it replaces `path` only if the block finishes without error."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def replace_dir(src, dst) -> None:
    """Move a finished directory `src` into place as `dst`; an existing `dst` is moved aside, then deleted."""
    src, dst = Path(src), Path(dst)
    old = dst.with_name(f".tmp-old-{uuid.uuid4().hex[:8]}-{dst.name}")
    if dst.exists():
        os.replace(dst, old)
    os.replace(src, dst)
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()
