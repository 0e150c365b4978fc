"""The values the issue handlers hand from one stream item to later ones (DESIGN.md 3a).

A handler runs at issue time, but the work it queues runs later on a stream;
what that work produces is left in one of these for the items that wait on
its event: a `Cell` (a compute's outputs), a `HostVal` (a host value uploads
read) or a `ParamSlot` (a stage slot's device parameters and gradients).

    >>> c = Cell(); c.set(3); c.get()
    3
"""
from __future__ import annotations

from typing import Any

import torch

from rpcompile.runtime.streams.host import Abort, wait_all

__all__ = ["Cell", "HostVal", "ParamSlot", "CallerSide", "keep_for"]


class Cell:
    """A value produced by a stream item, read by later items (after waiting for its event)."""

    __slots__ = ("value", "ready")

    def __init__(self) -> None:
        self.value, self.ready = None, False

    def set(self, value: Any) -> None:
        self.value, self.ready = value, True

    def get(self) -> Any:
        if not self.ready:
            raise RuntimeError("read a value before its producer ran (a missing dependency)")
        return self.value


class HostVal:
    """A value on the host that uploads read: a batch tensor, or a pool handle a download fills."""

    __slots__ = ("tensor", "handle", "event", "left", "events", "unread")

    def __init__(self, tensor=None, handle=None, event=None, readers: int = 0, unread: int | None = None) -> None:
        self.tensor, self.handle, self.event = tensor, handle, event
        self.left, self.events = readers, []  # uploads still to issue; their events
        self.unread = unread  # poison mode: reads until its live range ends (then it is poisoned); None: not tracked

    def get(self) -> torch.Tensor:
        return self.tensor if self.tensor is not None else self.handle.get()


class ParamSlot:
    """A stage slot's device parameters (views into flat pool buffers per dtype) and gradient buffers."""

    __slots__ = ("flat", "params", "grad_flat", "grads_ready", "last")

    def __init__(self) -> None:
        self.flat: dict = {}  # dtype -> Handle of the flat parameter buffer
        self.params: dict[str, torch.Tensor] = {}  # name -> view (trainable: a leaf that requires grad)
        self.grad_flat: dict = {}  # dtype -> Handle of the flat gradient buffer (FB/B stages)
        self.grads_ready = False
        self.last: dict[str, Any] = {}  # lane -> the last event of this slot on it (for the release)


class CallerSide:
    """The calling thread as a pool's "stream": a buffer it takes waits on the host for the last users' events.

    For host buffers the caller writes synchronously (the microbatch inputs `step` stages).
    """

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    def wait(self, ev: Any, it: int | None = None, label: str = "") -> None:
        """Host-block until `ev` completed (counted as a host wait if it had not).

        An event aborted with an earlier, abandoned iteration (its readers never ran) frees the
        buffer as well; only an abort of iteration `it` itself is raised.
        """
        try:
            wait_all([ev], self.ctx, it)
        except Abort:
            if self.ctx.failure.abandoned(it):
                raise

    def submit(self, fn: Any, label: str = "", it: int | None = None) -> None:
        """Run `fn` now, on the caller's thread."""
        fn()


def keep_for(value: torch.Tensor, stream: Any) -> None:
    """Tell CUDA's caching allocator that `stream` still reads `value` (CUDA tensors only: no CPU kernel)."""
    if value.is_cuda:
        value.record_stream(stream.stream)
