"""Checkpoint files: written atomically, verified on load.

A file is MAGIC, the payload's length and SHA-256, then the payload (a
`torch.save` of the state dict). It is written to a temporary file in the same
folder, flushed to disk and renamed over the target, so a crash mid-write
leaves the previous checkpoint untouched; a truncated or altered file is
detected on load. Saving and loading stream the payload (no copy of it in
memory), and a temporary file a killed save left is removed by the next save
or load of the same path.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "ckpt.rp")
    >>> save({"format": FORMAT, "steps": 3}, p); load(p)["steps"]
    3
"""
from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

FORMAT = "rpcompile-checkpoint-1"   # the `format` entry of every state dict
MAGIC = b"RPCKPT01"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256 of the payload
_CHUNK = 1 << 22  # bytes hashed at a time on load


def save(state: dict[str, Any], path: str) -> None:
    """Write `state` to `path` atomically (temporary file + fsync + rename), streaming: no copy of the payload.

    `torch.save` writes into the temporary file through a hashing writer; the header (length and
    SHA-256) is written last, over a placeholder. A temporary file that a killed save left for this
    path is removed first.
    """
    folder, base = os.path.split(os.path.abspath(path))
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.tmp-{os.getpid()}-", suffix=".rp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * _HEADER.size)
            out = _HashingWriter(f)
            torch.save(state, out)
            f.seek(0)
            f.write(_HEADER.pack(MAGIC, out.size, out.sha.digest()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str) -> dict[str, Any]:
    """Read and verify a checkpoint; ValueError names the file if it is truncated or corrupt.

    The payload is hashed in chunks, then unpickled straight from the file: loading needs no
    memory beyond the tensors it builds (and one tensor's read buffer).
    """
    remove_stale_temporaries(path)
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise ValueError(f"checkpoint {path!r} is truncated ({len(head)} bytes, not even a header)")
        magic, n, digest = _HEADER.unpack(head)
        if magic != MAGIC:
            raise ValueError(f"{path!r} is not an rpcompile checkpoint (bad magic {magic!r})")
        sha, got = hashlib.sha256(), 0
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            sha.update(chunk)
            got += len(chunk)
        if got != n:
            raise ValueError(f"checkpoint {path!r} is truncated: {got} of {n} payload bytes")
        if sha.digest() != digest:
            raise ValueError(f"checkpoint {path!r} is corrupt: its SHA-256 does not match")
        f.seek(_HEADER.size)
        state = torch.load(_OffsetReader(f, _HEADER.size), weights_only=False)
    check(state)
    return state


def shard_path(path: str, rank: int, world: int) -> str:
    """The file of rank `rank`'s slice of a sharded checkpoint (`shard_state`): `path` itself for rank 0.

    >>> shard_path("run.ckpt", 0, 2), shard_path("run.ckpt", 1, 2)
    ('run.ckpt', 'run.ckpt.shard1-of-2')
    """
    return path if rank == 0 else f"{path}.shard{rank}-of-{world}"


def other_slices(path: str, sd: dict[str, Any]) -> Iterator[dict[str, Any]] | tuple:
    """The host state dicts of the other ranks' slices of sharded checkpoint `sd` (rank 0's, read from `path`),
    loaded one at a time (`shard_path`); none for a checkpoint of whole state. Pass them to
    `Compiled.load_state_dict(sd, slices=...)`: each process keeps what it owns, on any number of ranks.

    Raises:
        ValueError: a slice file is missing, or belongs to another checkpoint (rank, world or step).
    """
    rank, world = sd["host"].get("shard") or (0, 1)
    if world > 1 and rank != 0:
        raise ValueError(f"checkpoint {path!r} holds rank {rank} of {world}'s slice; load rank 0's file "
                         f"({path.rsplit('.shard', 1)[0]!r})")
    files = [shard_path(path, r, world) for r in range(1, world)]
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise ValueError(f"checkpoint {path!r} was written by {world} ranks, but the slices {missing} are missing")
    return _read_slices(files, sd) if files else ()


def _read_slices(files: list[str], sd: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The host state dicts of ranks 1.. in `files`, each checked against rank 0's `sd`, one at a time."""
    world = len(files) + 1
    for r, other in enumerate(files, start=1):
        part = load(other)
        if list(part["host"].get("shard") or ()) != [r, world] or part["steps"] != sd["steps"]:
            raise ValueError(f"checkpoint slice {other!r} is not rank {r} of {world}'s at step {sd['steps']} (it "
                             f"holds {part['host'].get('shard')} at step {part['steps']})")
        yield part["host"]


def remove_stale_temporaries(path: str) -> list[str]:
    """Remove the temporary files that killed saves of `path` left (their process is gone); returns them.

    A save writes `.NAME.tmp-PID-XXXX.rp` beside NAME; one whose process still runs is another
    save in progress and stays.
    """
    folder, base = os.path.split(os.path.abspath(path))
    prefix, gone = f".{base}.tmp-", []
    try:
        names = os.listdir(folder)
    except OSError:
        return gone
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".rp")):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(folder, name))
            gone.append(name)
        except OSError:
            pass
    return gone


def _alive(pid: int) -> bool:
    """True if process `pid` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _HashingWriter:
    """A write-only file for `torch.save`: writes through to `f`, hashing and counting the bytes."""

    def __init__(self, f) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


class _OffsetReader:
    """File `f` seen from byte `offset` on (the payload after the header), for `torch.load`."""

    def __init__(self, f, offset: int) -> None:
        self.f, self.offset = f, offset

    def read(self, n: int = -1) -> bytes:
        return self.f.read(n)

    def readinto(self, b) -> int:
        return self.f.readinto(b)

    def readline(self, *args) -> bytes:
        return self.f.readline(*args)

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.f.seek(pos + self.offset if whence == 0 else pos, whence) - self.offset

    def tell(self) -> int:
        return self.f.tell() - self.offset


def check(state: dict[str, Any]) -> None:
    """Raise ValueError unless `state` is an rpcompile state dict of this format."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not an rpcompile state dict of format {FORMAT!r} (got {got!r})")


def write_text_atomic(path: str, text: str) -> None:
    """Write `text` (e.g. a `json.dumps`) to `path` atomically: temporary file in the same folder, fsync, os.replace.

    A failure (a full disk, an exception, a kill) leaves the previous file untouched; the
    temporary file is removed unless the process was killed outright.

        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "run.json")
        >>> write_text_atomic(p, '{"steps": 3}'); open(p).read()
        '{"steps": 3}'
    """
    folder, base = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.tmp-{os.getpid()}-", dir=folder)  # like `save`'s, without .rp
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o644)  # not mkstemp's 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
