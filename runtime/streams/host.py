"""Streams and events: one execution model for CUDA and host workers (DESIGN.md section 3a).

A stream runs the work submitted to it later, in order; an event completes when
its stream reaches it. `stream.wait(event)` makes the stream's later work wait
for the event without blocking the host; `event.wait()` blocks the host.

- `HostStream` / `HostEvent` (here): an in-order executor thread per stream,
  so the host backend has the same deferred, out-of-order-across-streams
  behaviour a GPU has. The test hook's random delays run inside it, before
  each item.
- `LaunchStream` (`runtime/streams/launch.py`): the issuing side of a GPU stream,
  which launches work from the calling thread and never blocks it on host
  work; `CudaStream` / `CudaEvent` (`runtime/streams/cuda.py`) drive
  `torch.cuda.Stream` / `torch.cuda.Event` with it. Host workers can run the
  same issuing side over host streams (`backend="host-cuda"`), so the CPU
  suite runs CUDA's issuing pattern too.

A failure anywhere (`Failure.fail`) abandons its iteration and every later one:
their queued items are skipped and their events complete as *aborted*, which
makes every waiter raise `Abort` instead of hanging.

    >>> ctx = StreamContext(timeout=5.0)
    >>> s = HostStream("w0/compute", ctx); out = []
    >>> s.submit(lambda: out.append(1), "F0.m0", 0); ev = s.record(0); ev.wait(); out
    [1]
    >>> s.close()
"""
from __future__ import annotations

import math
import threading
import time
import traceback
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

from rpcompile.runtime.streams.stats import Stats

__all__ = ["Abort", "Failure", "StreamContext", "HostEvent", "HostStream", "wait_all", "DeadlineExceeded",
           "DEADLINE_FLOOR_S", "DEADLINE_MAX_S", "seconds", "duration"]

DEADLINE_FLOOR_S = 600.0  # the shortest default deadline of a wait (compile derives a longer one from its plan)
DEADLINE_MAX_S = threading.TIMEOUT_MAX / 4  # the longest deadline (~73 years: none): a drain waits 2x it, and
# every wait must stay one threading wait (a longer one raises OverflowError)


def duration(name: str, value: Any) -> float:
    """A duration argument as float seconds (None: `DEADLINE_FLOOR_S`; at most `DEADLINE_MAX_S`, which is no deadline).

    >>> duration("timeout", 2), duration("timeout", None)
    (2.0, 600.0)

    Raises:
        ValueError: naming it, unless a number > 0 and finite.
    """
    if value is None:
        return DEADLINE_FLOOR_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    return min(float(value), DEADLINE_MAX_S)


def seconds(s: float) -> str:
    """A duration for messages: "600 s", "0.25 s"."""
    return f"{s:.3g} s" if s < 100 else f"{s:.0f} s"


class DeadlineExceeded(TimeoutError):
    """A wait of the runtime ran past its deadline (`StreamContext.timeout`): names what it waited for and how long.

    >>> str(DeadlineExceeded(600.0, "w0 G0.r0.c0"))
    'waited 600 s for w0 G0.r0.c0'
    """

    def __init__(self, waited: float, what: str, detail: str = "") -> None:
        super().__init__(f"waited {seconds(waited)} for {what}{detail}")
        self.waited, self.what = waited, what


class Abort(Exception):
    """Raised inside a wait whose iteration was abandoned after a failure (never reaches the user)."""


