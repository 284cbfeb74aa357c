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

from bdlora_train.core.errors import BlockDiagLoraError


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


@contextmanager
def atomic_dir(out, force: bool = False):
    """Yield a fresh temporary sibling of `out`; it becomes `out` only when the block finishes without error.

    An existing `out` is replaced only with `force` (the CLI's --force), and never before the new one is complete.
    """
    out = Path(out)
    if out.exists() and not force:
        raise BlockDiagLoraError(f"{out} already exists; pass --force to replace it or choose another directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{uuid.uuid4().hex[:8]}-{out.name}"
    tmp.mkdir()
    try:
        yield tmp
        replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def check_disjoint(out, source, what: str = "--out") -> None:
    """Refuse an output path that equals, contains or lies inside `source`: replacing it would destroy the source."""
    out_r, src_r = Path(out).resolve(), Path(source).resolve()
    if out_r == src_r or out_r in src_r.parents or src_r in out_r.parents:
        relation = "is" if out_r == src_r else "contains" if out_r in src_r.parents else "lies inside"
        raise BlockDiagLoraError(f"{what} {out} {relation} the source {source}; write to a directory outside it")
