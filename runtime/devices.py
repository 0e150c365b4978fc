"""Worker backends: where a worker's tensors live and how bytes move (DESIGN.md ideas 1, 5).

A worker is stateless between slots: it holds only what its `Store` holds
(the running stage's parameters and gradients, the prefetched next stage, the
activations in flight) and every byte it holds is accounted. Two backends run
the same Program:

- `HostDevice`: a worker on the CPU (machines without CUDA; `gpus=N` gives N of
  them). Uploads and downloads are real tensor copies between the host store
  and the worker's store, so buffers are never shared by accident.
- `CudaDevice`: one CUDA device (several workers may share one). Per lane a
  CUDA stream; an instruction's work is queued on its lane's stream and an event
  recorded after it is synchronized before the instruction counts as done, so
  the executor's host-side dependencies order the streams. Downloads land in
  pinned host buffers, uploads read pinned buffers asynchronously.

    >>> d = HostDevice(0)
    >>> d.store.put(("x",), {"a": torch.zeros(4)}); d.store.bytes, d.store.peak
    (16, 16)
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

__all__ = ["Store", "HostStore", "HostDevice", "CudaDevice", "make_devices", "tensor_bytes", "saved_tensors_bytes"]


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
    """A keyed tensor store with byte accounting (current, peak); thread-safe.

    Args:
        name: for messages, e.g. "w2" or "host".
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._items: dict[tuple, tuple[Any, int]] = {}  # key -> (value, accounted bytes)
        self._lock = threading.Lock()
        self.bytes = 0  # bytes held now
        self.peak = 0  # most bytes held at once since the last reset_peak()

    def put(self, key: tuple, value: Any, nbytes: int | None = None) -> None:
        """Hold `value` under `key` (replacing any previous value), accounting its bytes."""
        n = tensor_bytes(value) if nbytes is None else nbytes
        with self._lock:
            old = self._items.pop(key, None)
            self.bytes += n - (old[1] if old else 0)
            self._items[key] = (value, n)
            self.peak = max(self.peak, self.bytes)

    def add_bytes(self, key: tuple, nbytes: int) -> None:
        """Account `nbytes` more for `key` (a value that grew, e.g. parameter gradients)."""
        with self._lock:
            value, n = self._items[key]
            self._items[key] = (value, n + nbytes)
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)

    def get(self, key: tuple) -> Any:
        """The value under `key`; KeyError names the store and the key."""
        with self._lock:
            if key not in self._items:
                raise KeyError(f"{self.name}: nothing stored under {key}")
            return self._items[key][0]

    def has(self, key: tuple) -> bool:
        """True if `key` is held."""
        with self._lock:
            return key in self._items

    def pop(self, key: tuple, default: Any = KeyError) -> Any:
        """Remove and return the value under `key`, releasing its bytes."""
        with self._lock:
            if key not in self._items:
                if default is KeyError:
                    raise KeyError(f"{self.name}: nothing stored under {key}")
                return default
            value, n = self._items.pop(key)
            self.bytes -= n
            return value

    def drop_where(self, pred) -> int:
        """Remove every item whose key satisfies `pred(key)`; returns how many."""
        with self._lock:
            keys = [k for k in self._items if pred(k)]
            for k in keys:
                self.bytes -= self._items.pop(k)[1]
            return len(keys)

    def keys(self) -> list[tuple]:
        """The keys held now."""
        with self._lock:
            return list(self._items)

    def reset_peak(self) -> None:
        """Start a new peak measurement at the current level."""
        with self._lock:
            self.peak = self.bytes