class Failure:
    """The first failure of a runtime, and the events to release when it happens.

    Iterations >= `failed_from` are abandoned. Every HostEvent (and every
    LaunchEvent whose record waits in a stream's backlog) registers itself
    until it completes, so `fail` can complete the abandoned ones as aborted.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.error: tuple[BaseException, str, int, str] | None = None  # (exception, instr, iteration, traceback)
        self.failed_from: int | None = None
        self._pending: set[HostEvent] = set()
        self.on_fail: list[Callable[[], None]] = []  # e.g. the issue board wakes its waiters

    def abandoned(self, it: int | None) -> bool:
        """True if iteration `it` is abandoned (None: work that belongs to no iteration, never)."""
        f = self.failed_from
        return it is not None and f is not None and it >= f

    def fail(self, it: int, name: str, exc: BaseException) -> None:
        """Record a failure of instruction `name` of iteration `it`; abandon it and later iterations."""
        with self._lock:
            if self.error is None:
                self.error = (exc, name, it, "".join(traceback.format_exception(exc)))
            self.failed_from = it if self.failed_from is None else min(self.failed_from, it)
            doomed = [e for e in self._pending if e.it is not None and e.it >= self.failed_from]
        for e in doomed:
            e._set(aborted=True)
        for cb in list(self.on_fail):
            cb()

    def reset(self) -> None:
        """Forget the failure (after recovery)."""
        with self._lock:
            self.error, self.failed_from = None, None

    def _register(self, ev: "HostEvent") -> bool:
        """Track `ev` until it completes; False if its iteration is already abandoned."""
        with self._lock:
            if self.failed_from is not None and ev.it is not None and ev.it >= self.failed_from:
                return False
            self._pending.add(ev)
            return True

    def _done(self, ev: "HostEvent") -> None:
        with self._lock:
            self._pending.discard(ev)


class StreamContext:
    """What every stream and event of one runtime shares: failure, timeout, delays, stats.

    Args:
        timeout: seconds any wait may last before it fails as a hang (`DeadlineExceeded`); the Runtime
            derives it from the plan (`rpcompile.runtime.transfer.plan_deadline`) unless it is given.
        delay: test hook `delay(worker, lane, label) -> seconds`, slept before each host-stream item.
        stats: per-iteration counters (host waits, bytes, busy time).
        drain: the shortest bound of the waits that must not fail with a short deadline (`drain_bound`).
    """

    def __init__(self, timeout: float = DEADLINE_FLOOR_S, delay: Callable[[int, str, str], float] | None = None,
                 stats: Stats | None = None, drain: float = DEADLINE_FLOOR_S) -> None:
        self.timeout, self.delay, self.drain = timeout, delay, drain
        self.failure = Failure()
        self.stats = stats or Stats(timeout=timeout)

    @property
    def drain_bound(self) -> float:
        """Seconds a wait for work already running may last: the larger of `drain` and twice the deadline.

        The drain after a failure (and in `flush`, `close`) waits this long for each thread and stream, and
        an iteration past its commit point (whose update cannot be undone) this long for its own host work:
        every wait inside that work is bounded already, so only an item that never returns exceeds it.
        """
        return max(self.drain, 2 * self.timeout)


class HostEvent:
    """An event the host (or a host stream) can wait on; completes once, possibly as aborted.

    Args:
        ctx: the runtime's StreamContext.
        it: the iteration it belongs to (aborted if that iteration is abandoned); None: none.
        label: for timeout messages, e.g. "w1 D0.m2 (iteration 3)".
    """

    __slots__ = ("_flag", "it", "label", "aborted", "_ctx", "_callbacks", "_closing", "_lock", "__weakref__")

    def __init__(self, ctx: StreamContext, it: int | None = None, label: str = "") -> None:
        self._flag, self.it, self.label, self.aborted, self._ctx = threading.Event(), it, label, False, ctx
        self._callbacks: list[Callable[[], None]] = []
        self._closing = False  # callbacks taken: they run before the flag is set
        self._lock = threading.Lock()
        if not ctx.failure._register(self):
            self._set(aborted=True)

    def query(self) -> bool:
        """True once complete (normally or aborted)."""
        return self._flag.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete. Raises Abort if aborted, TimeoutError after `timeout` (default the context's)."""
        t = self._ctx.timeout if timeout is None else timeout
        if not self._flag.wait(t):
            raise DeadlineExceeded(t, self.label or "an event")
        if self.aborted:
            raise Abort(self.label)

    def then(self, fn: Callable[[], None]) -> None:
        """Call `fn()` once the event completes normally (at once if it already has)."""
        with self._lock:
            if not self._closing:
                self._callbacks.append(fn)
                return
        if not self.aborted:
            fn()

    def _set(self, aborted: bool = False) -> None:
        """Complete the event: callbacks first (a waiter never sees it done before they ran), then the flag."""
        with self._lock:
            if self._closing:
                return
            self._closing, self.aborted = True, aborted
            callbacks, self._callbacks = self._callbacks, []
        if not aborted:
            for fn in callbacks:
                fn()
        self._flag.set()
        self._ctx.failure._done(self)

    def __repr__(self) -> str:
        return f"HostEvent({self.label!r}, done={self.query()})"


