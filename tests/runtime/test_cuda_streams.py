"""The CUDA stream layer (runtime/streams/: cuda, launch, pool, devices, stats, values), checked on the CPU.

The CUDA classes run against a fake `torch.cuda` (`fake_cuda`): streams and
events that record what is asked of them, events that complete only when the
test says the "GPU" got there (or never), and a `set_device` that notes which
thread called it. Work launched on a fake stream runs at once in the calling
thread, as a kernel launch returns at once; only the events model the GPU.
The runtime side of the issuer never blocking on host work also runs in
`tests/runtime/test_streams.py` under `backend="host-cuda"`.
"""
from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rpcompile.runtime.streams import devices  # noqa: E402
from rpcompile.runtime.streams.cuda import CudaStream  # noqa: E402
from rpcompile.runtime.issuer import Issuer  # noqa: E402
from rpcompile.runtime.streams.pool import BufferPool  # noqa: E402
from rpcompile.runtime.streams.stats import Stats  # noqa: E402
from rpcompile.runtime.streams.host import HostEvent, StreamContext  # noqa: E402

HANG = 3.0  # seconds a fake blocking call waits for the fake GPU before it gives up (old code paths)


class FakeGpu:
    """The fake device: its events complete once `done` is set; `calls` are the set_device calls."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.calls: list[tuple[str, torch.device]] = []  # (thread name, device) of each set_device
        self.entered: list[torch.device] = []  # devices made current with torch.cuda.device(...)


class FakeEvent:
    """A torch.cuda.Event stand-in: complete once the fake GPU is `done`."""

    def __init__(self, gpu: FakeGpu, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.gpu, self.device, self.t = gpu, None, None

    def record(self, stream=None) -> None:
        self.device, self.t = getattr(stream, "device", None), time.perf_counter()

    def query(self) -> bool:
        return self.gpu.done.is_set()

    def synchronize(self) -> None:
        if not self.gpu.done.wait(HANG):
            raise RuntimeError("fake GPU hung")

    def elapsed_time(self, other: "FakeEvent") -> float:
        return (other.t - self.t) * 1e3


class FakeStream:
    """A torch.cuda.Stream stand-in."""

    def __init__(self, gpu: FakeGpu, device=None, priority: int = 0) -> None:
        self.gpu, self.device, self.priority, self.waited = gpu, torch.device(device), priority, []

    def wait_event(self, ev: FakeEvent) -> None:
        self.waited.append(ev)

    def synchronize(self) -> None:
        if not self.gpu.done.wait(HANG):
            raise RuntimeError("fake GPU hung")


@pytest.fixture
def fake_cuda(monkeypatch):
    """Replace the parts of torch.cuda the runtime calls with fakes (for this test only)."""
    gpu = FakeGpu()

    @contextlib.contextmanager
    def device(d):
        gpu.entered.append(torch.device(d))
        yield

    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(gpu, *a, **k))
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: FakeStream(gpu, *a, **k))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: gpu.calls.append((threading.current_thread().name, torch.device(d))))
    return gpu


def _until(cond, timeout: float = 5.0) -> bool:
    """Poll `cond()` until true; False after `timeout`."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


# -- a host buffer is poisoned only after its readers ran ---------------------------------------------
def test_release_poison_waits_until_the_readers_ran(fake_cuda):
    """The upload reading a pinned host buffer is issued, not run: the buffer must not be NaN yet."""
    ctx = StreamContext(timeout=5.0)
    up = CudaStream("w0/act_up", ctx, "cuda:0")
    pool = BufferPool("host", ctx, poison="release", counter="host_allocations")
    try:
        h = pool.take((4,), torch.float32, up, 0)
        h.get().fill_(1.0)
        reader = up.record(0, "w0 U1.m0")  # the upload that reads it, queued on the GPU
        pool.give(h, [reader])
        time.sleep(0.05)
        assert torch.equal(h.tensor, torch.ones(4)), "poisoned while its upload may still read it"
        fake_cuda.done.set()  # the GPU reaches the upload's event
        assert _until(lambda: bool(torch.isnan(h.tensor).all())), "never poisoned after its readers ran"
    finally:
        up.close()


