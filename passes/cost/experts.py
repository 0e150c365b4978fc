"""A balanced-experts layer's count at E experts, from counts of its first 3, 4 and 5 experts.

`meta.moe.balanced_experts` runs transformers' eager experts loop one expert after the other, every
expert on the same number of tokens, and autograd records each expert's ops for the backward: counting
such a layer runs E x (forward + backward) expert bodies (qwen3-235b-a22b: 128 experts, most of the
counts `symbolic_costs` makes of a frozen-base model: four for `max_seq_len`). The counts follow the loop's shape:

- the forward's chunk loop is folded (`recorder`), so the forward ops and the forward's live points
  have the same length for any number of experts k, each a sum or a maximum over the iterations that
  grows by the same amount per expert (affine in k);
- the backward runs the experts in reverse, one block of ops (and live points) per expert, so going
  from k to k + 1 experts puts one block in front of the blocks that were there, whose values stay
  (they depend on how many experts are still to go back through, not on k), and the ops before them
  change by the same amount per expert.

So a count with k experts is `head(k) + block(k - 1) + ... + block(2) + tail` with `head` and `block`
affine in k. `extrapolate` finds the head (a line through its values at 3 and 4 experts), the block (a
line through the blocks of experts 2 and 3: the one of 3 experts and the first of 4) and the tail from
the counts at 3 and 4 experts, predicts the counts at 3, 4 and 5 and checks them against the real ones,
element for element; only then does it give the count at E (else None: the caller counts all E
experts). The counts at 3 and 4 experts agree with the model by construction (the block and the tail
are the common end of the two); the count at 5 checks every part beyond the points that fix it: the
head (a third point of its line), the blocks' line (a third block: expert 4's, the first of 5), the
block of expert 2 and the tail (a third time). A count at 2 experts would add a fourth point of the
head's line only (it has no block), at the cost of one more run of the layer per shape.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

__all__ = ["RUNS", "extrapolate", "series_at"]

RUNS = (3, 4, 5)  # the expert counts run: the first two fit the model, the last two check it


def _line(a: Any, b: Any, t: int) -> Any:
    """`a + t * (b - a)` for an int, or for each count of an OpCount (name, dtype and form equal)."""
    if a == b:  # most of a block: the same op for every expert
        return a
    if isinstance(a, int):
        return a + t * (b - a)
    if (a.name, a.dtype, a.form) != (b.name, b.dtype, b.form):
        raise ValueError("not the same op")
    return replace(a, flops=a.flops + t * (b.flops - a.flops), bytes=a.bytes + t * (b.bytes - a.bytes),
                   launches=a.launches + t * (b.launches - a.launches))


def _common_suffix(a: Sequence, b: Sequence) -> int:
    """Length of the longest common suffix of `a` and `b`."""
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return n


def series_at(seqs: dict[int, Sequence], k: int) -> list | None:
    """The sequence at `k` experts from those at `RUNS` (module docstring), or None where they do not
    follow the model (lengths, ops or values that the prediction at 4 and 5 experts misses)."""
    a3, a4 = seqs[3], seqs[4]
    d = len(a4) - len(a3)
    if d < 0 or any(len(seqs[r]) != len(a3) + (r - 3) * d for r in RUNS):
        return None
    h = len(a3) - _common_suffix(a3, a4)  # the head: what changes from 3 to 4 experts before the new block
    head, block, tail = (a3[:h], a4[:h]), (a3[h:h + d], a4[h:h + d]), list(a3[h + d:])

    def at(n: int) -> list:
        out = [_line(x, y, n - 3) for x, y in zip(*head)]
        for j in range(n - 1, 1, -1):  # the blocks of experts n - 1 ... 2 in front of the tail's
            out += [_line(x, y, j - 2) for x, y in zip(*block)]
        return out + tail

    try:
        if any(at(r) != list(seqs[r]) for r in RUNS):
            return None
        return at(k)
    except ValueError:  # an op that changes with the number of experts
        return None


def extrapolate(count: Callable[[int], tuple[Sequence, ...]], experts: int) -> list[list] | None:
    """`count(k)` (a tuple of sequences: ops, live points) at k = `experts`, from `count` at `RUNS`.

    Returns:
        One list per sequence, or None when a sequence does not follow the model (or `experts` is
        not more than the largest of `RUNS`): then only a count of all the experts is right.
    """
    if experts <= RUNS[-1]:
        return None
    runs = {r: count(r) for r in RUNS}
    out = []
    for i in range(len(runs[RUNS[0]])):
        got = series_at({r: runs[r][i] for r in RUNS}, experts)
        if got is None:
            return None
        out.append(got)
    return out
