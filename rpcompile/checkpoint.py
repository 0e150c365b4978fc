"""Checkpoint files: written atomically, verified on load.

A file is MAGIC, the payload's length and SHA-256, then the payload (a
`torch.save` of the state dict). It is written to a temporary file in the same
folder, flushed to disk and renamed over the target, so a crash mid-write
leaves the previous checkpoint untouched; a truncated or altered file is
detected on load.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "ckpt.rp")
    >>> save({"format": FORMAT, "steps": 3}, p); load(p)["steps"]
    3
"""
from __future__ import annotations

import hashlib
import io
import os
import struct
import tempfile
from typing import Any

import torch

FORMAT = "rpcompile-checkpoint-1"   # the `format` entry of every state dict
MAGIC = b"RPCKPT01"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256 of the payload


def save(state: dict[str, Any], path: str) -> None:
    """Write `state` to `path` atomically (temporary file + fsync + rename)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".rp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_HEADER.pack(MAGIC, len(data), hashlib.sha256(data).digest()))
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str) -> dict[str, Any]:
    """Read and verify a checkpoint; ValueError names the file if it is truncated or corrupt."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < _HEADER.size:
        raise ValueError(f"checkpoint {path!r} is truncated ({len(raw)} bytes, not even a header)")
    magic, n, digest = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ValueError(f"{path!r} is not an rpcompile checkpoint (bad magic {magic!r})")
    data = raw[_HEADER.size:]
    if len(data) != n:
        raise ValueError(f"checkpoint {path!r} is truncated: {len(data)} of {n} payload bytes")
    if hashlib.sha256(data).digest() != digest:
        raise ValueError(f"checkpoint {path!r} is corrupt: its SHA-256 does not match")
    state = torch.load(io.BytesIO(data), weights_only=False)
    check(state)
    return state


def check(state: dict[str, Any]) -> None:
    """Raise ValueError unless `state` is an rpcompile state dict of this format."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not an rpcompile state dict of format {FORMAT!r} (got {got!r})")
