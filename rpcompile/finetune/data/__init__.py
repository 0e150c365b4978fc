"""Fine-tuning data: documents from a .txt or .jsonl file, each with the characters it trains on.

The data side of the fine-tuning library (`rpcompile.finetune`); this folder holds the path from a
file to batches, in order:

    rows.py         what one data row means, as a `Document` (its text and the characters it trains on)
    encoding.py     documents to token ids and targets; a tokenizer's fingerprint
    token_cache.py  the memory-mapped token cache on disk, built in one streaming pass
    cache_files.py  the token cache's files: their format, written, then opened and checked
    layout.py       packing layouts: which tokens of a cache go into which sequence
    packing.py      packed sequences as a layout over the cache, batches built on demand

    >>> data = prepare("chat.jsonl", tokenizer, seq=512, cache_root="out/token-cache")   # doctest: +SKIP
    >>> data.batch(step=0, size=8, seed=0).keys()                  # doctest: +SKIP
    dict_keys(['input_ids', 'labels', 'position_ids'])
    >>> docs = read_documents("chat.jsonl", tokenizer)             # the documents as a list  # doctest: +SKIP

`prepare` is the whole path from a file to packed sequences: it reads the file
in one streaming pass, tokenizes it into a token cache (`rpcompile.finetune.data.token_cache`:
memory-mapped arrays on disk, found again by later runs and resumes, which then
never call the tokenizer) and packs it (`rpcompile.finetune.data.packing`). `iter_documents`
yields the documents one by one as the file is read; `read_documents` lists them.

Formats (the kind of row is detected per file; a file mixes no kinds):
    .txt        one document per non-blank line, or the whole file as one document (`whole_file=True`).
    .jsonl      one JSON object per line, one of:
        text               {"text": "..."} (another key with `text_field`, `--text-field NAME`);
        messages           {"messages": [{"role": "system|user|assistant", "content": "..."}, ...]};
        sharegpt           {"conversations": [{"from": "system|human|gpt", "value": "..."}, ...]},
                           read as messages (human -> user, gpt -> assistant);
        prompt/completion  {"prompt": "...", "completion": "..."}: the text prompt + completion.

Conversations (messages and sharegpt rows) are rendered with the chat template
(the tokenizer's, or `chat_template`); without one they are refused: there is no
"role: content" fallback.

What is trained (`train_on`; None picks "assistant" for conversations and
"all" for text):
    assistant  every assistant message. For assistant message i the trained characters run
               from the end of render(messages[:i], add_generation_prompt=True) to the end of
               render(messages[:i+1]): the reply and whatever the template closes it with (the
               end-of-turn marker). Both renders must be prefixes of render(messages).
    last       only the final assistant message, by the same rule.
    all        every token of the rendered conversation.
A token is trained when its first character lies in a trained span (the fast
tokenizer's offsets, `return_offsets_mapping`); the tokens a tokenizer adds
itself (a BOS: empty offsets) are not. A conversation with no assistant message
is refused under assistant and last (it has nothing to train). The EOS that
packing puts after each document is trained under all, never after a masked
conversation (its closing marker ends it).

Prompt/completion rows train the completion and the EOS after it, every prompt
token -100 (under `all`: everything). Text rows train everything; assistant and
last are refused for them.

Files are read as UTF-8 (a leading BOM is skipped), line by line, split at "\n"
only, dropping one trailing "\r" per line: U+2028, U+2029 and U+0085 are
characters inside a line, as JSON allows them unescaped in strings (not
`str.splitlines`, which splits at them). Errors name the file and the line; as
the file is read in order, the first bad line is the one reported.

What one row means as a `Document` is `rpcompile.finetune.data.rows`. Packing into
sequences (positions, document boundaries, truncation) is `rpcompile.finetune.data.packing`;
`Document`, `pack`, `Packed` and `IGNORE` are re-exported here.
"""
from __future__ import annotations

import codecs
import json
import os
import shutil
from dataclasses import asdict, dataclass
from typing import Any, Iterator

