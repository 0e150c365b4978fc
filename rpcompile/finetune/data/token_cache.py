"""Token cache: a data file tokenized once, in a streaming pass, into memory-mapped arrays on disk.

    >>> cache, hit = cached("out/token-cache", key, reader.chunks(), tok, parse=reader.parse)   # doctest: +SKIP
    >>> cache.tokens, cache.documents, hit                                                   # doctest: +SKIP
    (1843211, 50000, False)

A cache folder (`<cache_root>/<key[:16]>/`) holds four files: token ids, targets, document offsets
and meta.json; their format, and how a cache is checked when it is opened (its digest) and before
each read (its files' sizes), are `rpcompile.finetune.data.cache_files`.

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
import multiprocessing
import os
import secrets
import shutil
import sys
import tempfile
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from rpcompile.finetune.data.cache_files import FILES, META  # re-exported (tests and bench read the files)
from rpcompile.finetune.data.cache_files import FORMAT, Damaged, TokenCache, _open, _write, open_cache
from rpcompile.finetune.data.encoding import encode, special_ids, tokenizer_fingerprint

__all__ = ["TokenCache", "FORMAT", "cache_key", "build_cache", "open_cache", "cached", "CHUNK_DOCS", "CHUNK_CHARS",
           "Damaged"]

CHUNK_DOCS = 1024  # documents per tokenizer call, at most
CHUNK_CHARS = 1 << 18  # characters (or raw bytes) per tokenizer call, at most: bounds a chunk's memory
_END = object()  # the end of an iterator (next's default)
_WORKER: dict[str, Any] = {}  # filled in --num-proc worker processes only (their tokenizer and EOS id)


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