class HostStore(Store):
    """The host's activation store: a value is freed when its last reader took it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._left: dict[tuple, int] = {}  # key -> readers still to come

    def put_for(self, key: tuple, value: Any, readers: int) -> None:
        """Hold `value` until `readers` calls of `take(key)`."""
        with self._lock:
            self._left[key] = readers
        self.put(key, value)

    def take(self, key: tuple) -> Any:
        """The value for one reader; the last reader removes it."""
        value = self.get(key)
        with self._lock:
            self._left[key] -= 1
            last = self._left[key] == 0
            if last:
                del self._left[key]
        if last:
            self.pop(key, None)
        return value

    def drop_where(self, pred) -> int:
        with self._lock:
            self._left = {k: v for k, v in self._left.items() if not pred(k)}
        return super().drop_where(pred)


@contextlib.contextmanager
def saved_tensors_bytes(store: Store, key: tuple, params: dict, inputs: dict, keep: bool = False):
    """Account under `key` the storages autograd saves for backward (the workspace), params/inputs excluded.

    With `keep` the bytes stay accounted after the block (popped by the backward).
    """
    seen = {p.untyped_storage().data_ptr() for p in params.values()}
    seen |= {v.untyped_storage().data_ptr() for v in inputs.values() if isinstance(v, torch.Tensor)}
    store.put(key, None, nbytes=0)

    def pack(x: torch.Tensor) -> torch.Tensor:
        ptr = x.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            store.add_bytes(key, x.untyped_storage().nbytes())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        yield
    if not keep:
        store.pop(key, None)


class HostDevice:
    """A worker on the CPU: real copies between host memory and the worker's own store.

    Args:
        index: worker id.
    """

    kind = "host"

    def __init__(self, index: int) -> None:
        self.index = index
        self.device = torch.device("cpu")
        self.store = Store(f"w{index}")  # everything this worker holds

    def to_device(self, t: torch.Tensor, lane: str) -> torch.Tensor:
        """Upload: a fresh copy owned by the worker."""
        return t.detach().clone()

    def to_host(self, t: torch.Tensor, lane: str) -> torch.Tensor:
        """Download: a fresh host copy."""
        return t.detach().clone()

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, lane: str) -> None:
        """Copy host `src` into device `dst` (same numel)."""
        dst.copy_(src.reshape(dst.shape))

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised device tensor."""
        return torch.empty(shape, dtype=dtype)

    @contextlib.contextmanager
    def lane(self, lane: str) -> Iterator[None]:
        """Context for running one instruction of `lane` (nothing to do on the CPU)."""
        yield

    def sync(self, lane: str) -> None:
        """Wait until `lane`'s queued work is done (CPU work is synchronous)."""

    def __repr__(self) -> str:
        return f"HostDevice(w{self.index})"


class CudaDevice:
    """A worker on a CUDA device: a stream per lane, pinned host buffers, events to order lanes.

    Args:
        index: worker id.
        device: the CUDA device (several workers may share one).
    """

    kind = "cuda"

    def __init__(self, index: int, device: torch.device | str) -> None:
        self.index = index
        self.device = torch.device(device)
        self.store = Store(f"w{index}")
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def stream(self, lane: str) -> "torch.cuda.Stream":
        """The CUDA stream of `lane` (created on first use)."""
        with self._lock:
            if lane not in self._streams:
                self._streams[lane] = torch.cuda.Stream(device=self.device)
            return self._streams[lane]

    def to_device(self, t: torch.Tensor, lane: str) -> torch.Tensor:
        """Upload on `lane`'s stream (asynchronous from pinned memory)."""
        src = t.detach()
        if src.device.type == "cpu" and not src.is_pinned():
            src = src.pin_memory()
        return src.to(self.device, non_blocking=True)

    def to_host(self, t: torch.Tensor, lane: str) -> torch.Tensor:
        """Download into a pinned host buffer (valid after `sync(lane)`)."""
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t.detach(), non_blocking=True)
        return out

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, lane: str) -> None:
        """Copy host `src` into device `dst` on `lane`'s stream."""
        dst.copy_(src.reshape(dst.shape), non_blocking=src.is_pinned())

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised device tensor."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    @contextlib.contextmanager
    def lane(self, lane: str) -> Iterator[None]:
        """Queue the work of one instruction of `lane` on its stream."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream(lane)):
            yield

    def sync(self, lane: str) -> None:
        """Record an event after `lane`'s queued work and wait for it (the instruction's completion)."""
        ev = torch.cuda.Event()
        ev.record(self.stream(lane))
        ev.synchronize()

    def __repr__(self) -> str:
        return f"CudaDevice(w{self.index} on {self.device})"


def make_devices(gpus: int, backend: str = "auto", devices: list | None = None) -> list:
    """One worker backend per worker.

    Args:
        gpus: number of workers N.
        backend: "auto" (CUDA if available, else host), "host" or "cuda".
        devices: for CUDA, the device of each worker (cycled); default all visible devices, cycled.
    Returns:
        A list of N `HostDevice` or `CudaDevice`.

    >>> make_devices(2, "host")
    [HostDevice(w0), HostDevice(w1)]
    """
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() else "host"
    if backend == "host":
        return [HostDevice(i) for i in range(gpus)]
    if backend != "cuda":
        raise ValueError(f"backend must be 'auto', 'host' or 'cuda', got {backend!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("backend='cuda' but torch.cuda.is_available() is False")
    devs = list(devices) if devices else [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [CudaDevice(i, devs[i % len(devs)]) for i in range(gpus)]
