"""Token cache: a data file tokenized once, in a streaming pass, into memory-mapped arrays on disk.

    >>> cache, hit = cached("out/token-cache", key, reader.chunks(), tok, parse=reader.parse)   # doctest: +SKIP
    >>> cache.tokens, cache.documents, hit                                                   # doctest: +SKIP
    (1843211, 50000, False)

A cache folder (`<cache_root>/<key[:16]>/`) holds four files:
    ids.i32      int32 (tokens,): every document's token ids with its EOS appended, documents end to end
    trained.u8   uint8 (tokens,): 1 where the token is a target (its label is its id), 0 where it is -100
    offsets.i64  int64 (documents + 1,): document d is tokens offsets[d]:offsets[d + 1]
    meta.json    the format, the key, documents, tokens, the EOS and pad ids, and `content`: the sha256 of
                 the three arrays (what `Packed.fingerprint` hashes)
The labels follow `rpcompile.finetune.data.encoding`'s rule (a document's first token is never a target, its
EOS is one when the document trains it, a token of a masked document is one when its first
character lies in a trained span).

The key (`cache_key`) is the sha256 of the data file's bytes, the settings it is read with and the
tokenizer's fingerprint (`tokenizer_fingerprint`: its vocabulary, merges, normalizer and
post-processor, special and added tokens, class and library versions; the chat template in use is in
the settings). A later run on the same file with the same tokenizer finds the folder and never calls
the tokenizer; a changed byte, setting or tokenizer gives another key and a new cache.

Memory: the documents are tokenized a chunk at a time (at most 1024 documents or 256 KiB of text per
tokenizer call) and appended to the files, so a build holds one chunk (per worker) at once, never all
documents or all token lists. The arrays are memory-mapped read-only: their pages are read from disk
as packing and batches touch them. A .txt file read whole (`whole_file`) is one document, and is
tokenized in one call.

A cache is checked when it is opened, never per batch: the files' sizes, then their sha256 against
meta.json's `content` (a streaming read: 0.7 GB/s on a 2-core Xeon, `bench/token_cache_checks.py`). A damaged cache (another size, another
digest: a file overwritten in place, a disk error) is not used: `cached` rebuilds it and says so in one
line. A file that shrinks while a run has it mapped would kill the process with SIGBUS at the next
read of a page past its new end, so every read of the arrays (`TokenCache.check`, called by the
layout and before each batch is gathered) first compares each file's size with its mapping's and
raises OSError naming the file (a check of one `fstat` per file).

A build writes into a temporary folder `<cache_root>/.tmp-<key[:16]>-<pid>-<random>` and renames it
into place when every file is written and synced, so a killed run never leaves a cache that is read;
the temporary folders of builders that no longer run are removed by the next build. Without a
cache_root the files go to a temporary folder (in TMPDIR: memory where that is a tmpfs) that is
deleted at once, the arrays staying mapped (their space is freed when the last mapping goes).

`num_proc` N > 1 parses and tokenizes in N worker processes (`TOKENIZERS_PARALLELISM=false` in
each), chunks handed out in order and their results written in order: the files are byte-identical
for every N, and a bad row raises the same error as with N = 1. The workers fork from a server
process that imports the tokenizer's library and this package once (a few seconds, the first time
in a process), so it pays on large files.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import mmap
import multiprocessing
import os
import secrets
import shutil
import sys
import tempfile
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from rpcompile.finetune.data.encoding import encode, special_ids, tokenizer_fingerprint

__all__ = ["TokenCache", "FORMAT", "cache_key", "build_cache", "open_cache", "cached", "CHUNK_DOCS", "CHUNK_CHARS",
           "Damaged"]

FORMAT = 1  # the cache's format version (part of the key: a new format never reads an old cache)
CHUNK_DOCS = 1024  # documents per tokenizer call, at most
CHUNK_CHARS = 1 << 18  # characters (or raw bytes) per tokenizer call, at most: bounds a chunk's memory
FILES = {"ids": ("ids.i32", np.int32), "trained": ("trained.u8", np.uint8), "offsets": ("offsets.i64", np.int64)}
META = "meta.json"
_END = object()  # the end of an iterator (next's default)
_WORKER: dict[str, Any] = {}  # filled in --num-proc worker processes only (their tokenizer and EOS id)


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


def cache_key(path: str, settings: dict[str, Any], tokenizer: Any) -> str:
    """The sha256 of the file at `path` (streamed), the settings it is read with and the tokenizer's fingerprint.

    Example:
        >>> cache_key("chat.jsonl", {"train_on": None, "template": tok.chat_template}, tok)[:16]  # doctest: +SKIP
        '9c1e0b7f4a2d6e83'
    """
    h = hashlib.sha256(json.dumps({"format": FORMAT, "settings": settings,
                                   "tokenizer": tokenizer_fingerprint(tokenizer)}, sort_keys=True).encode())
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_cache(chunks: Iterable[Any], tokenizer: Any, folder: str | None, *, key: str = "",
                parse: Callable[[Any, Any, Any], tuple[list[Any], Any]] | None = None, num_proc: int = 1,
                on_empty: Callable[[], Exception] | None = None) -> TokenCache:
    """Tokenize `chunks` into a cache in `folder` (written as is: `cached` does the atomic rename).

    Args:
        chunks: lists of `Document`s, or with `parse` anything it reads documents from (a data
            file's raw lines: `rpcompile.finetune.data.Reader.chunks`).
        tokenizer: a Hugging Face tokenizer with an EOS token.
        folder: where the files go (created); None: a temporary folder, deleted once the arrays
            are mapped.
        key: recorded in meta.json; "" records the content hash.
        parse: parse(chunk, tokenizer, state) -> (documents, state): state is None before the first
            chunk and what the previous call returned after it; picklable for num_proc > 1 (the
            chunks are parsed in order until the state is not None, then in the workers).
        num_proc: worker processes that parse and tokenize (1: this process).
        on_empty: raised (its result) when the chunks hold no document; None: an empty cache.
    Returns:
        The `TokenCache`, mapped read-only.

    Example:
        >>> build_cache([[Document("hello", False)]], tok, None).ids   # doctest: +SKIP
        array([72, 79,  2], dtype=int32)
    """
    eos, pad = special_ids(tokenizer)
    temp = folder is None
    folder = tempfile.mkdtemp(prefix="rpcompile-tokens-") if temp else folder
    try:
        os.makedirs(folder, exist_ok=True)
        meta = _write(folder, _encoded(chunks, tokenizer, eos, parse, num_proc), key, eos, pad, sync=not temp)
        if not meta["documents"] and on_empty is not None:
            raise on_empty()
        cache = _open(folder, None, verify=False)  # its digest was taken as it was written
        if cache is None:
            raise OSError(f"the token cache written to {folder!r} could not be read back")
    finally:
        if temp:
            shutil.rmtree(folder, ignore_errors=True)  # the mapped arrays stay readable
    return cache


def _encoded(chunks: Iterable[Any], tokenizer: Any, eos: int, parse: Callable | None,
             num_proc: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """encode() of each chunk's documents, in order (in `num_proc` worker processes when > 1)."""
    chunks, state = iter(chunks), None
    for chunk in chunks:  # in this process until the state is fixed (parse: the file's first row)
        docs, state = parse(chunk, tokenizer, state) if parse else (chunk, True)
        yield encode(docs, tokenizer, eos)
        if state is not None and num_proc > 1:
            break
    rest = next(chunks, _END)
    if rest is _END:  # nothing left for workers: none is started
        return
    modules = {__name__, type(tokenizer).__module__, *([parse.__module__] if parse else [])}
    pool = ProcessPoolExecutor(num_proc, mp_context=_context(sorted(modules)), initializer=_start_worker,
                               initargs=(tokenizer, eos))
    try:
        pending: deque = deque()
        for chunk in itertools.chain([rest], chunks):  # at most 2 chunks per worker in flight: bounded memory
            pending.append(pool.submit(_work, parse, chunk, state))
            if len(pending) >= 2 * num_proc:
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _context(modules: list[str]) -> Any:
    """The workers' start method: forkserver, its server preloading `modules` (else spawn).

    The workers fork from one process that imported those modules once: they start at once and
    share those pages. Where there is no forkserver (Windows), spawn: each worker imports them, and
    a script that starts it needs the `if __name__ == "__main__":` guard.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(modules)  # used when this process starts its server (once)
    return ctx


def _result(future: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A worker's result; a worker that died (killed, out of memory) is named as such."""
    try:
        return future.result()
    except BrokenProcessPool:
        raise RuntimeError("a --num-proc worker process died while tokenizing the data (killed, or out of "
                           "memory?); run again, or with --num-proc 1") from None


def _start_worker(tokenizer: Any, eos: int) -> None:
    """A worker process's start: its own tokenizer, no thread pool of the tokenizer's inside it."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tokenizer=tokenizer, eos=eos)


def _work(parse: Callable | None, chunk: Any, state: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """In a worker: one chunk parsed and encoded."""
    tok = _WORKER["tokenizer"]
    return encode(parse(chunk, tok, state)[0] if parse else chunk, tok, _WORKER["eos"])


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
        sizes = {"ids": meta["tokens"], "trained": meta["tokens"], "offsets": meta["documents"] + 1}
        content = meta["content"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
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


def cached(cache_root: str, key: str, chunks: Iterable[Any], tokenizer: Any, **build: Any) -> tuple[TokenCache, bool]:
    """The cache of `key` under `cache_root`, built from `chunks` (`build_cache`'s keywords) when absent.

    Returns:
        (the cache, True when it was found: then neither `chunks` nor the tokenizer was touched).

    Example:
        >>> cached("out/token-cache", key, reader.chunks(), tok, parse=reader.parse)[1]   # doctest: +SKIP
        True
    """
    folder = os.path.join(cache_root, key[:16])
    try:
        found = _open(folder, key)
    except Damaged as exc:
        print(f"token cache {folder}: damaged, {exc}; building it again", file=sys.stderr, flush=True)
        found = None
    if found is not None:
        return found, True
    os.makedirs(cache_root, exist_ok=True)
    _remove_abandoned(cache_root)
    temp = os.path.join(cache_root, f".tmp-{key[:16]}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        build_cache(chunks, tokenizer, temp, key=key, **build)
        if os.path.exists(folder) and open_cache(folder, key) is None:
            shutil.rmtree(folder)  # damaged, or another key with the same prefix: replaced (a mapping of the
            # old files stays readable: they are unlinked, not truncated)
        try:
            os.rename(temp, folder)
        except OSError:  # another run put the same cache there in the meantime: use that one
            pass
        _sync_folder(cache_root)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    try:
        cache = _open(folder, key, verify=False)  # written and synced just now (or by a run that checked it)
    except Damaged:
        cache = None
    if cache is None:
        raise OSError(f"the token cache {folder!r} could not be read back after it was written")
    return cache, False


def _remove_abandoned(cache_root: str) -> None:
    """Delete the temporary folders under `cache_root` whose builder process is gone (a killed run's)."""
    for name in os.listdir(cache_root):
        parts = name.split("-")
        if not name.startswith(".tmp-") or len(parts) != 4 or not parts[2].isdigit():
            continue
        pid = int(parts[2])
        try:
            if pid == os.getpid():
                continue
            os.kill(pid, 0)  # raises when no such process runs
        except ProcessLookupError:
            shutil.rmtree(os.path.join(cache_root, name), ignore_errors=True)
        except OSError:  # it runs, as another user
            pass


def _sync_folder(path: str) -> None:
    """fsync a folder, so a rename in it is on disk (where the platform allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