# -- stats time each device against its own events ----------------------------------------------------
class _DevEvent:
    """A completed event on device `dev` at time `t` (ms); elapsed_time refuses another device's event."""

    def __init__(self, dev: int, t: float) -> None:
        self.device, self.t = torch.device("cuda", dev), t

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "_DevEvent") -> float:
        if other.device != self.device:
            raise RuntimeError("cudaEventElapsedTime: events on different devices")
        return other.t - self.t


def test_stats_on_two_devices():
    """Items on two GPUs: no elapsed_time across devices; each item's duration is kept."""
    st = Stats()
    st.busy_cuda(0, "w0/compute", "w0 F0.m0", _DevEvent(0, 100.0), _DevEvent(0, 600.0))
    st.busy_cuda(0, "w1/compute", "w1 F1.m0", _DevEvent(1, 5.0), _DevEvent(1, 255.0))
    st.busy_cuda(0, "w0/compute", "w0 F0.m1", _DevEvent(0, 700.0), _DevEvent(0, 1200.0))
    busy = st.get(0)["busy_s"]
    assert busy == pytest.approx({"w0/compute": 1.0, "w1/compute": 0.25})
    recs = {r[0]: r for r in st.records(0)}
    assert recs["w0 F0.m1"][2] - recs["w0 F0.m0"][2] == pytest.approx(0.6)  # same device: exact offsets
    assert all(b >= a for _, _, a, b in recs.values())


# -- the CUDA issuer does not block on host work ---------------------------------------------------------
def test_cuda_stream_wait_on_host_work_does_not_block_the_issuer(fake_cuda):
    """P waits for the COPY that makes its version: the issuer goes on at once, the upload launches after it."""
    ctx = StreamContext(timeout=5.0)
    pu, cs = CudaStream("w0/param_up", ctx, "cuda:0"), CudaStream("w0/compute", ctx, "cuda:0")
    copy, out = HostEvent(ctx, 0, "h C.l0 (iteration 0)"), []
    try:
        threading.Timer(0.5, copy._set).start()
        t0 = time.perf_counter()
        pu.wait(copy, 0)
        pu.submit(lambda: out.append("P0"), "w0 P0.c0", 0)
        up = pu.record(0, "w0 P0.c0")
        cs.wait(up, 0)  # the compute reading the parameters waits for the upload's (future) event
        cs.submit(lambda: out.append("F0"), "w0 F0.m0", 0)
        cs.submit(lambda: None, "w0 E0", 0)
        issued = time.perf_counter() - t0
        assert issued < 0.25, f"the issuer blocked {issued:.2f}s on the host copy"
        assert out == []  # nothing launched before the copy is done
        assert _until(lambda: out == ["P0", "F0"], 3.0), out
        assert cs.stream.waited and cs.stream.waited[-1] is up.inner.raw  # F0 waits on the upload on the GPU
        fake_cuda.done.set()
        pu.synchronize(), cs.synchronize()
        assert ctx.stats.get(0)["issue_waits"] == 0 and ctx.stats.get(0)["deferred_waits"] == 1
    finally:
        pu.close(), cs.close()


def test_cuda_backlog_skips_an_abandoned_iteration(fake_cuda):
    """A failure while a stream waits for host work: its queued work is dropped, its events abort, no hang."""
    from rpcompile.runtime.streams.host import Abort
    ctx = StreamContext(timeout=5.0)
    pu = CudaStream("w0/param_up", ctx, "cuda:0")
    copy, out = HostEvent(ctx, 3, "h C.l0"), []
    try:
        pu.wait(copy, 3)
        pu.submit(lambda: out.append("P"), "w0 P0.c0", 3)
        ev = pu.record(3)
        ctx.failure.fail(3, "w1 B2.m0", RuntimeError("boom"))
        with pytest.raises(Abort):
            ev.wait()
        fake_cuda.done.set()
        pu.synchronize()
        assert out == []
    finally:
        pu.close()


