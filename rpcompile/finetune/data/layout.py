"""Packing layouts: which tokens of a token cache go into which sequence, from its offsets and targets alone.

    >>> lay = layout(cache, seq=512, packing="whole"); len(lay.bounds) - 1   # doctest: +SKIP
    3911

A layout is plain arrays: sequence r is the segments bounds[r]:bounds[r + 1], each
the cache tokens starts[k]:starts[k] + lengths[k]. The packings and their rules
are `rpcompile.finetune.data.packing`'s module docstring; no token id is read here, only the
document offsets and the target flags (counted BLOCK tokens at a time, so the
work memory does not grow with the data).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from rpcompile.finetune.data.cache_files import TokenCache

__all__ = ["Layout", "layout", "check_packing", "PACKINGS", "NothingToTrain"]

PACKINGS = ("whole", "split", "none")  # --packing choices
BLOCK = 1 << 18  # tokens counted at once when the layout counts targets (2 MiB of int64 counts)


@dataclass(frozen=True, eq=False)
class Layout:
    """Where each sequence's tokens are in the cache, and what the packing kept (`rpcompile.finetune.data.packing.Packed`)."""

    starts: np.ndarray  # int64 (segments,): each segment's first token in the cache
    lengths: np.ndarray  # int64 (segments,)
    bounds: np.ndarray  # int64 (sequences + 1,): sequence r is segments bounds[r]:bounds[r + 1]
    selection: np.ndarray  # int64: the cache's documents packed (ascending)
    tokens: int  # real (non-padding) tokens, EOS included
    documents: int  # documents packed
    truncated: int  # documents cut to `seq` tokens (whole, none)
    dropped: int  # documents (or split sequences) left out: nothing in them to train
    trained: int  # targets after the causal shift (each sequence's first token excluded)


def check_packing(packing: str, seq: int) -> None:
    """Raise ValueError for an unknown packing or `seq` < 2."""
    if packing not in PACKINGS:
        raise ValueError(f"--packing must be one of {PACKINGS}, got {packing!r}")
    if seq < 2:
        raise ValueError(f"seq must be >= 2 tokens, got {seq}")


def layout(cache: TokenCache, seq: int, packing: str = "whole", documents: Iterable[int] | None = None) -> Layout:
    """The layout of the cache's documents (all, or `documents`: cache indices) in sequences of `seq` tokens.

    Args:
        cache: a `TokenCache` (rpcompile.finetune.data.cache_files).
        seq: tokens per sequence.
        packing: "whole", "split" or "none" (`rpcompile.finetune.data.packing`).
        documents: the documents to pack, in any order (laid out in cache order); None: all.
    Returns:
        A `Layout`.
    Raises:
        ValueError: an unknown packing, `seq` < 2, a document index out of range, or nothing
            left to train on.
    """
    check_packing(packing, seq)
    n = cache.documents
    sel = np.arange(n, dtype=np.int64) if documents is None else np.unique(np.fromiter(documents, np.int64))
    if sel.size and (sel[0] < 0 or sel[-1] >= n):
        raise ValueError(f"document {int(sel[0] if sel[0] < 0 else sel[-1])} is out of range: the data holds {n}")
    cache.check()  # a cache file truncated under this run: OSError naming it, not SIGBUS
    start = cache.offsets[sel]
    full = cache.offsets[sel + 1] - start
    if packing == "split":
        return _split(cache, seq, sel, start, full)
    length = np.minimum(full, seq)
    targets = _count(cache.trained, start, start + length)  # a document's first token is never one
    keep = targets > 0
    if not keep.any():
        raise _nothing(len(sel))
    start, length = start[keep], length[keep]
    if packing == "whole":
        order, bounds = _first_fit_decreasing(length, seq)
        start, length = start[order], length[order]
    else:
        bounds = np.arange(len(start) + 1, dtype=np.int64)
    return Layout(start, length, bounds, sel, int(length.sum()), int(keep.sum()), int((full > seq).sum()),
                  int((~keep).sum()), int(targets[keep].sum()))


