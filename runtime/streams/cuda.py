"""CUDA streams and events for the runtime: `torch.cuda.Stream` driven by `LaunchStream` (DESIGN.md 3a).

- `CudaEvent`: a recorded `torch.cuda.Event`. `wait(timeout)` polls it with a
  deadline, so a stuck GPU becomes a TimeoutError (then a RuntimeFailure) as on
  the host, not a `flush()` or `close()` that hangs forever; `then(fn)` runs
  `fn` once the GPU has reached the event (on the worker's `EventWatcher`), not
  when it is issued: a pool buffer is poisoned or unaccounted only after its
  readers ran.
- `CudaStream`: a `LaunchStream` over `CudaOps` (launch under the stream,
  record, device-side wait): the issuer never blocks on host work.
- `Fp16Accumulation`: a run with `fp16_accumulation` launches its compute
  streams' work with `torch.backends.cuda.matmul.allow_fp16_accumulation` on.
  The flag is process-wide in torch (one global context, not per thread), so
  it is on exactly while some compute launch of the runtime runs and the
  caller's value comes back after the last one: outside a step's launches
  the caller's setting is untouched.
- Devices: every thread that touches CUDA sets its device (`thread_device`,
  the issuers, the backlog helpers and watchers at their start; `on_device`
  around event queries from any other thread), so none creates a context on
  GPU 0; `check_stream_pool` refuses more workers per GPU than torch has
  distinct streams for.

Nothing here touches CUDA at import time.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rpcompile.runtime.streams.launch import LaunchStream
from rpcompile.runtime.streams.host import DeadlineExceeded, StreamContext

__all__ = ["CudaEvent", "CudaOps", "CudaStream", "EventWatcher", "Fp16Accumulation", "on_device",
           "set_thread_device", "thread_device", "check_stream_pool", "STREAMS_PER_POOL"]

# torch.cuda.Stream() hands out streams round-robin from a fixed pool per (device, priority):
# c10/cuda/CUDAStream.cpp, kStreamsPerPoolBits = 5 ("There are 32 of these streams per device", the
# stream pool note in c10/cuda/CUDAStream.h). The 33rd request returns the first stream again.
STREAMS_PER_POOL = 32


def set_thread_device(device: Any) -> None:
    """Make `device` the calling thread's current CUDA device (nothing for a CPU device)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def thread_device(device: Any) -> Callable[[Callable[[], None]], None]:
    """A LaunchThread `execute` that sets `device` in its thread before the first item, then runs items."""
    done = [False]

    def execute(fn: Callable[[], None]) -> None:
        if not done[0]:
            done[0] = True
            set_thread_device(device)
        fn()
    return execute


@contextlib.contextmanager
def on_device(device: Any) -> Iterator[None]:
    """Run the block with `device` current (and the caller's device back after); nothing for a CPU device."""
    if torch.device(device).type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


