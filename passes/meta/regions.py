"""Regions that cost counting treats specially: folded chunk loops, fused elementwise work, forward-time gradients.

A layer that loops over chunks of its tokens (the sequence-chunked LM head)
issues the same ops once per chunk, so the number of ops it runs grows with
the sequence length. Counting modes that implement `Folding` (the predict /
measure recorder) fold such a loop: the k-th op of every iteration becomes one
op whose FLOPs, bytes and kernel launches are the sums over the iterations, and
whose live memory is the largest over them. Op lists then have the same length
at every shape, which the exact symbolic fits need.

A loop whose iterations are alike (the same shapes, on `meta`) need not run
them all: `_Loop.over` runs the first two and, where every folding mode can
(`fold_repeat`), lets the second stand for the rest. The first differs from
the others only in what the iteration before left alive; from the second on,
each one repeats the one before. A head of 64 chunks is then counted in 2
iterations, with the same counts. Only for loops whose backward is a loop of
its own (the heads' autograd Functions): a loop that autograd records op by
op (the balanced MoE experts) needs every iteration for its backward.

    >>> with chunk_loop() as loop:          # no folding mode active: plain loop
    ...     for a in range(0, 10, 4):
    ...         with loop.iteration():
    ...             pass

Two more markers, for the fused LM head (`shard_head.fused`):
- `fused_region()`: elementwise ops that run as one compiled kernel on CUDA
  (`torch.compile`). A recording mode keeps them op by op (what runs eagerly on
  host workers) and adds one op for the whole region (what runs on CUDA): its
  bytes are what the region reads from outside and what it leaves alive.
- `grad_region()`: ops a forward runs only to produce gradients (the head's
  d(logits) and its two gradient GEMMs). A forward without autograd (an F
  stage) skips them, so the cost model counts them with the backward: the
  forward column is what an F stage runs, forward + backward what a recompute
  or the fused stage runs.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["Folding", "Regions", "chunk_loop", "fused_region", "grad_region"]


class Folding:
    """Mixin of a dispatch mode that folds chunk loops (see module docstring).

    A mode that also has `fold_repeat(k)` (the iteration that just ran stands for itself and k more
    like it) lets alike iterations be skipped (`_Loop.over`).
    """

    def fold_begin(self) -> None:
        """A chunk loop starts."""
        raise NotImplementedError

    def fold_next(self) -> None:
        """An iteration of the current loop starts."""
        raise NotImplementedError

    def fold_end(self) -> None:
        """The current loop ended."""
        raise NotImplementedError


class _Loop:
    """Handle of one active chunk loop: `iteration()` marks where each iteration starts."""

    def __init__(self, modes: list[Folding]) -> None:
        self.modes = modes

    @contextlib.contextmanager
    def iteration(self) -> Iterator[None]:
        """Context of one iteration's ops."""
        for m in self.modes:
            m.fold_next()
        yield

    def over(self, items: Iterable, *, alike: bool, meta: bool) -> Iterator:
        """The loop's items, each to run under `iteration()`.

        Where the iterations are `alike` (the same ops at the same shapes), run on `meta` (nothing
        is computed, so nothing is left unwritten) and every folding mode has `fold_repeat`, only
        the first two are given; the second then stands for the rest. Otherwise all of them.
        """
        items = list(items)
        if not (alike and meta and len(items) > 2 and self.modes
                and all(hasattr(m, "fold_repeat") for m in self.modes)):
            yield from items
            return
        yield items[0]
        yield items[1]
        for m in self.modes:
            m.fold_repeat(len(items) - 2)


@contextlib.contextmanager
def chunk_loop() -> Iterator[_Loop]:
    """Mark a loop over chunks so that folding modes in the dispatch stack fold its iterations."""
    modes = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, Folding)]
    for m in modes:
        m.fold_begin()
    try:
        yield _Loop(modes)
    finally:
        for m in modes:
            m.fold_end()


class Regions:
    """Mixin of a dispatch mode that sees fused and gradient regions (see module docstring)."""

    def fused_begin(self) -> None:
        """A fused elementwise region starts."""
        raise NotImplementedError

    def fused_end(self) -> None:
        """The fused region ended."""
        raise NotImplementedError

    def grad_begin(self) -> None:
        """A forward-time gradient region starts."""
        raise NotImplementedError

    def grad_end(self) -> None:
        """The gradient region ended."""
        raise NotImplementedError


@contextlib.contextmanager
def _region(kind: str) -> Iterator[None]:
    """Call `<kind>_begin` / `<kind>_end` on every `Regions` mode of the dispatch stack around the block."""
    modes = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, Regions)]
    for m in modes:
        getattr(m, f"{kind}_begin")()
    try:
        yield
    finally:
        for m in modes:
            getattr(m, f"{kind}_end")()


def fused_region() -> contextlib.AbstractContextManager[None]:
    """Mark elementwise ops that run as one kernel on CUDA (a recording mode prices both forms)."""
    return _region("fused")


def grad_region() -> contextlib.AbstractContextManager[None]:
    """Mark ops a forward runs only for gradients (a recording mode counts them with the backward)."""
    return _region("grad")
