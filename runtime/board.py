"""The issue board: which instruction instances have been issued, and what they left for consumers.

The first level of the runtime's two-level dependencies (DESIGN.md 3a): an
instruction is *issued* once its work is queued on its stream; its consumers
wait on the host only until then, and take its events from the board to wait
on the device. A waiter is woken only by the key it waits for (or a failure).

    >>> from rpcompile.runtime.streams.host import StreamContext
    >>> b = IssueBoard(StreamContext(timeout=1.0)); b.publish((0, "w0 F0.m0"), ("ev",))
    >>> b.get((0, "w0 F0.m0"), 0)
    ('ev',)
"""
from __future__ import annotations

import threading
from typing import Any

from rpcompile.runtime.streams.host import Abort, DeadlineExceeded, StreamContext

__all__ = ["IssueBoard"]


class IssueBoard:
    """(iteration, instruction name) -> the record its handler returned (its events)."""

    def __init__(self, ctx: StreamContext) -> None:
        self.ctx = ctx
        self._lock = threading.Lock()
        self._items: dict[tuple, Any] = {}
        self._waiting: dict[tuple, threading.Event] = {}
        ctx.failure.on_fail.append(self.wake_all)

    def publish(self, key: tuple, record: Any) -> None:
        """Record that instance `key` is issued."""
        with self._lock:
            self._items[key] = record
            ev = self._waiting.pop(key, None)
        if ev is not None:
            ev.set()

    def get(self, key: tuple, it: int, what: str = "") -> Any:
        """The record of `key`, waiting until it is issued.

        Raises:
            Abort: iteration `it` (the waiter's) was abandoned.
            TimeoutError: not issued within the context's timeout (names the instance).
        """
        while True:
            with self._lock:
                if key in self._items:
                    return self._items[key]
                ev = self._waiting.setdefault(key, threading.Event())
            if self.ctx.failure.abandoned(it):
                raise Abort(what)
            if not ev.wait(self.ctx.timeout):
                with self._lock:
                    if key in self._items:
                        return self._items[key]
                raise DeadlineExceeded(self.ctx.timeout, f"{key[1]} (iteration {key[0]}) to be issued",
                                       f" (in {what})" if what else "")

    def has(self, key: tuple) -> bool:
        """True if `key` was issued."""
        with self._lock:
            return key in self._items

    def wake_all(self) -> None:
        """Wake every waiter (a failure: they re-check whether their iteration is abandoned)."""
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for ev in waiting.values():
            ev.set()

    def forget(self, keep) -> None:
        """Drop the records whose iteration fails `keep(iteration)`."""
        with self._lock:
            self._items = {k: v for k, v in self._items.items() if keep(k[0])}
