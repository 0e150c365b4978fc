"""Packing: tokenized documents laid into fixed-length sequences that keep them apart.

    >>> p = pack(read_documents("chat.jsonl", tok), tok, seq=512, packing="whole")   # doctest: +SKIP
    >>> p.batch(step=0, size=8, seed=0)                   # doctest: +SKIP
    {'input_ids': (8, 512), 'labels': (8, 512), 'position_ids': (8, 512)}

Every document is tokenized, followed by the tokenizer's EOS, and labelled
(`rpcompile.finetune.data.token_cache`, which keeps the tokens on disk): its trained
tokens (`rpcompile.finetune.data`: a token is trained when its first character lies
in a trained span) keep their id as the label, the others get -100. A
document's first token is always -100: Hugging Face causal LMs shift the
labels inside the model, so that label would be predicted by the previous
document's last token, and no token predicts across a document boundary.

Positions (`position_ids`) restart at 0 at every document: they are what a
packed-attention path reads to keep documents apart (a new document starts
wherever the position is 0).

Packings:
    whole  (default) whole documents are bin-packed into sequences, first-fit decreasing (by
           length, ties in file order: deterministic); every sequence starts at a document
           start. A document longer than `seq` is truncated to its first `seq` tokens (counted
           in `Packed.truncated`). The rest of a sequence is padding.
    split  the documents are concatenated and cut every `seq` tokens (a document may continue
           into the next sequence). Positions restart at 0 at each document and also at the
           start of each sequence: a continued piece starts again at position 0 (it cannot see
           its beginning, which is in another sequence). A last sequence of one token is
           dropped (after the shift it has nothing to predict).
    none   one document per sequence (truncated to `seq`), padded; positions 0..seq-1.

Padding: the pad token (else EOS), label -100; under whole and split the padding
at the end of a sequence is a segment of its own with positions from 0, so no
real token is in its segment. A document, or (split) a sequence, with no target
left is dropped and counted in `Packed.dropped`: every sequence has at least one
target, so no microbatch mean is 0/0.

Memory: a `Packed` holds its token cache (memory-mapped) and a layout, each
sequence a few (start, length) segments of the cache's token stream; batches are
built from them when asked for, so no (sequences, seq) tensor of the whole data
exists unless `ids`, `labels` or `positions` is read.
"""
from __future__ import annotations

import hashlib
import numbers
from collections import abc
from dataclasses import dataclass, fields
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from rpcompile.finetune.data.encoding import special_ids
from rpcompile.finetune.data.layout import PACKINGS, check_packing, layout
from rpcompile.finetune.data.token_cache import CHUNK_CHARS, CHUNK_DOCS, TokenCache, build_cache

__all__ = ["IGNORE", "PACKINGS", "Packed", "pack", "pack_cache", "check_packing"]

IGNORE = -100  # the label of an untrained position (cross_entropy's ignore_index)