from rpcompile.finetune.data.encoding import special_ids
from rpcompile.finetune.data.packing import IGNORE, PACKINGS, Packed, check_packing, pack, pack_cache  # re-exported
from rpcompile.finetune.data.layout import NothingToTrain  # re-exported
from rpcompile.finetune.data.rows import CONVERSATIONAL, TRAIN_ON, Document, row_document, row_kind, text_only  # re-exported
from rpcompile.finetune.data.token_cache import CHUNK_CHARS, CHUNK_DOCS, build_cache, cache_key, cached

__all__ = ["Document", "Reader", "reader", "iter_documents", "read_documents", "prepare", "read_template", "pack",
           "Packed", "IGNORE", "TRAIN_ON", "PACKINGS", "NothingToTrain", "CONVERSATIONAL", "file_kind"]

@dataclass(frozen=True, slots=True)
class Reader:
    """How one data file is read (made by `reader`, which checks the settings): plain, picklable data.

    `chunks()` reads the file's raw lines in order; `parse(chunk, tokenizer, kind)` turns a chunk
    into Documents. Split so, the parsing (chat template included) can run in worker processes
    (`rpcompile.finetune.data.token_cache`, --num-proc) while the file is read once, in order, here.
    """

    path: str  # the data file
    jsonl: bool  # .jsonl (else .txt)
    whole_file: bool = False  # .txt: the whole file is one document
    train_on: str | None = None  # "assistant", "last", "all" or None (see the module docstring)
    text_field: str = "text"  # the key of the text in text rows
    template: str | None = None  # the chat template in use (the one given, else the tokenizer's)

    def settings(self) -> dict[str, Any]:
        """What decides the documents besides the file's bytes (part of the token cache's key)."""
        return {k: v for k, v in asdict(self).items() if k != "path"}

    def chunks(self) -> Iterator[tuple[int, list[bytes]]]:
        """(first line number, raw lines with their "\n") in order, a chunk per tokenizer call; BOM skipped.

        With `whole_file` the whole file is one chunk of one "line".
        """
        with open(self.path, "rb") as f:
            if self.whole_file:
                yield 1, [_no_bom(f.read())]
                return
            lines, size, first = [], 0, 1
            for lineno, raw in enumerate(f, 1):
                lines.append(_no_bom(raw) if lineno == 1 else raw)
                size += len(raw)
                if len(lines) >= CHUNK_DOCS or size >= CHUNK_CHARS:
                    yield first, lines
                    lines, size, first = [], 0, lineno + 1
            if lines:
                yield first, lines

    def parse(self, chunk: tuple[int, list[bytes]], tokenizer: Any, kind: Any) -> tuple[list[Document], Any]:
        """The Documents of one chunk and the file's row kind: (kind, its first line), None before any row."""
        first, lines = chunk
        if not self.jsonl:
            if self.whole_file:
                text = _decode(lines[0], first, self.path)
                return ([Document(text, False)] if text.strip() else []), "text"
            return [Document(t, False) for t in (_line(raw, n, self.path) for n, raw in enumerate(lines, first))
                    if t.strip()], "text"
        docs = []
        for lineno, raw in enumerate(lines, first):
            line = _line(raw, lineno, self.path)
            if line.strip():
                doc, kind = self._row(line, lineno, tokenizer, kind)
                docs.append(doc)
        return docs, kind

    def _row(self, line: str, lineno: int, tokenizer: Any, kind: Any) -> tuple[Document, Any]:
        """One non-blank .jsonl line as a Document; the first row fixes the file's kind."""
        where = f"data file {self.path!r} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not JSON: {exc.msg} (column {exc.colno})") from None
        this = row_kind(obj, self.text_field)
        if this is None:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"{where}: needs a {self.text_field!r} string, a 'messages' list, a sharegpt "
                             f"'conversations' list, or 'prompt' and 'completion' strings; found {keys}")
        if kind is None:
            kind = (this, lineno)
            if this == "text":
                text_only(self.train_on, self.path)
            if this in CONVERSATIONAL and not self.template:
                raise ValueError(f"{where}: {this} rows are rendered with a chat template and the tokenizer has "
                                 f"none; give one with --chat-template FILE")
        elif this != kind[0]:
            raise ValueError(f"{where} is a {this} row, but line {kind[1]} is a {kind[0]} row (one kind of row per "
                             f"file)")
        return row_document(obj, kind[0], where, tokenizer, self.train_on, self.text_field, self.template), kind

    def documents(self, tokenizer: Any) -> Iterator[Document]:
        """Every document of the file, in order, read as they are reached; ValueError when there is none."""
        kind, n = None, 0
        for chunk in self.chunks():
            docs, kind = self.parse(chunk, tokenizer, kind)
            n += len(docs)
            yield from docs
        if not n:
            raise self.empty()

    def empty(self) -> ValueError:
        """The error for a file without documents."""
        return ValueError(f"data file {self.path!r} holds no documents (it is empty or blank)")


