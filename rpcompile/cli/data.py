"""Fine-tuning data: documents from a .txt or .jsonl file, tokenized and packed into fixed-length sequences.

    >>> docs = read_documents("train.jsonl", tokenizer)            # doctest: +SKIP
    >>> data = pack(docs, tokenizer, seq=512)                      # doctest: +SKIP
    >>> batch = data.batch(step=0, size=8, seed=0)                 # {"input_ids", "labels"}, (8, 512)

Formats:
    .txt    one document per non-blank line, or the whole file as one document (`whole_file=True`).
    .jsonl  one JSON object per line with a "text" string, or a chat "messages" list of
            {"role", "content"} dicts, formatted with the tokenizer's chat template when it has one.

Files are read as UTF-8 (a leading BOM is skipped) and split into lines at "\n"
only, dropping one trailing "\r" per line: U+2028, U+2029 and U+0085 are
characters inside a line, as JSON allows them unescaped in strings (not
`str.splitlines`, which splits at them).

Packing: every document is followed by the tokenizer's EOS and the documents are
concatenated and cut into sequences of `seq` tokens (a document may span two
sequences). The last sequence is filled up with the pad token; its labels there
are -100, so padding adds nothing to the loss. Labels are the input ids
(Hugging Face causal LMs shift them inside the model).

A last sequence that would hold a single token is dropped (with that token):
after the shift it has nothing to predict, so its mean loss would be 0/0 = NaN;
no target is lost, since a sequence's first token is never a target. Every
packed sequence holds at least 2 real tokens.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Document", "read_documents", "pack", "Packed", "IGNORE"]

IGNORE = -100  # the label of a padding position (cross_entropy's ignore_index)


@dataclass(frozen=True, slots=True)
class Document:
    """One training document as text, with how it was made (for the tokenizer's special tokens)."""

    text: str  # the document
    templated: bool  # True: made by the chat template, which adds its own special tokens


def read_documents(path: str, tokenizer: Any = None, *, whole_file: bool = False) -> list[Document]:
    """The documents of a .txt or .jsonl file.

    Args:
        path: the data file.
        tokenizer: formats chat `messages` with its chat template (needed only for those).
        whole_file: .txt only: the whole file is one document instead of one per line.
    Returns:
        The documents, in file order.
    Raises:
        FileNotFoundError: no such file.
        ValueError: an unknown extension, bytes that are not UTF-8, no document at all, a line that
            is not JSON, or a JSON line with neither a "text" string nor a "messages" list (each
            names the file, and the line where there is one).

    Example:
        >>> [d.text for d in read_documents("notes.txt")]   # doctest: +SKIP
        ['first line', 'second line']
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    ext = os.path.splitext(path)[1].lower()
    raw = _read_text(path)
    if ext == ".txt" and whole_file:
        docs = [Document(raw, False)] if raw.strip() else []
    elif ext == ".txt":
        docs = [Document(line, False) for line in _lines(raw) if line.strip()]
    elif ext == ".jsonl":
        if whole_file:
            raise ValueError(f"--whole-file applies to .txt files, not {path!r}")
        docs = [_json_document(line, path, i, tokenizer) for i, line in enumerate(_lines(raw), 1)
                if line.strip()]
    else:
        raise ValueError(f"data file {path!r}: unknown extension {ext!r}; use .txt (text) or .jsonl "
                         f"(objects with 'text' or 'messages')")
    if not docs:
        raise ValueError(f"data file {path!r} holds no documents (it is empty or blank)")
    return docs


def _read_text(path: str) -> str:
    """The file decoded as UTF-8 (BOM skipped); ValueError naming the file and the line of a bad byte."""
    with open(path, "rb") as f:
        blob = f.read()
    try:
        return blob.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = blob[:exc.start].count(b"\n") + 1
        raise ValueError(f"data file {path!r} line {line}: not UTF-8 text (byte {blob[exc.start]:#04x}: "
                         f"{exc.reason}); save it as UTF-8") from None


def _lines(text: str) -> list[str]:
    """`text` split at "\n" only, one trailing "\r" dropped per line (U+2028 and the like stay inside)."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _json_document(line: str, path: str, lineno: int, tokenizer: Any) -> Document:
    """One .jsonl line as a Document."""
    where = f"data file {path!r} line {lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not JSON: {exc.msg} (column {exc.colno})") from None
    if isinstance(obj, dict) and isinstance(obj.get("text"), str):
        return Document(obj["text"], False)
    if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
        return _chat_document(obj["messages"], where, tokenizer)
    keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
    raise ValueError(f"{where}: needs a 'text' string or a 'messages' list, found {keys}")