class HostStream:
    """An emulated stream: one in-order executor thread.

    Args:
        name: e.g. "w2/act_up" (thread name and the key of its busy time).
        ctx: the runtime's StreamContext.
        worker: the worker id, for the delay hook.
        lane: the lane name, for the delay hook.
    """

    kind = "host"

    def __init__(self, name: str, ctx: StreamContext, worker: int = -1, lane: str = "") -> None:
        self.name, self.ctx, self.worker, self.lane = name, ctx, worker, lane
        self._q: SimpleQueue = SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"rpcompile {name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], label: str = "", it: int | None = None) -> None:
        """Run `fn()` after everything submitted before (a failure in it fails iteration `it`)."""
        if self._here():
            fn()  # work submitted from inside a running item belongs to that item
        else:
            self._q.put(("work", fn, label, it))

    def record(self, it: int | None = None, label: str = "") -> HostEvent:
        """An event that completes when the stream reaches this point."""
        ev = HostEvent(self.ctx, it, label or self.name)
        self._q.put(("event", ev, label, it))
        return ev

    def wait(self, ev: Any, it: int | None = None, label: str = "") -> None:
        """Later work on this stream waits for `ev` (inside a running item: the rest of that item)."""
        if ev is None or ev.query() and not ev.aborted:
            return
        if self._here():
            self._wait_event(ev, it)
        else:
            self._q.put(("wait", ev, label, it))

    def _wait_event(self, ev: Any, it: int | None) -> None:
        """Wait for `ev`; an aborted event counts as done unless the waiting iteration is abandoned too
        (a buffer freed by an abandoned iteration is simply free)."""
        try:
            ev.wait()
        except Abort:
            if self.ctx.failure.abandoned(it):
                raise

    def _here(self) -> bool:
        return threading.current_thread() is self._thread

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            kind, obj, label, it = item
            if kind == "event":
                obj._set(aborted=self.ctx.failure.abandoned(it))
                continue
            if self.ctx.failure.abandoned(it):
                continue
            try:
                if kind == "wait":
                    self._wait_event(obj, it)
                    continue
                if self.ctx.delay is not None:
                    s = self.ctx.delay(self.worker, self.lane, label)
                    if s > 0:
                        time.sleep(s)
                start = time.perf_counter()
                obj()
                self.ctx.stats.busy(it, self.name, label, start, time.perf_counter())
            except Abort:
                pass
            except BaseException as exc:  # noqa: BLE001 - the caller's thread re-raises it
                self.ctx.failure.fail(it if it is not None else -1, label or self.name, exc)

    def synchronize(self, timeout: float | None = None) -> None:
        """Block the host until everything submitted so far has run (skipped items count as run).

        Raises DeadlineExceeded after `timeout` seconds (default the context's deadline).
        """
        ev = HostEvent(self.ctx, None, f"{self.name} drain")
        self._q.put(("event", ev, "", None))
        ev.wait(timeout)

    def close(self) -> None:
        """Stop the thread after its queued items."""
        self._q.put(None)
        self._thread.join(timeout=self.ctx.timeout)


def wait_all(events: list, ctx: StreamContext, it: int | None, timeout: float | None = None) -> None:
    """Host-block until every event completed: one host wait (counted once) if any was still running.

    Raises:
        Abort: an event was aborted (its iteration abandoned).
        DeadlineExceeded: an event did not complete within `timeout` (default the context's deadline).
    """
    pending = [e for e in events if e is not None and not e.query()]
    if pending:
        ctx.stats.add(it, "host_waits")
    for e in events:
        if e is not None:
            e.wait(timeout)
