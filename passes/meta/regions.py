"""Chunk loops that cost counting folds: one op per loop position instead of one per iteration.

A layer that loops over chunks of its tokens (the sequence-chunked LM head)
issues the same ops once per chunk, so the number of ops it runs grows with
the sequence length. Counting modes that implement `Folding` (the predict /
measure recorder) fold such a loop: the k-th op of every iteration becomes one
op whose FLOPs, bytes and kernel launches are the sums over the iterations, and
whose live memory is the largest over them. Op lists then have the same length
at every shape, which the exact symbolic fits need.

    >>> with chunk_loop() as loop:          # no folding mode active: plain loop
    ...     for a in range(0, 10, 4):
    ...         with loop.iteration():
    ...             pass
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["Folding", "chunk_loop"]


class Folding:
    """Mixin of a dispatch mode that folds chunk loops (see module docstring)."""

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