@dataclass(frozen=True, eq=False)
class Packed:
    """Packed sequences of one token cache: a layout from which batches are built on demand.

    Sequence r is the segments `bounds[r]:bounds[r + 1]`, each the cache tokens
    `starts[k]:starts[k] + lengths[k]` laid end to end (positions from 0 in each), then padding.
    """

    cache: TokenCache  # the tokens (rpcompile.finetune.data.token_cache)
    seq: int  # tokens per sequence
    packing: str  # "whole", "split" or "none"
    starts: np.ndarray  # int64 (segments,): each segment's first token in the cache
    lengths: np.ndarray  # int64 (segments,)
    bounds: np.ndarray  # int64 (sequences + 1,): sequence r is segments bounds[r]:bounds[r + 1]
    selection: np.ndarray  # int64: the cache's documents packed (ascending; all of them unless selected)
    tokens: int  # real (non-padding) tokens, EOS included
    documents: int  # documents packed
    truncated: int = 0  # documents cut to `seq` tokens (whole, none)
    dropped: int = 0  # documents (or split sequences) left out: nothing in them to train
    trained: int = 0  # targets after the causal shift: labels that are not -100, each sequence's first excluded
    cached: bool = False  # the tokens came from a token cache built by an earlier run (no tokenizer call)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @property
    def read(self) -> int:
        """Documents this was packed from, before any was left out (the file's rows, or the selection)."""
        return len(self.selection)

    @property
    def ids(self) -> torch.Tensor:
        """(sequences, seq) int64 token ids of every sequence, built now: for inspection and small data."""
        return self.rows(range(len(self)))["input_ids"]

    @property
    def labels(self) -> torch.Tensor:
        """(sequences, seq) int64: the ids where trained, -100 elsewhere (padding included), built now."""
        return self.rows(range(len(self)))["labels"]

    @property
    def positions(self) -> torch.Tensor:
        """(sequences, seq) int64 position ids, 0 at each document start, built now."""
        return self.rows(range(len(self)))["position_ids"]

    def rows(self, rows: Sequence[int], *, train: bool = True) -> dict[str, torch.Tensor]:
        """The batch of sequences `rows` (train=False: every label -100, a batch that weighs nothing)."""
        r = np.asarray(rows, dtype=np.int64).reshape(-1)
        n, seq = len(self), self.seq
        if r.size and (r.min() < -n or r.max() >= n):
            raise IndexError(f"sequence {int(r.max() if r.max() >= n else r.min())} is out of range for {n}")
        r = r % max(n, 1)
        b = len(r)
        count = self.bounds[r + 1] - self.bounds[r]  # segments per row (at least one)
        first = np.cumsum(count) - count  # each row's first segment in `seg`
        seg = np.repeat(self.bounds[r] - first, count) + np.arange(int(count.sum()))
        length = self.lengths[seg]
        base = np.cumsum(length) - length  # each segment's first token among all gathered
        within = np.arange(int(length.sum())) - np.repeat(base, length)  # position inside its segment
        src = np.repeat(self.starts[seg], length) + within
        at = base - np.repeat(base[first], count)  # each segment's offset in its row
        dest = np.repeat(np.repeat(np.arange(b) * seq, count) + at, length) + within
        ids = np.full(b * seq, self.cache.pad, np.int64)
        self.cache.check()  # a cache file truncated under this run: OSError naming it, not SIGBUS
        ids[dest] = self.cache.ids[src]
        labels = np.full(b * seq, IGNORE, np.int64)
        if train:
            labels[dest] = np.where(self.cache.trained[src] != 0, ids[dest], IGNORE)
        col = np.arange(seq)[None, :]
        used = np.add.reduceat(length, first) if b else np.zeros(0, np.int64)  # real tokens per row
        positions = np.broadcast_to(col if self.packing == "none" else col - used[:, None], (b, seq)).copy()
        positions.reshape(-1)[dest] = within  # padding: its own segment from 0 (none: continues the count)
        return {"input_ids": torch.from_numpy(ids.reshape(b, seq)), "labels": torch.from_numpy(labels.reshape(b, seq)),
                "position_ids": torch.from_numpy(positions)}

    def order(self, epoch: int, seed: int) -> torch.Tensor:
        """The sequence order of one epoch: a permutation drawn from (seed, epoch) alone."""
        return torch.randperm(len(self), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))

    def batch(self, step: int, size: int, seed: int) -> dict[str, torch.Tensor]:
        """The batch of training step `step`: sequences step*size .. step*size+size-1 of the shuffled epochs.

        The epochs are laid end to end (each its own permutation), so the data
        position is a function of the step alone and a resumed run reads on exactly
        where it stopped.

        Example:
            >>> data.batch(step=3, size=8, seed=0)["position_ids"].shape   # doctest: +SKIP
            torch.Size([8, 512])
        """
        return self.rows(self.batch_rows(step, size, seed))

    def batch_rows(self, step: int, size: int, seed: int) -> list[int]:
        """The sequences (indices) of training step `step`'s batch, in order (see `batch`)."""
        n = len(self)
        rows, orders = [], {}
        for k in range(step * size, step * size + size):
            epoch, i = divmod(k, n)
            if epoch not in orders:
                orders[epoch] = self.order(epoch, seed)
            rows.append(int(orders[epoch][i]))
        return rows

    def real_tokens(self, rows: Sequence[int]) -> int:
        """The real (non-padding) tokens of sequences `rows`, EOS included, from the layout alone.

            >>> data.real_tokens(data.batch_rows(step=3, size=8, seed=0))   # doctest: +SKIP
            3904
        """
        n = max(len(self), 1)
        return sum(int(self.lengths[self.bounds[r % n]:self.bounds[r % n + 1]].sum()) for r in rows)

    def eval_batches(self, size: int, *, fill: str = "repeat") -> abc.Sequence[dict[str, torch.Tensor]]:
        """Every sequence in file order, in batches of `size`; the last batch is filled up from the start.

        A sequence of batches (len, index, iterate), each built when it is read: the whole data never
        exists as tensors at once.

        Args:
            size: sequences per batch.
            fill: "repeat": the filler sequences count like the others; "ignore": their labels are
                all -100, so with a token-weighted loss every trained token counts exactly once.

        Example:
            >>> len(data.eval_batches(8)) == -(-len(data) // 8)   # doctest: +SKIP
            True
        """
        return _EvalBatches(self, size, fill)

    def fingerprint(self) -> str:
        """A sha256 of the tokens (the cache's content hash), the packing and the layout: same data, same hash.

        Cheap (it hashes the layout, not the tokens); what a run record keeps to check a resume.

        Example:
            >>> prepare("chat.jsonl", tok, seq=512).fingerprint()[:12]   # doctest: +SKIP
            'b1d0e6a4c29f'
        """
        h = hashlib.sha256(f"rpcompile.Packed 1 {self.cache.content} {self.seq} {self.packing} "
                           f"{self.cache.pad}".encode())
        for a in (self.selection, self.starts, self.lengths, self.bounds):
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        return h.hexdigest()

    def select(self, documents: Iterable[int]) -> Packed:
        """The same cache packed again (same seq and packing) from only the given documents (cache indices)."""
        return pack_cache(self.cache, self.seq, self.packing, documents=documents, cached=self.cached)

    def split_documents(self, size: float | int, seed: int = 0) -> tuple[Packed, Packed]:
        """(train, held): a seeded draw of this data's documents held out, each part packed on its own.

        Args:
            size: the held-out part: a fraction 0 < size < 1 of the documents (rounded, at least
                one), or a whole number >= 1 of documents; at least one document stays for training.
            seed: the draw (the same seed and data: the same documents).
        Returns:
            Two `Packed`s of disjoint documents; `held.selection` lists the held-out documents
            (indices in the data file's document order: document i is the file's i-th non-blank
            row). Each part drops, truncates and counts its own documents.
        Raises:
            ValueError: a size that leaves no document on one side; a part that trains nothing.

        Example:
            >>> train, held = data.split_documents(0.05, seed=0); held.selection[:3]   # doctest: +SKIP
            array([ 17, 402, 913])
        """
        n = len(self.selection)
        if isinstance(size, numbers.Integral) and not isinstance(size, bool):
            k = int(size)
        else:
            k = max(1, round(float(size) * n)) if isinstance(size, numbers.Real) and 0 < size < 1 else -1
        if not 1 <= k < n:
            raise ValueError(f"--val-size {size!r}: give a fraction between 0 and 1 or a number of documents "
                             f"from 1 to {n - 1} ({n} documents in the data)")
        draw = int.from_bytes(hashlib.sha256(f"rpcompile held-out {seed}".encode()).digest()[:8], "little")
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(draw >> 1)).numpy()
        held = np.sort(self.selection[perm[:k]])
        return self.select(np.setdiff1d(self.selection, held)), self.select(held)


