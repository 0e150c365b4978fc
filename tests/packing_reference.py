"""The packing of issue 24 (before the token cache), kept verbatim as a reference: whole tensors in memory.

The oracle of tests/finetune/test_token_cache.py (the cache-backed `Packed` must give the
same tensors and batches bit for bit) and the "before" path of
bench/data_memory.py (its peak memory). Not used by the package.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

IGNORE = -100
PACKINGS = ("whole", "split", "none")


@dataclass(frozen=True, slots=True)
class Packed:
    """Packed sequences: `ids`, `labels` (-100 where untrained) and `positions`, each (n, seq) int64."""

    ids: torch.Tensor  # (sequences, seq) token ids
    labels: torch.Tensor  # (sequences, seq) the ids where trained, IGNORE elsewhere (padding included)
    positions: torch.Tensor  # (sequences, seq) position ids, 0 at each document start
    tokens: int  # real (non-padding) tokens, EOS included
    documents: int  # documents packed
    truncated: int = 0  # documents cut to `seq` tokens (whole, none)
    dropped: int = 0  # documents (or split sequences) left out: nothing in them to train

    def __len__(self) -> int:
        return self.ids.shape[0]

    @property
    def trained(self) -> int:
        """Targets after the causal shift: labels that are not -100, a sequence's first position excluded."""
        return int((self.labels[:, 1:] != IGNORE).sum())

    def rows(self, rows: Sequence[int], *, train: bool = True) -> dict[str, torch.Tensor]:
        """The batch of sequences `rows` (train=False: every label -100, a batch that weighs nothing)."""
        labels = self.labels[list(rows)]
        return {"input_ids": self.ids[list(rows)], "labels": labels if train else torch.full_like(labels, IGNORE),
                "position_ids": self.positions[list(rows)]}

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
        n = len(self)
        rows, cache = [], {}
        for k in range(step * size, step * size + size):
            epoch, i = divmod(k, n)
            if epoch not in cache:
                cache[epoch] = self.order(epoch, seed)
            rows.append(int(cache[epoch][i]))
        return self.rows(rows)

    def eval_batches(self, size: int, *, fill: str = "repeat") -> list[dict[str, torch.Tensor]]:
        """Every sequence in file order, in batches of `size`; the last batch is filled up from the start.

        Args:
            size: sequences per batch.
            fill: "repeat": the filler sequences count like the others; "ignore": their labels are
                all -100, so with a token-weighted loss every trained token counts exactly once.

        Example:
            >>> len(data.eval_batches(8)) == -(-len(data) // 8)   # doctest: +SKIP
            True
        """
        n = len(self)
        out = []
        for start in range(0, n, size):
            rows = [k % n for k in range(start, start + size)]
            b = self.rows(rows)
            if fill == "ignore" and start + size > n:
                b["labels"][n - start:] = IGNORE
            out.append(b)
        return out


