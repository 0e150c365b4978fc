"""The token cache's files: their format on disk, writing them, and opening a folder of them (mapped, checked).

A cache folder (`<cache_root>/<key[:16]>/`) holds four files:
    ids.i32      int32 (tokens,): every document's token ids with its EOS appended, documents end to end
    trained.u8   uint8 (tokens,): 1 where the token is a target (its label is its id), 0 where it is -100
    offsets.i64  int64 (documents + 1,): document d is tokens offsets[d]:offsets[d + 1]
    meta.json    the format, the key, documents, tokens, the EOS and pad ids, and `content`: the sha256 of
                 the three arrays (what `Packed.fingerprint` hashes)
The labels follow `rpcompile.finetune.data.encoding`'s rule (a document's first token is never a target, its
EOS is one when the document trains it, a token of a masked document is one when its first
character lies in a trained span).

A cache is checked when it is opened, never per batch: the files' sizes, then their sha256 against
meta.json's `content` (a streaming read: 0.7 GB/s on a 2-core Xeon, `bench/token_cache_checks.py`). A damaged
cache (another size, another digest: a file overwritten in place, a disk error; a meta.json whose counts or ids
are not integers >= 0) is not used: `cached` rebuilds it and says so in one line. A file that shrinks while
a run has it mapped would kill the process with SIGBUS at the next read of a page past its new end, so every
read of the arrays (`TokenCache.check`, called by the layout and before each batch is gathered) first compares
each file's size with its mapping's and raises OSError naming the file (a check of one `fstat` per file).

Building a cache (its key, a data file tokenized in one streaming pass into these files, the folder
put in place atomically) is `rpcompile.finetune.data.token_cache`.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

__all__ = ["TokenCache", "FORMAT", "open_cache", "Damaged"]

FORMAT = 1  # the cache's format version (part of the key: a new format never reads an old cache)
FILES = {"ids": ("ids.i32", np.int32), "trained": ("trained.u8", np.uint8), "offsets": ("offsets.i64", np.int64)}
META = "meta.json"


@dataclass(frozen=True, eq=False)
class TokenCache:
    """The tokenized documents of one data file: three read-only arrays (see the module docstring)."""

    key: str  # what the cache was built from (`cache_key`); the content hash for an unkeyed one
    ids: np.ndarray  # int32 (tokens,)
    trained: np.ndarray  # uint8 (tokens,): 1 = target
    offsets: np.ndarray  # int64 (documents + 1,)
    eos: int  # the EOS id appended to each document
    pad: int  # the id that pads a sequence (the pad token, else EOS)
    content: str  # sha256 of the three arrays (checked against the files when the cache was opened)
    folder: str | None = None  # where the files are (None: deleted, only mapped)
    maps: tuple = field(default=(), repr=False)  # (file path, its mmap, bytes mapped) per mapped file

    def check(self) -> None:
        """Raise OSError naming a file that is now shorter than its mapping (a read past its end: SIGBUS).

        Cheap (an fstat per file): called before the arrays are read, so a cache file truncated under a
        running job is one line instead of a killed process.
        """
        for path, mapped, nbytes in self.maps:
            now = mapped.size()
            if now < nbytes:
                raise OSError(f"token cache file {path!r} shrank to {now:,} of its {nbytes:,} bytes while this run "
                              f"reads it (another program truncated or rewrote it); run again, and the damaged "
                              f"cache is rebuilt")

    @property
    def documents(self) -> int:
        """Documents in the cache (the file's rows that hold one)."""
        return len(self.offsets) - 1

    @property
    def tokens(self) -> int:
        """Tokens in the cache, each document's EOS included."""
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        """Bytes of the three arrays."""
        return self.ids.nbytes + self.trained.nbytes + self.offsets.nbytes


def _write(folder: str, encoded: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]], key: str, eos: int,
           pad: int, *, sync: bool) -> dict[str, Any]:
    """Append every encoded chunk to the files in `folder`, then meta.json (synced if `sync`); returns meta."""
    paths = {k: os.path.join(folder, name) for k, (name, _) in FILES.items()}
    hashes = {k: hashlib.sha256() for k in FILES}
    files = {k: open(p, "wb") for k, p in paths.items()}
    try:
        total, docs = 0, 0
        _append(files["offsets"], hashes["offsets"], np.zeros(1, np.int64))
        for ids, trained, lengths in encoded:
            _append(files["ids"], hashes["ids"], ids)
            _append(files["trained"], hashes["trained"], trained)
            _append(files["offsets"], hashes["offsets"], total + np.cumsum(lengths))
            total, docs = total + len(ids), docs + len(lengths)
        for f in files.values():
            f.flush()
            if sync:
                os.fsync(f.fileno())
    finally:
        for f in files.values():
            f.close()
    content = hashlib.sha256(b"".join(h.digest() for h in hashes.values())).hexdigest()
    meta = {"format": FORMAT, "key": key or content, "documents": docs, "tokens": total, "eos": eos, "pad": pad,
            "content": content}
    with open(os.path.join(folder, META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    return meta


def _append(f: Any, h: Any, a: np.ndarray) -> None:
    """Write `a`'s bytes to file `f` and hash them."""
    data = memoryview(np.ascontiguousarray(a)).cast("B")
    f.write(data)
    h.update(data)


class Damaged(ValueError):
    """A cache folder of the right key whose files do not hold what its meta.json says (the message says how)."""


def open_cache(folder: str, key: str | None = None) -> TokenCache | None:
    """The cache in `folder`, mapped read-only, its digest checked; None when it is missing, of another format
    or key, or damaged (`Damaged`: another size, another content)."""
    try:
        return _open(folder, key)
    except Damaged:
        return None


def _open(folder: str, key: str | None, *, verify: bool = True) -> TokenCache | None:
    """The cache in `folder` (None: missing, unreadable, another format or key); Damaged when its files are not
    what meta.json says: their sizes, and with `verify` their sha256 against its `content`."""
    try:
        with open(os.path.join(folder, META), encoding="utf-8") as f:
            meta = json.load(f)
        if meta["format"] != FORMAT or (key is not None and meta["key"] != key):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    _check_meta(meta)
    sizes = {"ids": meta["tokens"], "trained": meta["tokens"], "offsets": meta["documents"] + 1}
    content = meta["content"]
    paths = {k: os.path.join(folder, name) for k, (name, _) in FILES.items()}
    if verify:
        digest = hashlib.sha256(b"".join(_file_digest(paths[k]) for k in FILES)).hexdigest()
        if digest != content:
            raise Damaged(f"its files' sha256 is not the one in {META} (a file was changed in place)")
    arrays, maps = {}, []
    for k, (name, dtype) in FILES.items():
        arrays[k], mapped = _map(paths[k], dtype, sizes[k])
        if mapped is not None:
            maps.append((paths[k], mapped, len(mapped)))
    return TokenCache(meta["key"], arrays["ids"], arrays["trained"], arrays["offsets"], meta["eos"], meta["pad"],
                      content, folder, tuple(maps))


def _check_meta(meta: Any) -> None:
    """Damaged unless meta.json's counts and ids are integers >= 0 and its `content` is a sha256 in hex."""
    for name in ("documents", "tokens", "eos", "pad"):
        v = meta.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise Damaged(f"{META}'s {name!r} is {v!r}, not a count")
    c = meta.get("content")
    if not isinstance(c, str) or len(c) != 64 or c.strip("0123456789abcdef"):
        raise Damaged(f"{META}'s 'content' is {c!r}, not a sha256")


def _file_digest(path: str) -> bytes:
    """The sha256 digest of a file, read 1 MiB at a time; Damaged if it cannot be read."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as exc:
        raise Damaged(f"{os.path.basename(path)} cannot be read ({exc.strerror or exc})") from None
    return h.digest()


def _map(path: str, dtype: Any, n: int) -> tuple[np.ndarray, mmap.mmap | None]:
    """`n` items of `dtype` in file `path`, mapped read-only, and the mapping; Damaged when the file has another
    size (or is missing)."""
    want = n * np.dtype(dtype).itemsize
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != want:
                raise Damaged(f"{os.path.basename(path)} holds {size:,} bytes, not {want:,}")
            if not n:
                return np.zeros(0, dtype), None
            mapped = mmap.mmap(f.fileno(), want, access=mmap.ACCESS_READ)  # keeps its own descriptor
    except OSError as exc:
        raise Damaged(f"{os.path.basename(path)} cannot be read ({exc.strerror or exc})") from None
    return np.frombuffer(mapped, dtype=dtype, count=n), mapped