class _EvalBatches(abc.Sequence):
    """`Packed.eval_batches`: a sequence of batches, each built when it is read."""

    def __init__(self, packed: Packed, size: int, fill: str):
        self.packed, self.size, self.fill = packed, size, fill

    def __len__(self) -> int:
        return -(-len(self.packed) // self.size)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"batch {i} of {len(self)}")
        n, size = len(self.packed), self.size
        start = (i % len(self)) * size
        b = self.packed.rows([k % n for k in range(start, start + size)])
        if self.fill == "ignore" and start + size > n:
            b["labels"][n - start:] = IGNORE
        return b


def pack(docs: Iterable[Any], tokenizer: Any, seq: int, packing: str = "whole") -> Packed:
    """Tokenize and label `docs` (EOS after each) and pack them into sequences of `seq` tokens.

    The tokens go to a temporary token cache (nothing is written where a run keeps its files);
    `rpcompile.finetune.data.prepare` is the same for a data file, with a cache that later runs reuse.

    Args:
        docs: `rpcompile.finetune.data.Document`s (text, templated, trained spans, train_eos).
        tokenizer: a Hugging Face tokenizer with an EOS token (a fast one where spans are masked).
        seq: tokens per sequence.
        packing: "whole", "split" or "none" (the module docstring).
    Returns:
        A `Packed`.
    Raises:
        ValueError: an unknown packing, `seq` < 2, a tokenizer without EOS (or, for masked
            documents, without offsets), or nothing left to train on.

    Example:
        >>> p = pack([Document("hello", False)], tok, seq=8); p.labels[0]   # doctest: +SKIP
        tensor([-100,   72,   79,    2, -100, -100, -100, -100])
    """
    check_packing(packing, seq)
    special_ids(tokenizer)
    return pack_cache(build_cache(_chunked(docs), tokenizer, None), seq, packing)


def _chunked(docs: Iterable[Any]) -> Iterator[list[Any]]:
    """`docs` in lists of at most CHUNK_DOCS documents or CHUNK_CHARS characters (one tokenizer call each)."""
    chunk, chars = [], 0
    for d in docs:
        chunk.append(d)
        chars += len(d.text)
        if len(chunk) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def pack_cache(cache: TokenCache, seq: int, packing: str = "whole", *, documents: Iterable[int] | None = None,
               cached: bool = False) -> Packed:
    """Pack the documents of a token cache (all, or `documents`: cache indices) into sequences of `seq` tokens.

    Args:
        cache: a `TokenCache` (rpcompile.finetune.data.token_cache).
        seq: tokens per sequence.
        packing: "whole", "split" or "none" (the module docstring).
        documents: the documents to pack, in any order (packed in cache order); None: all.
        cached: recorded as `Packed.cached`.
    Returns:
        A `Packed`; only its layout is built (`rpcompile.finetune.data.layout`), no token is read.
    Raises:
        ValueError: an unknown packing, `seq` < 2, a document index out of range, or nothing
            left to train on.

    Example:
        >>> len(pack_cache(cache, 512, "split", documents=range(100)))   # doctest: +SKIP
        14
    """
    lay = layout(cache, seq, packing, documents)
    return Packed(cache, seq, packing, **{f.name: getattr(lay, f.name) for f in fields(lay)}, cached=cached)
