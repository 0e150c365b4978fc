"""Workers: a device, its five streams, its buffer pool and its byte accounting (DESIGN.md ideas 1, 5; 3a).

A worker is stateless between slots: it holds only the running stage's
parameters and gradients, the prefetched next stage and the activations in
flight, all from its pool, and every byte it holds is accounted in its `Store`.
Two backends implement the same stream/event model (`runtime/streams/host.py`):

- host workers (`backend="host"`, machines without CUDA): each stream is an
  executor thread, buffers are CPU tensors;
- CUDA workers: `torch.cuda.Stream`s (activation lanes at high priority) on
  one device, issued through `LaunchStream` (`runtime/streams/launch.py`). Several
  workers may share one GPU (up to the streams torch's pools hold apart);
- host workers with CUDA's issuing pattern (`backend="host-cuda"`, tests and
  benchmarks): the same `LaunchStream` issuing side as CUDA over host streams,
  so the issuer blocks (or does not) exactly where the CUDA backend's does;
  `"host-cuda-old"`: the CUDA backend's issuing before the backlog, which
  blocked the issuer on host work.

All take their buffers from the same stream-aware pool (`runtime/streams/pool.py`).

    >>> from rpcompile.runtime.streams.host import StreamContext
    >>> [w] = make_workers(1, StreamContext(), backend="host"); sorted(w.streams)
    ['act_down', 'act_up', 'compute', 'grad_down', 'param_up']
    >>> w.close()
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from rpcompile.runtime.streams.cuda import CudaStream, EventWatcher, Fp16Accumulation, check_stream_pool
from rpcompile.runtime.streams.launch import HostOps, LaunchStream
from rpcompile.runtime.streams.pool import BufferPool
from rpcompile.runtime.streams.host import HostStream, StreamContext

__all__ = ["Store", "Worker", "make_workers", "tensor_bytes", "saved_tensors_bytes", "LANES", "BACKENDS"]

LANES = ("compute", "act_up", "param_up", "act_down", "grad_down")
HIGH_PRIORITY = ("act_up", "act_down")
BACKENDS = ("auto", "host", "cuda", "host-cuda", "host-cuda-old")  # see the module docstring


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in `obj` (a tensor, or a dict/list/tuple of them; other leaves count 0)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class Store:
    """Byte accounting of one worker (bytes held now, peak); thread-safe.

    Args:
        name: for messages, e.g. "w2".
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self.bytes = 0  # bytes held now
        self.peak = 0  # most bytes held at once since the last reset_peak()

    def add(self, nbytes: int) -> None:
        """Account `nbytes` more (negative: released)."""
        with self._lock:
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)

    def reset_peak(self) -> None:
        """Start a new peak measurement at the current level."""
        with self._lock:
            self.peak = self.bytes


@contextlib.contextmanager
def saved_tensors_bytes(store: Store, params: dict, inputs: dict):
    """Account the storages autograd saves for backward (the workspace), params and inputs excluded.

    Yields a list whose one element is the bytes accounted so far; the caller releases them.
    """
    seen = {p.untyped_storage().data_ptr() for p in params.values()}
    seen |= {v.untyped_storage().data_ptr() for v in inputs.values() if isinstance(v, torch.Tensor)}
    total = [0]

    def pack(x: torch.Tensor) -> torch.Tensor:
        ptr = x.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            n = x.untyped_storage().nbytes()
            total[0] += n
            store.add(n)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        yield total


class Worker:
    """One worker: `streams[lane]`, a buffer `pool`, a byte `store` and a random `generator`.

    Args:
        index: worker id.
        ctx: the runtime's StreamContext.
        device: "cpu" (host worker) or a CUDA device.
        poison: test mode: poison pool buffers when handed out.
        issue: host workers only: None (host streams), "cuda" (CUDA's issuing side over host streams)
            or "cuda-old" (the same, blocking the issuer on host work as the CUDA backend once did).
        accumulation: CUDA only: the runtime's `Fp16Accumulation`, entered around every compute launch.
    """

    def __init__(self, index: int, ctx: StreamContext, device: Any = "cpu", poison: bool = False,
                 issue: str | None = None, accumulation: Fp16Accumulation | None = None) -> None:
        self.index = index
        self.device = torch.device(device)
        self.kind = "cuda" if self.device.type == "cuda" else "host"
        self.store = Store(f"w{index}")
        self.watcher: EventWatcher | None = None  # CUDA: runs the events' `then` callbacks
        mode = "take" if poison else None
        if self.kind == "cuda":
            self.watcher = EventWatcher(f"w{index}", ctx, self.device)
            self.streams = {lane: CudaStream(f"w{index}/{lane}", ctx, self.device,
                                             priority=-1 if lane in HIGH_PRIORITY else 0, worker=index, lane=lane,
                                             watcher=self.watcher,
                                             accumulation=accumulation if lane == "compute" else None)
                            for lane in LANES}
        elif issue is not None:
            self.streams = {lane: LaunchStream(f"w{index}/{lane}", ctx,
                                               HostOps(HostStream(f"w{index}/{lane}", ctx, worker=index, lane=lane)),
                                               worker=index, lane=lane, old=issue == "cuda-old")
                            for lane in LANES}
        else:
            self.streams = {lane: HostStream(f"w{index}/{lane}", ctx, worker=index, lane=lane) for lane in LANES}
        self.pool = BufferPool(f"w{index}", ctx, device=self.device, store=self.store, poison=mode)
        self.generator = torch.Generator(device=self.device)  # dropout etc., seeded per layer

    def synchronize(self) -> None:
        """Block until every stream's queued work has run."""
        for s in self.streams.values():
            s.synchronize()

    def close(self) -> None:
        """Stop the stream threads (and the CUDA event watcher)."""
        for s in self.streams.values():
            s.close()
        if self.watcher is not None:
            self.watcher.close()

    def __repr__(self) -> str:
        return f"Worker(w{self.index} on {self.device})"


def make_workers(gpus: int, ctx: StreamContext, backend: str = "auto", devices: list | None = None,
                 poison: bool = False, fp16_accumulation: bool = False) -> list[Worker]:
    """One Worker per worker.

    Args:
        gpus: number of workers N.
        ctx: the runtime's StreamContext.
        backend: "auto" (CUDA if available, else host), "host", "cuda", or (tests, benchmarks)
            "host-cuda" / "host-cuda-old": host workers issuing as the CUDA backend does / did.
        devices: for CUDA, the device of each worker (cycled); default all visible devices, cycled.
        poison: test mode (see `runtime/streams/pool.py`).
        fp16_accumulation: CUDA workers launch their compute with fp16 GEMM accumulation (`Fp16Accumulation`);
            no effect on host workers.
    Raises:
        ValueError: an unknown backend, or more CUDA workers per GPU than torch has distinct streams for.
    """
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() else "host"
    if backend in ("host", "host-cuda", "host-cuda-old"):
        issue = None if backend == "host" else backend[len("host-"):]
        return [Worker(i, ctx, "cpu", poison, issue) for i in range(gpus)]
    if backend != "cuda":
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("backend='cuda' but torch.cuda.is_available() is False")
    devs = list(devices) if devices else [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mine = [devs[i % len(devs)] for i in range(gpus)]
    high = sum(1 for lane in LANES if lane in HIGH_PRIORITY)
    check_stream_pool(mine, low=len(LANES) - high, high=high)
    acc = {"accumulation": Fp16Accumulation()} if fp16_accumulation else {}  # one per runtime: shared flag scope
    return [Worker(i, ctx, mine[i], poison, **acc) for i in range(gpus)]
