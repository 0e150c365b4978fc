"""Where rpcompile keeps what it builds on the user's machine (the planner's, the simulator's and the host
optimizer's kernels), and how an entry there is known to be whole before it is mapped.

In the lowest layer because both the passes (the planner) and the runtime (the simulator, the host optimizer)
build there.

A built file is an entry only with its seal: a sidecar `NAME.sha256` holding the file's size and SHA-256,
written (atomically) after the file is complete at its final name. `build_once` loads nothing: it makes
sure the file at a path is whole, and otherwise, holding the folder's lock, deletes it and builds it
again. So a file a full disk or a kill left half written (which would kill the process that maps it
with SIGBUS), or garbage, is never mapped: it is rebuilt. Hashing a few hundred KB costs well under a
millisecond.

    >>> os.path.basename(cache_dir())
    'kernels'
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import TypeVar

try:
    import fcntl  # POSIX only: without it builds are not serialised (each still lands atomically)
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["cache_dir", "SEAL", "seal", "intact", "discard", "locked", "build_once"]

SEAL = ".sha256"  # the seal's suffix: NAME.so -> NAME.so.sha256, JSON {"size": bytes, "sha256": hex digest}
T = TypeVar("T")


def cache_dir() -> str:
    """Where built kernels are kept: $RPCOMPILE_CACHE, else $XDG_CACHE_HOME/rpcompile, else ~/.cache/rpcompile."""
    base = os.environ.get("RPCOMPILE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "rpcompile")
    return os.path.join(base, "kernels")


def _digest(path: str) -> dict:
    """The file's size and SHA-256, as the seal holds them."""
    with open(path, "rb") as f:
        data = f.read()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def seal(path: str) -> None:
    """Write `path`'s seal (its size and digest), atomically: call it once the file is complete at `path`."""
    record = json.dumps(_digest(path))
    fd, tmp = tempfile.mkstemp(suffix=SEAL, dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(record)
        os.replace(tmp, path + SEAL)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def intact(path: str) -> bool:
    """Whether `path` is a whole entry: the file and its seal exist and its size and digest are the seal's.

    Read before the file is mapped; a missing, unreadable or different seal is False (build again).
    """
    try:
        with open(path + SEAL) as f:
            record = json.load(f)
        if not isinstance(record, dict) or os.stat(path).st_size != record.get("size"):
            return False  # a truncated file is found by its size without reading it
        return _digest(path) == record
    except (OSError, ValueError):
        return False


def discard(path: str) -> None:
    """Remove the entry at `path` and its seal (what is missing already is fine)."""
    for name in (path + SEAL, path):  # the seal first: a file without one is never trusted
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


@contextlib.contextmanager
def locked(folder: str) -> Iterator[None]:
    """Hold an exclusive lock on `folder` (flock on the folder itself: no lock file is left behind).

    Where locks are not available (no fcntl, or a file system without them) it holds nothing.
    """
    fd = os.open(folder, os.O_RDONLY)
    try:
        if fcntl is not None:
            with contextlib.suppress(OSError):  # e.g. ENOLCK on some network file systems
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def build_once(path: str, build: Callable[[], T]) -> T | None:
    """Make sure `path` is a whole entry (`intact`); otherwise delete it and `build()` it again, then seal it.

    Args:
        path: the built file.
        build: makes the file at `path` (it must be complete there when `build` returns), while this
            process holds the lock on `path`'s folder (created if missing): another process building the
            same entry meanwhile waits, then finds it whole and builds nothing.
    Returns:
        `build()`'s result if it ran, else None (the entry was whole).
    Raises:
        whatever `build` raises (the entry is left unsealed: the next call builds again).
    """
    if intact(path):
        return None
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    with locked(folder):
        if intact(path):  # another process built it while this one waited
            return None
        discard(path)
        result = build()
        seal(path)
        return result
