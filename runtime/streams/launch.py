"""The issuing side of a GPU stream: launch work from the calling thread, never block it on host work.

A CUDA stream is fed by the host: `submit(fn)` runs `fn` at once in the
calling (issuing) thread, and the kernels and copies it launches run later on
the stream. `stream.wait(event)` is a device-side wait, but only for an event
the GPU knows: a CUDA event already recorded. Two waits of the runtime are on
*host* work instead (DESIGN.md 3a): a parameter upload waits for the COPY
that wrote the version it reads (R2), a gradient download for its staging
buffer to be freed by the accumulate lane. A GPU cannot wait for those.

`LaunchStream` is that issuing side, written once for every backend over a
small set of device operations (`ops`): `launch(fn)`, `record()`,
`wait_device(event)`, `synchronize()`. `CudaStream` (`runtime/streams/cuda.py`)
drives a `torch.cuda.Stream` with it; `HostOps` here drives a `HostStream`
instead, which stands in for the GPU, so host workers can run CUDA's issuing
pattern on the CPU (`backend="host-cuda"`; `"host-cuda-old"` keeps the old
blocking behaviour, for comparison).

    >>> from rpcompile.runtime.streams.host import HostEvent, HostStream, StreamContext
    >>> ctx = StreamContext(timeout=5.0); s = LaunchStream("w0/x", ctx, HostOps(HostStream("w0/x", ctx)))
    >>> copy = HostEvent(ctx, 0, "h C.l0"); out = []
    >>> s.wait(copy, 0); s.submit(lambda: out.append(1), "P0.c0", 0); ev = s.record(0)   # nothing blocked
    >>> out, ev.query()
    ([], False)
    >>> copy._set(); ev.wait(); out
    [1]
    >>> s.close()

Note: why a backlog, and not a device-side wait on a helper event. A stream
can wait on a CUDA event only once it is recorded (`cudaStreamWaitEvent` on an
unrecorded event does not wait), and a GPU cannot wait for a host flag without
a driver call torch does not expose (`cuStreamWaitValue32`) or a spinning
kernel. So when a stream must wait for host work that is not done yet, the
stream gets a *backlog*: the wait and everything submitted to that stream after
it (work, records, waits) queue, in order, on a helper thread of the stream,
which blocks on the host work and then launches what queued behind it. The
issuer goes on at once with the other streams; only work that depends on the
waiting stream waits. An event recorded behind a backlog is a `LaunchEvent`
that is not recorded yet; a stream that must wait for it (another lane, or a
buffer's next user) gets a backlog too, and `event.wait()` on the host first
waits for the record. A stream without a backlog launches directly from the
issuing thread, as before: the common case costs one lock.

Where the issuer still blocks: nowhere on host work. Inside a running item (a
nested call, e.g. a pool buffer bound inside an upload), a wait on an event not
recorded yet blocks the thread running the item (on CUDA the issuer itself
when the stream has no backlog; host streams run items on their own thread).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

from rpcompile.runtime.streams.host import Abort, DeadlineExceeded, HostStream, StreamContext

__all__ = ["LaunchEvent", "LaunchStream", "HostOps"]


class LaunchEvent:
    """An event of a LaunchStream: recorded on the device stream at once, or when its backlog reaches it.

    `inner` is the device's event (a CudaEvent, or a HostEvent under HostOps) once recorded.
    An event still waiting in a backlog when its iteration is abandoned completes as aborted.

    Args:
        ctx: the runtime's StreamContext.
        it: the iteration it belongs to (None: none).
        label: for timeout messages.
    """

    __slots__ = ("inner", "it", "label", "aborted", "_ctx", "_flag", "_lock", "_then", "__weakref__")

    def __init__(self, ctx: StreamContext, it: int | None = None, label: str = "") -> None:
        self.inner: Any = None
        self.it, self.label, self.aborted, self._ctx = it, label, False, ctx
        self._flag = threading.Event()  # set once recorded (or aborted)
        self._lock = threading.Lock()
        self._then: list[Callable[[], None]] = []

    def recorded(self) -> bool:
        """True once recorded on its device stream (or aborted)."""
        return self._flag.is_set()

    def query(self) -> bool:
        """True once complete (recorded and reached by the device, or aborted)."""
        return self._flag.is_set() and (self.aborted or self.inner.query())

    def wait_recorded(self, timeout: float | None = None) -> None:
        """Block until recorded. Raises Abort if aborted, TimeoutError after `timeout` (default the context's)."""
        t = self._ctx.timeout if timeout is None else timeout
        if not self._flag.wait(t):
            raise DeadlineExceeded(t, f"{self.label or 'an event'} to be recorded on its stream")
        if self.aborted:
            raise Abort(self.label)

    def wait(self, timeout: float | None = None) -> None:
        """Block the host until complete. Raises Abort if aborted, TimeoutError after `timeout`."""
        self.wait_recorded(timeout)
        self.inner.wait(timeout)

    def then(self, fn: Callable[[], None]) -> None:
        """Call `fn()` once the event completes normally (never if aborted)."""
        with self._lock:
            if not self._flag.is_set():
                self._then.append(fn)
                return
        if not self.aborted:
            self.inner.then(fn)

    def _bind(self, inner: Any) -> None:
        """Recorded as device event `inner`: hand it the callbacks registered so far."""
        with self._lock:
            if self._flag.is_set():
                return
            self.inner, callbacks, self._then = inner, self._then, []
            self._flag.set()
        self._ctx.failure._done(self)
        for fn in callbacks:
            inner.then(fn)

    def _set(self, aborted: bool = True) -> None:
        """Complete as aborted if not recorded yet (`Failure.fail` calls it for abandoned iterations)."""
        with self._lock:
            if self._flag.is_set():
                return
            self.aborted, self._then = True, []
            self._flag.set()
        self._ctx.failure._done(self)

    def __repr__(self) -> str:
        return f"LaunchEvent({self.label!r}, recorded={self.recorded()})"


class HostOps:
    """The device operations of a LaunchStream on a HostStream (the host stands in for the GPU).

    Args:
        stream: the HostStream that runs the launched work (its thread is "the device").
    """

    def __init__(self, stream: HostStream) -> None:
        self.stream = stream

    def launch(self, fn: Callable[[], Any], label: str, it: int | None) -> None:
        self.stream.submit(fn, label, it)

    def record(self, it: int | None, label: str) -> Any:
        return self.stream.record(it, label)

    def wait_device(self, inner: Any, it: int | None) -> None:
        self.stream.wait(inner, it)

    def here(self) -> bool:
        """True in the host stream's own thread (inside a running item)."""
        return self.stream._here()

    def thread_start(self) -> None:
        """Nothing to set up in a helper thread (no device)."""

    def synchronize(self, timeout: float | None = None) -> None:
        self.stream.synchronize(timeout)

    def close(self) -> None:
        self.stream.close()


class LaunchStream:
    """The issuing side of a device stream: launches directly, or queues behind unfinished host work.

    Args:
        name: e.g. "w2/param_up".
        ctx: the runtime's StreamContext.
        ops: the device operations (`HostOps`, or `CudaOps` in `runtime/streams/cuda.py`).
        worker, lane: for the delay hook and messages.
        old: block the issuing thread on unfinished host work instead of queueing (the CUDA backend's
            behaviour before the backlog; kept to measure what it cost, `bench/runtime_cpu.py`).
    """

    kind = "host"

    def __init__(self, name: str, ctx: StreamContext, ops: Any, *, worker: int = -1, lane: str = "",
                 old: bool = False) -> None:
        self.name, self.ctx, self.ops, self.worker, self.lane, self.old = name, ctx, ops, worker, lane, old
        self._lock = threading.RLock()
        self._drained = threading.Condition(self._lock)  # the backlog became empty
        self._backlog = 0  # items queued on the helper thread, not yet done
        self._q: SimpleQueue = SimpleQueue()
        self._thread: threading.Thread | None = None  # the helper, started at the first backlog
        self._running: int | None = None  # ident of the thread inside one of this stream's items

    # -- the stream interface (as HostStream) ---------------------------------------------------------
    def submit(self, fn: Callable[[], Any], label: str = "", it: int | None = None) -> None:
        """Launch `fn()` now (its work runs on the device in order), or queue it behind the backlog."""
        with self._lock:
            if self._backlog and not self._inside():
                self._enqueue("work", fn, label, it)
                return
            self._launch(fn, label, it)

    def record(self, it: int | None = None, label: str = "") -> LaunchEvent:
        """An event that completes when the device stream reaches this point."""
        ev = LaunchEvent(self.ctx, it, label or self.name)
        with self._lock:
            if self._backlog and not self._inside():
                if self.ctx.failure._register(ev):
                    self._enqueue("event", ev, label, it)
                else:
                    ev._set(aborted=True)
                return ev
            ev._bind(self.ops.record(it, label or self.name))
        return ev

    def wait(self, ev: Any, it: int | None = None, label: str = "") -> None:
        """Later work on this stream waits for `ev`, without blocking the calling thread (see the Note)."""
        if ev is None:
            return
        if self._inside():
            self._wait_now(ev, it)
            return
        with self._lock:
            if not self._backlog:
                if isinstance(ev, LaunchEvent) and ev.recorded():
                    self._device_wait(ev, it)
                    return
                if not isinstance(ev, LaunchEvent) and ev.query():
                    if ev.aborted and self.ctx.failure.abandoned(it):
                        raise Abort(ev.label)
                    return
                if not self.old:
                    if not isinstance(ev, LaunchEvent):  # host work (the waits the old issuer blocked on)
                        self.ctx.stats.add(it, "deferred_waits")
                    self._enqueue("wait", ev, label, it)
                    return
            else:
                self._enqueue("wait", ev, label, it)
                return
        self.ctx.stats.add(it, "issue_waits")  # old: the issuing thread blocks until the host work is done
        t0 = time.perf_counter()
        try:
            self._wait_now(ev, it)
        finally:
            self.ctx.stats.add(it, "issue_blocked_s", time.perf_counter() - t0)

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until the backlog is launched and the device stream has run everything.

        Raises DeadlineExceeded after `timeout` seconds for each of the two (default the context's deadline).
        """
        t = self.ctx.timeout if timeout is None else timeout
        with self._drained:
            if not self._drained.wait_for(lambda: self._backlog == 0, t):
                raise DeadlineExceeded(t, f"the backlog of {self.name} to be issued")
        self.ops.synchronize(t)

    def close(self) -> None:
        """Stop the helper thread after its queued items, then the device stream."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=self.ctx.timeout)
        self.ops.close()

    # -- helpers ------------------------------------------------------------------------------------
    def _inside(self) -> bool:
        """True when called from inside a running item of this stream (its work belongs to that item)."""
        return self._running == threading.get_ident() or self.ops.here()

    def _launch(self, fn: Callable[[], Any], label: str, it: int | None) -> None:
        """Launch `fn` in this thread, marked as inside this stream (nested calls belong to the item)."""
        me, prev = threading.get_ident(), self._running
        self._running = me
        try:
            self.ops.launch(fn, label, it)
        finally:
            self._running = prev

    def _device_wait(self, ev: "LaunchEvent", it: int | None) -> None:
        """Device-side wait for a recorded (or aborted) event."""
        if ev.aborted:  # recorded by nothing: its iteration was abandoned (a buffer it held is free)
            if self.ctx.failure.abandoned(it):
                raise Abort(ev.label)
            return
        self.ops.wait_device(ev.inner, it)

    def _wait_now(self, ev: Any, it: int | None) -> None:
        """Block this thread until `ev` is recorded (LaunchEvent: then a device-side wait) or done (host work).

        An aborted event counts as done unless the waiting iteration is abandoned too.
        """
        try:
            if isinstance(ev, LaunchEvent):
                ev.wait_recorded()
            else:
                ev.wait()
        except Abort:
            if self.ctx.failure.abandoned(it):
                raise
            return
        if isinstance(ev, LaunchEvent):
            self._device_wait(ev, it)

    def _enqueue(self, kind: str, obj: Any, label: str, it: int | None) -> None:
        """Queue an item on the helper thread (with the lock held)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"rpcompile {self.name} backlog", daemon=True)
            self._thread.start()
        self._backlog += 1
        self._q.put((kind, obj, label, it))

    def _run(self) -> None:
        """The helper thread: waits for host work, then launches what queued behind it, in order."""
        self.ops.thread_start()
        while True:
            item = self._q.get()
            if item is None:
                return
            kind, obj, label, it = item
            self._running = threading.get_ident()
            try:
                if kind == "event":
                    if self.ctx.failure.abandoned(it):
                        obj._set(aborted=True)
                    else:
                        obj._bind(self.ops.record(it, label or self.name))
                elif self.ctx.failure.abandoned(it):
                    pass
                elif kind == "wait":
                    self._wait_now(obj, it)
                else:
                    self.ops.launch(obj, label, it)
            except Abort:
                pass
            except BaseException as exc:  # noqa: BLE001 - the caller's thread re-raises it
                self.ctx.failure.fail(it if it is not None else -1, label or self.name, exc)
            finally:
                self._running = None
                with self._drained:
                    self._backlog -= 1
                    if self._backlog == 0:
                        self._drained.notify_all()