class Fp16Accumulation:
    """Launches of one runtime's compute streams run with fp16 GEMM accumulation; the caller's setting comes back.

    torch keeps `torch.backends.cuda.matmul.allow_fp16_accumulation` in its global context (every
    thread sees one value; checked on torch 2.13), and cuBLAS reads it when a GEMM is launched. So
    `scope()` counts the launches in flight: the first saves the process's value and turns the flag
    on, the last puts the saved value back. Host workers never enter it (their matmuls are the CPU's).

    >>> acc = Fp16Accumulation()
    >>> with acc.scope():
    ...     torch.backends.cuda.matmul.allow_fp16_accumulation
    True
    >>> torch.backends.cuda.matmul.allow_fp16_accumulation
    False
    """

    def __init__(self) -> None:
        if not hasattr(torch.backends.cuda.matmul, "allow_fp16_accumulation"):
            raise RuntimeError(f"fp16_accumulation needs torch.backends.cuda.matmul.allow_fp16_accumulation, "
                               f"which torch {torch.__version__} does not have (torch >= 2.7)")
        self._lock = threading.Lock()
        self._active = 0  # launches in flight
        self._saved = False  # the process's value before the first of them

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Run the block (one launch) with fp16 accumulation on."""
        flags = torch.backends.cuda.matmul
        with self._lock:
            if self._active == 0:
                self._saved = flags.allow_fp16_accumulation
                flags.allow_fp16_accumulation = True
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    flags.allow_fp16_accumulation = self._saved


def check_stream_pool(devices: list, low: int, high: int) -> None:
    """Refuse more workers on one GPU than torch's stream pools give distinct streams.

    Args:
        devices: the CUDA device of each worker.
        low, high: streams each worker takes at default (low) and high priority.
    Raises:
        ValueError: naming the device, the worker count and the most workers that fit.
    """
    per: dict[str, int] = {}
    for d in devices:
        per[str(torch.device(d))] = per.get(str(torch.device(d)), 0) + 1
    fit = STREAMS_PER_POOL // max(low, high, 1)
    for dev, n in per.items():
        if n * low > STREAMS_PER_POOL or n * high > STREAMS_PER_POOL:
            raise ValueError(f"{n} workers on {dev} need {n * low} default-priority and {n * high} high-priority "
                             f"CUDA streams, but torch.cuda.Stream hands out {STREAMS_PER_POOL} distinct streams "
                             f"per priority per device (more are shared silently, which serialises workers). "
                             f"Use at most {fit} workers per GPU (gpus=, devices=)")


class CudaEvent:
    """A `torch.cuda.Event` recorded on a stream of `device`.

    Args:
        raw: the recorded torch.cuda.Event.
        device: its device.
        watcher: the worker's EventWatcher (runs `then` callbacks).
        ctx: the runtime's StreamContext (the default timeout).
        it, label: for messages.
    """

    __slots__ = ("raw", "device", "it", "label", "_watcher", "_ctx")
    aborted = False  # a recorded CUDA event always completes (LaunchEvent carries aborts)

    def __init__(self, raw: Any, device: Any, watcher: "EventWatcher", ctx: StreamContext, it: int | None = None,
                 label: str = "") -> None:
        self.raw, self.device, self._watcher, self._ctx, self.it, self.label = raw, device, watcher, ctx, it, label

    def query(self) -> bool:
        """True once the GPU has reached the event."""
        with on_device(self.device):
            return bool(self.raw.query())

    def wait(self, timeout: float | None = None) -> None:
        """Block the host until the GPU has reached the event; TimeoutError after `timeout` (a stuck GPU)."""
        t = self._ctx.timeout if timeout is None else timeout
        with on_device(self.device):
            if not poll(self.raw.query, t):
                raise DeadlineExceeded(t, self.label or "an event", f" on {self.device}: the GPU did not reach it "
                                       f"(a hang?)")

    def then(self, fn: Callable[[], None]) -> None:
        """Call `fn()` once the GPU has reached the event (on the watcher's thread; at once if it has)."""
        self._watcher.add(self, fn)


def poll(query: Callable[[], bool], timeout: float) -> bool:
    """Call `query()` until it is True (sleeping 20 us, doubling to 1 ms); False after `timeout` seconds."""
    deadline, nap = time.monotonic() + timeout, 2e-5
    while not query():
        if time.monotonic() > deadline:
            return False
        time.sleep(nap)
        nap = min(2 * nap, 1e-3)
    return True


class EventWatcher:
    """One thread per CUDA worker that runs `then` callbacks once their events completed.

    Started at the first pending callback; it polls the pending events (sleeping while none
    completed) and sets its device first. An event not reached within the context's timeout
    fails the runtime (TimeoutError), as a host wait would.

    Args:
        name: e.g. "w0" (thread name).
        ctx: the runtime's StreamContext.
        device: the worker's CUDA device.
    """

    def __init__(self, name: str, ctx: StreamContext, device: Any) -> None:
        self.name, self.ctx, self.device = name, ctx, device
        self._cond = threading.Condition()
        self._pending: list[tuple[CudaEvent, Callable[[], None], float]] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, ev: CudaEvent, fn: Callable[[], None]) -> None:
        """Run `fn()` once `ev` completed."""
        with self._cond:
            self._pending.append((ev, fn, time.monotonic()))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"rpcompile {self.name}/watcher", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        set_thread_device(self.device)
        nap = 2e-5
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                pending = list(self._pending)
            now = time.monotonic()
            done = [p for p in pending if p[0].raw.query()]
            late = [p for p in pending if p not in done and now - p[2] > self.ctx.timeout]
            if done or late:
                gone = {id(p) for p in done + late}
                with self._cond:
                    self._pending = [p for p in self._pending if id(p) not in gone]
            for ev, fn, _ in done:
                try:
                    fn()
                except BaseException as exc:  # noqa: BLE001 - the caller's thread re-raises it
                    self.ctx.failure.fail(ev.it if ev.it is not None else -1, ev.label or self.name, exc)
            for ev, _, _ in late:
                self.ctx.failure.fail(ev.it if ev.it is not None else -1, ev.label or self.name, DeadlineExceeded(
                    self.ctx.timeout, ev.label or "an event", f" on {self.device} (a hang?)"))
            if done:
                nap = 2e-5
            else:
                time.sleep(nap)
                nap = min(2 * nap, 1e-3)

    def close(self) -> None:
        """Stop the thread once its pending callbacks ran (or the timeout passed)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=self.ctx.timeout)


class CudaOps:
    """The device operations of a LaunchStream on one `torch.cuda.Stream`.

    Args:
        name: e.g. "w2/act_up" (the key of its busy time).
        ctx: the runtime's StreamContext.
        device: the CUDA device.
        priority: -1 (high: activation lanes) or 0.
        watcher: the worker's EventWatcher.
        worker, lane: for the delay hook.
        accumulation: the runtime's `Fp16Accumulation` when its compute launches accumulate in fp16.
    """

    def __init__(self, name: str, ctx: StreamContext, device: Any, priority: int, watcher: EventWatcher,
                 worker: int = -1, lane: str = "", accumulation: Fp16Accumulation | None = None) -> None:
        self.name, self.ctx, self.device, self.watcher, self.worker, self.lane = name, ctx, device, watcher, worker, lane
        self.stream = torch.cuda.Stream(device=device, priority=priority)
        self.scope = accumulation.scope if accumulation is not None else contextlib.nullcontext

    def launch(self, fn: Callable[[], Any], label: str, it: int | None) -> None:
        """Run `fn()` in this thread under the stream (its kernels and copies queue there), timed by events."""
        if self.ctx.delay is not None:
            s = self.ctx.delay(self.worker, self.lane, label)
            if s > 0:
                time.sleep(s)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            with self.scope():
                fn()
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.stream)
        self.ctx.stats.busy_cuda(it, self.name, label, start, end)

    def record(self, it: int | None, label: str) -> CudaEvent:
        raw = torch.cuda.Event()
        raw.record(self.stream)
        return CudaEvent(raw, self.device, self.watcher, self.ctx, it, label)

    def wait_device(self, inner: CudaEvent, it: int | None) -> None:
        self.stream.wait_event(inner.raw)

    def here(self) -> bool:
        """Never: CUDA work runs in the launching thread, tracked by LaunchStream itself."""
        return False

    def thread_start(self) -> None:
        """A backlog helper thread launches CUDA work: set its device first."""
        set_thread_device(self.device)

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until the stream ran everything so far; TimeoutError after `timeout` (default the context's)."""
        self.record(None, f"{self.name} drain").wait(timeout)

    def close(self) -> None:
        """Nothing to stop (a CUDA stream has no thread)."""


