"""Files and directories written atomically: readers see the old one or the new one, never a half-written one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    """Where softq keeps what it unpacks or trains once (the bundled all-MiniLM-L6-v2, the benchmarks' reference
    models): ``$SOFTQ_CACHE`` or ``~/.cache/softq``."""
    env = os.environ.get("SOFTQ_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "softq"


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
        default_mode(tmp)
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


@contextmanager
def atomic_file(target: str | os.PathLike, mode: str = "w") -> Iterator:
    """An open temporary file beside ``target`` that replaces ``target`` when the block ends without an error
    (removed otherwise), with the mode ``open`` would have given it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
            yield fh
        default_mode(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def error_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): what a one-line error
    quotes from a library that failed to read a file."""
    return (str(err).splitlines() or [type(err).__name__])[0]


def default_mode(path: str | os.PathLike) -> None:
    """Give a file or directory made by ``tempfile.mkstemp`` / ``mkdtemp`` (0600 / 0700: readable by its owner
    only) the mode ``open`` / ``mkdir`` would have given it (0666 / 0777 less the umask), before it is moved into
    place: an exported model must be readable by the service that runs it, as other tools' outputs are."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~mask)


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