def pack(docs: list[Any], tokenizer: Any, seq: int, packing: str = "whole") -> Packed:
    """Tokenize and label `docs` (EOS after each) and pack them into sequences of `seq` tokens.

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
    if packing not in PACKINGS:
        raise ValueError(f"--packing must be one of {PACKINGS}, got {packing!r}")
    if seq < 2:
        raise ValueError(f"seq must be >= 2 tokens, got {seq}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) has no EOS token to separate documents; "
                         f"set eos_token in its tokenizer_config.json")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    encoded = _encode(docs, tokenizer, eos)
    if packing == "split":
        return _split(encoded, seq, pad)
    truncated = sum(len(ids) > seq for ids, _ in encoded)
    kept = [(ids[:seq], labels[:seq]) for ids, labels in encoded]
    kept = [d for d in kept if any(y != IGNORE for y in d[1])]
    if not kept:
        raise _nothing(len(docs))
    bins = _first_fit_decreasing([len(ids) for ids, _ in kept], seq) if packing == "whole" \
        else [[i] for i in range(len(kept))]
    n = len(bins)
    ids = torch.full((n, seq), pad, dtype=torch.long)
    labels = torch.full((n, seq), IGNORE, dtype=torch.long)
    positions = torch.zeros((n, seq), dtype=torch.long)
    for r, members in enumerate(bins):
        at = 0
        for i in members:
            d_ids, d_labels = kept[i]
            ids[r, at:at + len(d_ids)] = torch.tensor(d_ids)
            labels[r, at:at + len(d_ids)] = torch.tensor(d_labels)
            positions[r, at:at + len(d_ids)] = torch.arange(len(d_ids))
            at += len(d_ids)
        positions[r, at:] = torch.arange(seq - at) + (at if packing == "none" else 0)  # padding
    return Packed(ids, labels, positions, sum(len(d) for d, _ in kept), len(kept), truncated, len(docs) - len(kept))


def _nothing(n: int) -> ValueError:
    """The error for documents that leave no target."""
    return ValueError(f"the {n} document(s) leave no token to train on (each document's first token predicts "
                      f"nothing, and the masking trains none of the rest)")


def _encode(docs: list[Any], tokenizer: Any, eos: int) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of each document, its EOS appended and its first label IGNORE."""
    out: list[tuple[list[int], list[int]]] = [([], []) for _ in docs]
    for templated in (False, True):  # one batched tokenizer call per kind (a chat template adds its own BOS)
        idx = [i for i, d in enumerate(docs) if d.templated == templated]
        if not idx:
            continue
        masked = any(docs[i].spans is not None for i in idx)
        if masked and not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"masking the untrained tokens needs a fast tokenizer (character offsets); "
                             f"{type(tokenizer).__name__} is not one (use --train-on all)")
        enc = tokenizer([docs[i].text for i in idx], add_special_tokens=not templated,
                        return_offsets_mapping=masked)
        for k, i in enumerate(idx):
            d, ids = docs[i], list(enc["input_ids"][k])
            if d.spans is None:
                labels = list(ids)
            else:
                labels = [t if s < e and any(a <= s < b for a, b in d.spans) else IGNORE
                          for t, (s, e) in zip(ids, enc["offset_mapping"][k])]
            ids.append(eos)
            labels.append(eos if d.train_eos else IGNORE)
            labels[0] = IGNORE  # the previous document's last token does not predict this one
            out[i] = (ids, labels)
    return out


def _first_fit_decreasing(lengths: list[int], cap: int) -> list[list[int]]:
    """Bins of document indices, first-fit decreasing (a max segment tree finds the leftmost bin with room)."""
    size = 1
    while size < len(lengths):
        size *= 2
    room = [cap] * (2 * size)  # room[k]: the most room in the bins under node k (unopened bins: all of cap)
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        k = 1
        while k < size:
            k = 2 * k if room[2 * k] >= lengths[i] else 2 * k + 1
        b = k - size
        if b == len(bins):
            bins.append([])  # the leftmost unopened bin: bins open left to right
        bins[b].append(i)
        room[k] -= lengths[i]
        while k > 1:
            k //= 2
            room[k] = max(room[2 * k], room[2 * k + 1])
    return bins


def _split(encoded: list[tuple[list[int], list[int]]], seq: int, pad: int) -> Packed:
    """--packing split: concatenate, cut every `seq` tokens, restart positions per document and sequence."""
    flat_ids = [t for ids, _ in encoded for t in ids]
    flat_labels = [y for _, labels in encoded for y in labels]
    starts = [j == 0 for ids, _ in encoded for j in range(len(ids))]
    if len(flat_ids) % seq == 1:  # a one-token last sequence: nothing to predict after the shift
        del flat_ids[-1], flat_labels[-1], starts[-1]
    if not flat_ids:
        raise _nothing(len(encoded))
    total = len(flat_ids)
    n = -(-total // seq)
    ids = torch.full((n * seq,), pad, dtype=torch.long)
    labels = torch.full((n * seq,), IGNORE, dtype=torch.long)
    start = torch.zeros(n * seq, dtype=torch.bool)
    ids[:total], labels[:total], start[:total] = torch.tensor(flat_ids), torch.tensor(flat_labels), \
        torch.tensor(starts)
    start[::seq] = True  # every sequence start, a continued piece's too
    if total < n * seq:
        start[total] = True  # the padding is a segment of its own
    at = torch.arange(n * seq)
    positions = at - torch.cummax(torch.where(start, at, 0), 0).values
    ids, labels, positions = ids.view(n, seq), labels.view(n, seq), positions.view(n, seq)
    keep = (labels[:, 1:] != IGNORE).any(dim=1)
    if not bool(keep.any()):
        raise _nothing(len(encoded))
    real = int((torch.arange(n * seq) < total).view(n, seq)[keep].sum())
    return Packed(ids[keep], labels[keep], positions[keep], real, len(encoded), 0, int((~keep).sum()))