class CudaStream(LaunchStream):
    """A CUDA stream: work launches from the issuing thread, or queues behind unfinished host work.

    Args:
        name: e.g. "w2/act_up".
        ctx: the runtime's StreamContext.
        device: the CUDA device.
        priority: -1 (high: activation lanes) or 0.
        worker, lane: for the delay hook.
        watcher: the worker's EventWatcher (default: one of its own, stopped by `close`).
        accumulation: see `CudaOps` (the compute lane of a run with fp16_accumulation).
    """

    kind = "cuda"

    def __init__(self, name: str, ctx: StreamContext, device: Any, priority: int = 0, worker: int = -1,
                 lane: str = "", watcher: EventWatcher | None = None,
                 accumulation: Fp16Accumulation | None = None) -> None:
        self.device = torch.device(device)
        self._own_watcher = watcher is None
        self.watcher = watcher or EventWatcher(name, ctx, self.device)
        ops = CudaOps(name, ctx, self.device, priority, self.watcher, worker, lane, accumulation)
        self.stream = ops.stream  # the torch.cuda.Stream (record_stream, tests)
        super().__init__(name, ctx, ops, worker=worker, lane=lane)

    def close(self) -> None:
        """Stop the backlog helper (and the watcher, if the stream owns it)."""
        super().close()
        if self._own_watcher:
            self.watcher.close()
