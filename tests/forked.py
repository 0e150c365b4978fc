"""Damage a built kernel in the cache as a full disk or a stray write would, and load it in a process of its own.

`exit_status` forks: the child has mapped nothing the test process has not, and a signal that kills it (the
SIGBUS of mapping a truncated library) is its exit status, not the end of the test run. The check run there
should not use torch (OpenMP's thread pool does not survive a fork).
"""
import os
import shutil
import warnings
from collections.abc import Callable

from rpcompile.ir.cache import SEAL


def damaged_copy(built: str, path: str, how: str) -> None:
    """Copy the sealed entry `built` (the library and its seal) to `path` in another cache, then `damage` it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for suffix in ("", SEAL):
        shutil.copyfile(built + suffix, path + suffix)
    damage(path, how)


def damage(path: str, how: str) -> None:
    """Cut `path` to half its size ("truncated": what a link stopped by a full disk leaves) or overwrite it with
    as many garbage bytes ("garbage"), in place (nothing in this process may have it mapped)."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if how == "truncated":
            f.truncate(size // 2)
        elif how == "garbage":
            f.write((b"\x7fELF" + bytes(range(256)) * (size // 256 + 1))[:size])
        else:
            raise ValueError(f"damage: unknown kind {how!r}")


def exit_status(check: Callable[[], bool]) -> int:
    """Run `check()` in a forked child: 0 when it returns True, 1 when False or on an exception, minus the signal
    number when a signal killed it."""
    with warnings.catch_warnings():  # Python >= 3.12 warns of forking a threaded process: the child runs no torch
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            code = 0 if check() else 1
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