# -- a stuck GPU is a timeout, not a hang ----------------------------------------------------------------
def test_cuda_event_wait_and_synchronize_have_a_deadline(fake_cuda):
    """The fake GPU never reaches the event: wait() and synchronize() raise TimeoutError within the timeout."""
    ctx = StreamContext(timeout=0.3)
    s = CudaStream("w0/compute", ctx, "cuda:0")
    try:
        ev = s.record(0, "w0 F0.m0")
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError, match="w0 F0.m0"):
            ev.wait()
        with pytest.raises(TimeoutError):
            s.synchronize()
        assert time.perf_counter() - t0 < 2.0
    finally:
        s.close()


# -- every thread that touches CUDA sets its device ----------------------------------------------------
def test_every_cuda_thread_sets_its_device(fake_cuda):
    """The issuer, a stream's backlog helper and the event watcher set the worker's device (cuda:1)."""
    ctx, dev = StreamContext(timeout=5.0), torch.device("cuda:1")
    issuer = Issuer(ctx=ctx, workers=[SimpleNamespace(device=dev)], drop=frozenset(), board=None, its=None,
                    host=None, table={})
    th, ran = issuer.threads[0], threading.Event()
    th.start()
    th.submit(ran.set)
    assert ran.wait(5.0)
    th.stop(), th.join(5.0)
    assert ("rpcompile w0/issue", dev) in fake_cuda.calls
    s = CudaStream("w1/param_up", ctx, dev)
    try:
        copy = HostEvent(ctx, 0, "h C.l0")
        s.wait(copy, 0)  # a backlog: its helper thread launches on the GPU
        ev = s.record(0)
        copy._set()
        ev.wait_recorded()
        ev.then(lambda: None)  # the watcher thread polls the GPU's events
        fake_cuda.done.set()
        s.synchronize()
        assert _until(lambda: {n for n, d in fake_cuda.calls if d == dev} >=
                      {"rpcompile w0/issue", "rpcompile w1/param_up backlog", "rpcompile w1/param_up/watcher"})
        fake_cuda.entered.clear()
        assert ev.query() and fake_cuda.entered == [dev]  # a query from another thread runs on the event's device
    finally:
        s.close()


# -- no more workers per GPU than distinct streams ----------------------------------------------------
def test_more_workers_per_gpu_than_streams_is_refused(monkeypatch):
    """3 default-priority streams per worker, 32 per device: 11 workers on one GPU are refused, 10 fit."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ctx = StreamContext()
    with pytest.raises(ValueError, match=r"11 workers on cuda:0.*32 distinct streams.*at most 10 workers"):
        devices.make_workers(11, ctx, backend="cuda")
    made: list = []
    monkeypatch.setattr(devices, "Worker", lambda i, c, d, p: made.append(str(d)) or d)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    devices.make_workers(20, ctx, backend="cuda")  # 10 per GPU: distinct streams
    assert made.count("cuda:0") == made.count("cuda:1") == 10


# -- only CUDA values are record_stream'ed on download ----------------------------------------------------
def test_a_cpu_value_from_a_download_is_not_record_streamed():
    from rpcompile.runtime.streams.values import keep_for

    class _Stream:
        stream = None  # a CUDA stream in the runtime; never reached for a CPU value

    with pytest.raises((NotImplementedError, RuntimeError, TypeError)):
        torch.ones(2).record_stream(_Stream.stream)  # what the download did for every value
    keep_for(torch.ones(2), _Stream())  # a CPU value (e.g. a loss kept on the host): nothing to record
