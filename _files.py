"""Directories written atomically: readers see the old directory or the new one, never a half-written one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``target``; when the block ends without an error it
    replaces ``target`` (an existing one is moved aside first and removed after); on an error it is removed
    and ``target`` is left as it was."""
    target = Path(target)
    check_writable_parent(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        if target.exists() or target.is_symlink():
            # a fresh name, so a leftover from an interrupted run is never in the way; a file or a link at
            # ``target`` is moved aside and removed like a directory
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
            old.rmdir()
            os.replace(target, old)
            os.replace(tmp, target)
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            else:
                old.unlink()
        else:
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def check_writable_parent(target: str | os.PathLike) -> None:
    """Raise ``NotADirectoryError`` / ``PermissionError`` naming the problem when ``target`` cannot be created:
    an existing ancestor that is a file, or one that is not writable (checked before any work is done)."""
    target = Path(target)
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"cannot write {target}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {target}: {parent} is not writable")
