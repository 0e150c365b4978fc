"""Per-iteration runtime counters: host waits, allocations, PCIe bytes and lane busy time (DESIGN.md 3a).

These are the numbers that tell a GPU run from a Python-bound one: a runtime
that syncs the host after every instruction shows host waits proportional to
the instruction count, one that allocates per transfer shows allocations in
the steady state.

    >>> s = Stats(); s.add(0, "host_waits"); s.add(0, "bytes_to_device", 64)
    >>> s.busy(0, "w0/compute", "w0 F0.m0", 1.0, 1.5); s.get(0)["host_waits"], s.get(0)["busy_s"]
    (1, {'w0/compute': 0.5})
"""
from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["Stats", "COUNTERS"]

COUNTERS = ("host_waits", "issue_waits", "issue_blocked_s", "deferred_waits", "host_allocations",
            "device_allocations", "bytes_to_device", "bytes_to_host")


class Stats:
    """Counters and instruction timings keyed by iteration (None: work outside any iteration).

    Args:
        timeout: seconds `records` waits for a CUDA item's end event before it raises TimeoutError.

    Counters: host_waits (the host blocked on device work), issue_waits (an issuing thread blocked on
    host work) and issue_blocked_s (seconds it blocked there), deferred_waits (a stream's wait on unfinished host work queued behind it instead of
    blocking the issuer, `runtime/streams/launch.py`), allocations, bytes each way.
    """

    def __init__(self, timeout: float = 600.0) -> None:  # StreamContext hands it its own deadline
        self.timeout = timeout
        self._lock = threading.Lock()
        self._counts: dict[Any, dict[str, int]] = {}
        self._records: dict[Any, list] = {}  # it -> [(label, stream, start, end)] (host: seconds)
        self._cuda: dict[Any, list] = {}  # it -> [(label, stream, start event, end event, host seconds)]

    def add(self, it: Any, key: str, n: float = 1) -> None:
        """Add `n` to counter `key` of iteration `it`."""
        with self._lock:
            c = self._counts.setdefault(it, {})
            c[key] = c.get(key, 0) + n

    def busy(self, it: Any, stream: str, label: str, start: float, end: float) -> None:
        """Record that `stream` ran `label` from `start` to `end` (perf_counter seconds)."""
        with self._lock:
            self._records.setdefault(it, []).append((label, stream, start, end))

    def busy_cuda(self, it: Any, stream: str, label: str, start: Any, end: Any) -> None:
        """Record a CUDA item by its start and end events (resolved when the iteration is read)."""
        now = time.perf_counter()  # when it was issued: aligns the devices' clocks (see `records`)
        with self._lock:
            self._cuda.setdefault(it, []).append((label, stream, start, end, now))

    def records(self, it: Any) -> list[tuple[str, str, float, float]]:
        """(label, stream, start, end) of iteration `it`'s items; CUDA items in seconds from the first one.

        Note: `cudaEventElapsedTime` needs both events on one device, so each device's items are
        timed against that device's first start event (its reference). The references are placed
        relative to each other by when their items were issued on the host (`busy_cuda`), which
        is as close as the devices' clocks can be related without a common event.
        """
        with self._lock:
            host, cuda = list(self._records.get(it, ())), list(self._cuda.get(it, ()))
        refs: dict[Any, tuple[Any, float]] = {}  # device -> (its first start event, host time of that item)
        for _, _, a, _, now in cuda:
            refs.setdefault(getattr(a, "device", None), (a, now))
        base = min((now for _, now in refs.values()), default=0.0)
        for label, stream, a, b, _ in cuda:
            ref, now = refs[getattr(a, "device", None)]
            self._wait(b, label)
            off = now - base
            host.append((label, stream, off + ref.elapsed_time(a) / 1e3, off + ref.elapsed_time(b) / 1e3))
        return host

    def _wait(self, ev: Any, label: str) -> None:
        """Poll a CUDA event until it completed; TimeoutError after `timeout` (a stuck GPU)."""
        deadline, nap = time.monotonic() + self.timeout, 2e-5
        while not ev.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.timeout:.3g} s for the end of {label} on the GPU (a hang?)")
            time.sleep(nap)
            nap = min(2 * nap, 1e-3)

    def get(self, it: Any) -> dict[str, Any]:
        """The counters of iteration `it` (missing ones are 0) and `busy_s`: seconds per stream."""
        with self._lock:
            out: dict[str, Any] = {k: 0 for k in COUNTERS}
            out.update(self._counts.get(it, {}))
        busy: dict[str, float] = {}
        for _, stream, a, b in self.records(it):
            busy[stream] = busy.get(stream, 0.0) + (b - a)
        out["busy_s"] = busy
        return out

    def forget(self, keep: set) -> None:
        """Drop everything of iterations not in `keep` (None is always kept)."""
        with self._lock:
            for d in (self._counts, self._records, self._cuda):
                for it in [k for k in d if k is not None and k not in keep]:
                    del d[it]