def _chat_document(messages: list, where: str, tokenizer: Any) -> Document:
    """Chat messages as text: the tokenizer's chat template, else 'role: content' lines."""
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: each message must be {{'role': str, 'content': str}}, got {m!r}")
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return Document(tokenizer.apply_chat_template(messages, tokenize=False), True)
    return Document("\n".join(f"{m['role']}: {m['content']}" for m in messages), False)


@dataclass(frozen=True, slots=True)
class Packed:
    """Packed token sequences: `ids` (n, seq) and `labels` (n, seq), -100 on padding."""

    ids: torch.Tensor  # (sequences, seq) int64 token ids
    labels: torch.Tensor  # (sequences, seq) int64: the ids, IGNORE where padded
    tokens: int  # real (non-padding) tokens, EOS included
    documents: int  # documents packed

    def __len__(self) -> int:
        return self.ids.shape[0]

    def order(self, epoch: int, seed: int) -> torch.Tensor:
        """The sequence order of one epoch: a permutation drawn from (seed, epoch) alone."""
        return torch.randperm(len(self), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))

    def batch(self, step: int, size: int, seed: int) -> dict[str, torch.Tensor]:
        """The batch of training step `step`: sequences step*size .. step*size+size-1 of the shuffled epochs.

        The epochs are laid end to end (each its own permutation), so the data
        position is a function of the step alone and a resumed run reads on exactly
        where it stopped.

        Example:
            >>> data.batch(step=3, size=8, seed=0)["input_ids"].shape   # doctest: +SKIP
            torch.Size([8, 512])
        """
        n = len(self)
        rows, cache = [], {}
        for k in range(step * size, step * size + size):
            epoch, i = divmod(k, n)
            if epoch not in cache:
                cache[epoch] = self.order(epoch, seed)
            rows.append(int(cache[epoch][i]))
        return {"input_ids": self.ids[rows], "labels": self.labels[rows]}

    def eval_batches(self, size: int) -> list[dict[str, torch.Tensor]]:
        """Every sequence in file order, in batches of `size`; the last batch is filled up from the start.

        Example:
            >>> len(data.eval_batches(8)) == -(-len(data) // 8)   # doctest: +SKIP
            True
        """
        n = len(self)
        out = []
        for start in range(0, n, size):
            rows = [k % n for k in range(start, start + size)]
            out.append({"input_ids": self.ids[rows], "labels": self.labels[rows]})
        return out


def pack(docs: list[Document], tokenizer: Any, seq: int) -> Packed:
    """Tokenize `docs`, put EOS after each, concatenate, and cut into sequences of `seq` tokens.

    Args:
        docs: from `read_documents`.
        tokenizer: a Hugging Face tokenizer with an EOS token.
        seq: tokens per sequence.
    Returns:
        A `Packed`; the last sequence is padded (pad token, else EOS; label -100). A last
        sequence of one token is dropped (it predicts nothing: see the module docstring).
    Raises:
        ValueError: the tokenizer has no EOS token, `seq` < 2, or the documents make a single token.

    Example:
        >>> p = pack([Document("hello", False)], tok, seq=8); p.labels[0]   # doctest: +SKIP
        tensor([  31,   72,   79,    2, -100, -100, -100, -100])
    """
    if seq < 2:
        raise ValueError(f"seq must be >= 2 tokens, got {seq}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) has no EOS token to separate documents; "
                         f"set eos_token in its tokenizer_config.json")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    encoded: list[list[int]] = [[] for _ in docs]
    for templated in (False, True):  # one batched tokenizer call per kind (a chat template adds its own BOS)
        idx = [i for i, d in enumerate(docs) if d.templated == templated]
        if idx:
            enc = tokenizer([docs[i].text for i in idx], add_special_tokens=not templated)["input_ids"]
            for i, ids in zip(idx, enc):
                encoded[i] = list(ids)
    flat = [t for ids in encoded for t in (*ids, eos)]
    if len(flat) % seq == 1:  # a one-token last sequence: 0 targets after the shift, a 0/0 loss
        flat.pop()
    if not flat:
        raise ValueError(f"the {len(docs)} document(s) make a single token (an EOS): nothing to train on")
    n = -(-len(flat) // seq)
    ids = torch.full((n * seq,), pad, dtype=torch.long)
    labels = torch.full((n * seq,), IGNORE, dtype=torch.long)
    ids[:len(flat)] = torch.tensor(flat, dtype=torch.long)
    labels[:len(flat)] = ids[:len(flat)]
    return Packed(ids.view(n, seq), labels.view(n, seq), len(flat), len(docs))