def _split(cache: TokenCache, seq: int, sel: np.ndarray, start: np.ndarray, full: np.ndarray) -> Layout:
    """--packing split: the documents end to end, cut every `seq` tokens, a segment per piece of a document."""
    at = np.cumsum(full) - full  # each document's first token in the concatenation
    total = int(full.sum())
    if total % seq == 1:
        total -= 1  # a one-token last sequence: nothing to predict after the shift
    if not total:
        raise _nothing(len(sel))
    cuts = np.union1d(at[at < total], np.arange(0, total, seq))  # segment starts: documents and sequences
    doc = np.searchsorted(at, cuts, side="right") - 1
    length = np.append(cuts[1:], total) - cuts
    begin = start[doc] + cuts - at[doc]  # in the cache
    bounds = np.searchsorted(cuts // seq, np.arange(-(-total // seq) + 1))
    lead = (cuts % seq == 0).astype(np.int64)  # a sequence's first token predicts nothing after the shift
    targets = np.add.reduceat(_count(cache.trained, begin + lead, begin + length), bounds[:-1])
    keep = targets > 0
    if not keep.any():
        raise _nothing(len(sel))
    per_row = np.diff(bounds)
    kept = np.repeat(keep, per_row)
    length, begin = length[kept], begin[kept]
    bounds = np.concatenate([[0], np.cumsum(per_row[keep])]).astype(np.int64)
    return Layout(begin, length, bounds, sel, int(length.sum()), len(sel), 0, int((~keep).sum()),
                  int(targets[keep].sum()))


class NothingToTrain(ValueError):
    """Documents that leave no target: `documents` of them (the caller names their file and the masking)."""

    def __init__(self, documents: int) -> None:
        super().__init__(f"the {documents} document(s) leave no token to train on (each document's first token "
                         f"predicts nothing, and the masking trains none of the rest)")
        self.documents = documents


def _nothing(n: int) -> NothingToTrain:
    """The error for documents that leave no target."""
    return NothingToTrain(n)


def _count(trained: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Targets in the token ranges lo[k]:hi[k] (lo <= hi), the stream counted BLOCK tokens at a time."""
    points = np.concatenate([lo, hi])
    order = np.argsort(points, kind="stable")
    p = points[order]
    below = np.zeros(len(p), np.int64)  # below[k]: targets before token p[k]
    i, total = int(np.searchsorted(p, 0, side="right")), 0
    for block in range(0, len(trained), BLOCK):
        counts = np.cumsum(trained[block:block + BLOCK], dtype=np.int64)
        j = int(np.searchsorted(p, block + len(counts), side="right"))
        below[i:j] = total + counts[p[i:j] - block - 1]
        i, total = j, total + int(counts[-1])
    at = np.empty(len(p), np.int64)
    at[order] = below
    return at[len(lo):] - at[:len(lo)]


def _first_fit_decreasing(lengths: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """(items in bin order, bin bounds): first-fit decreasing, a max segment tree finding the leftmost bin with room.

    Items are placed longest first (ties in index order); bin b holds order[bounds[b]:bounds[b + 1]]
    in the order they were placed.
    """
    size = 1
    while size < len(lengths):
        size *= 2
    room = [cap] * (2 * size)  # room[k]: the most room in the bins under node k (unopened bins: all of cap)
    visit = np.argsort(-lengths, kind="stable")
    need, placed = lengths.tolist(), []
    for i in visit.tolist():
        k = 1
        while k < size:
            k = 2 * k if room[2 * k] >= need[i] else 2 * k + 1
        placed.append(k - size)  # bins open left to right: the leftmost unopened one when none has room
        room[k] -= need[i]
        while k > 1:
            k //= 2
            room[k] = max(room[2 * k], room[2 * k + 1])
    bins = np.array(placed, np.int64)
    by_bin = np.argsort(bins, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(bins))]).astype(np.int64)
    return visit[by_bin], bounds
