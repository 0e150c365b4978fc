"""Plain-C libraries built once per machine into the kernels' cache folder and loaded with ctypes.

The planner (`passes/partition/native.py`) and the simulator (`runtime/sim/native.py`)
each keep a hot loop in C with no Python or torch headers. `load_library` builds
one with the machine's C compiler (`$CC`, else `cc`) into `cache_dir()`, under a
name keyed by the sources, the headers, the flags, the compiler and the
platform, so a changed source is a new file and later processes only load it.
The file is linked under a temporary name, renamed into place and sealed
(`rpcompile.ir.cache.build_once`): one whose size or digest is not its seal's
(a link cut short, garbage) is built again before anything maps it.
Where no compiler is found, the build fails, or the library's switch variable
is set to 0, it returns None and the caller runs its Python version instead.

    >>> spec = CLibrary("rpcompile_doc", sources=(), switch="RPCOMPILE_DOC_KERNEL")
    >>> spec.path().startswith(cache_dir())
    True
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass

from rpcompile.ir.cache import build_once, cache_dir

# no fused multiply-add, no fast math: the C does the Python's double operations, so the same floats bit for bit
FLAGS = ("-O2", "-std=c11", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math")

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CLibrary:
    """One C library: what it is built from and how it is switched off."""

    prefix: str                        # file name prefix in the cache folder
    sources: tuple[str, ...]           # .c files, compiled
    headers: tuple[str, ...] = ()      # included files: part of the build's key
    switch: str = ""                   # environment variable: "0" turns the library off
    flags: tuple[str, ...] = FLAGS     # compiler flags

    def compiler(self) -> str:
        """The C compiler: $CC, else cc."""
        return os.environ.get("CC") or "cc"

    def path(self) -> str:
        """Where this build lives: the cache folder, a name keyed by everything that changes the binary."""
        parts = []
        for name in self.sources + self.headers:
            with open(name, "rb") as f:
                parts.append(f.read())
        key = b"\0".join([*parts, repr(self.flags).encode(), self.compiler().encode(),
                          sysconfig.get_platform().encode()])
        return os.path.join(cache_dir(), f"{self.prefix}_{hashlib.sha256(key).hexdigest()[:16]}.so")

    def load(self) -> ctypes.CDLL | None:
        """The built library (built now if this machine has none yet), or None (see the module doc)."""
        if self.switch and os.environ.get(self.switch, "1") == "0":
            return None
        path = self.path()
        try:
            build_once(path, lambda: self._build(path))  # nothing when the file is whole (its seal's size, digest)
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            _log.info("%s is not available (%s); running its Python version instead", self.prefix, exc)
            return None
        try:
            return ctypes.CDLL(path)
        except OSError as exc:  # e.g. built for another machine sharing the cache folder
            _log.info("%s does not load (%s); running its Python version instead", path, exc)
            return None

    def _build(self, path: str) -> None:
        """Compile the sources into `path`: linked under a temporary name, then renamed (atomic)."""
        cc = self.compiler()
        if shutil.which(cc) is None:
            raise RuntimeError(f"no C compiler: {cc!r} is not on PATH (set CC)")
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
        os.close(fd)
        try:
            subprocess.run([cc, *self.flags, "-o", tmp, *self.sources], check=True, capture_output=True,
                           timeout=120)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