def reader(path: str, tokenizer: Any = None, *, whole_file: bool = False, train_on: str | None = None,
           text_field: str = "text", chat_template: str | None = None) -> Reader:
    """The `Reader` of a data file, its settings checked (nothing is read yet); `read_documents`'s arguments.

    Raises:
        FileNotFoundError / ValueError: as `read_documents`, for what is known before reading.
    """
    if train_on not in (None, *TRAIN_ON):
        raise ValueError(f"--train-on must be one of {TRAIN_ON}, got {train_on!r}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".txt":
        text_only(train_on, path)
    elif ext == ".jsonl":
        if whole_file:
            raise ValueError(f"--whole-file applies to .txt files, not {path!r}")
    else:
        raise ValueError(f"data file {path!r}: unknown extension {ext!r}; use .txt (text) or .jsonl "
                         f"(text, messages, sharegpt or prompt/completion rows)")
    return Reader(path, ext == ".jsonl", whole_file, train_on, text_field,
                  chat_template or getattr(tokenizer, "chat_template", None))


def iter_documents(path: str, tokenizer: Any = None, *, whole_file: bool = False, train_on: str | None = None,
                   text_field: str = "text", chat_template: str | None = None) -> Iterator[Document]:
    """The documents of a data file one by one, read as they are reached (`read_documents`'s arguments).

    The settings are checked at once; the rows' errors are raised when the iteration reaches them.

    Example:
        >>> sum(len(d.text) for d in iter_documents("big.jsonl", tok))   # doctest: +SKIP
        118220113
    """
    return reader(path, tokenizer, whole_file=whole_file, train_on=train_on, text_field=text_field,
                  chat_template=chat_template).documents(tokenizer)


def read_documents(path: str, tokenizer: Any = None, *, whole_file: bool = False, train_on: str | None = None,
                   text_field: str = "text", chat_template: str | None = None) -> list[Document]:
    """The documents of a .txt or .jsonl file, with their trained characters (see the module docstring).

    Args:
        path: the data file.
        tokenizer: renders conversations with its chat template (needed only for those).
        whole_file: .txt only: the whole file is one document instead of one per line.
        train_on: "assistant", "last" or "all"; None: assistant for conversations, all for text.
        text_field: the key of the text in text rows.
        chat_template: a jinja chat template used instead of the tokenizer's.
    Returns:
        The documents, one per row, in file order.
    Raises:
        FileNotFoundError: no such file.
        ValueError: an unknown extension, bytes that are not UTF-8, no document at all, a line that
            is not JSON, a row of no known kind or of another kind than the file's first, a bad
            message, conversations without a chat template, a conversation with no assistant
            message under assistant/last, or assistant/last on text (each names the file, and the
            line where there is one).

    Example:
        >>> d = read_documents("chat.jsonl", tok)[0]; d.text[slice(*d.spans[0])]   # doctest: +SKIP
        'Paris.<|im_end|>\\n'
    """
    return list(iter_documents(path, tokenizer, whole_file=whole_file, train_on=train_on, text_field=text_field,
                               chat_template=chat_template))


def prepare(path: str, tokenizer: Any, *, seq: int, packing: str = "whole", whole_file: bool = False,
            train_on: str | None = None, text_field: str = "text", chat_template: str | None = None,
            cache_root: str | None = None, num_proc: int = 1) -> Packed:
    """A data file read, tokenized into a token cache (or found in one) and packed into sequences of `seq`.

    Args:
        path, tokenizer, whole_file, train_on, text_field, chat_template: as `read_documents`.
        seq: tokens per sequence.
        packing: "whole", "split" or "none" (`rpcompile.finetune.data.packing`).
        cache_root: the folder of token caches (finetune: OUT/token-cache); the cache of this file,
            these settings and this tokenizer is `<cache_root>/<key[:16]>/`, built when absent.
            None: a temporary cache, deleted (nothing is written there).
        num_proc: processes that read and tokenize the rows when the cache is built.
    Returns:
        A `Packed`; `Packed.cached` is True when its cache was found (the tokenizer was not
        called), `Packed.read` the documents read, `Packed.fingerprint()` what a run record
        keeps. `Packed.split_documents(fraction, seed)` holds out a seeded part for validation.
    Raises:
        FileNotFoundError / ValueError: as `read_documents` and `pack`; ValueError for num_proc < 1
            and for a file that changed while it was read (its cache is removed).
        RuntimeError: a --num-proc worker process died.

    Example:
        >>> prepare("chat.jsonl", tok, seq=512, cache_root="out/token-cache").cached   # doctest: +SKIP
        True
    """
    check_packing(packing, seq)
    if not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"--num-proc must be a whole number >= 1, got {num_proc!r}")
    special_ids(tokenizer)
    r = reader(path, tokenizer, whole_file=whole_file, train_on=train_on, text_field=text_field,
               chat_template=chat_template)
    stamp = _stamp(path)
    key = cache_key(path, r.settings(), tokenizer)
    build = dict(parse=r.parse, num_proc=num_proc, on_empty=r.empty)
    if cache_root is None:
        cache, hit = build_cache(r.chunks(), tokenizer, None, key=key, **build), False
    else:
        cache, hit = cached(cache_root, key, r.chunks(), tokenizer, **build)
    if not hit and _stamp(path) != stamp:  # the cache may hold another version than the key's
        if cache.folder is not None:
            shutil.rmtree(cache.folder, ignore_errors=True)
        raise ValueError(f"data file {path!r} changed while it was read; run again when it is complete")
    return pack_cache(cache, seq, packing, cached=hit)


def _stamp(path: str) -> tuple[int, int]:
    """(size, modification time in ns) of a file."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def file_kind(path: str, text_field: str = "text") -> str | None:
    """The kind of a data file's rows, from its first non-blank line: "text" for .txt, a `row_kind` for .jsonl
    (None: not a known row, or no row).

    Example:
        >>> file_kind("chat.jsonl")   # doctest: +SKIP
        'messages'
    """
    if not path.lower().endswith(".jsonl"):
        return "text"
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    return row_kind(json.loads(_no_bom(raw)), text_field)
                except ValueError:  # not JSON (UnicodeDecodeError included)
                    return None
    return None


def read_template(path: str) -> str:
    """The jinja chat template in file `path` (--chat-template); FileNotFoundError or ValueError naming it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--chat-template {path!r} does not exist")
    with open(path, "rb") as f:
        text = _decode(_no_bom(f.read()), 1, path)
    if not text.strip():
        raise ValueError(f"--chat-template {path!r} is empty")
    return text


def _no_bom(raw: bytes) -> bytes:
    """`raw` without a leading UTF-8 byte order mark."""
    return raw[len(codecs.BOM_UTF8):] if raw.startswith(codecs.BOM_UTF8) else raw


def _decode(raw: bytes, lineno: int, path: str) -> str:
    """`raw` (from line `lineno` on) as UTF-8; ValueError naming the file and the line of a bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = lineno + raw[:exc.start].count(b"\n")
        raise ValueError(f"data file {path!r} line {line}: not UTF-8 text (byte {raw[exc.start]:#04x}: "
                         f"{exc.reason}); save it as UTF-8") from None


def _line(raw: bytes, lineno: int, path: str) -> str:
    """One raw line decoded, its "\n" and one trailing "\r" dropped (U+2028 and the like stay inside)."""
    line = _decode(raw, lineno, path)
    line = line[:-1] if line.endswith("\n") else line
    return line[:-1] if line.endswith("\r") else line
