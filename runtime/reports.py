"""What a `Runtime` reports about its runs: per-iteration counters, the last step's timeline, peak memory.

`RuntimeReports` is a mixin of `Runtime` (`runtime/executor.py`): it reads what
the run recorded, the `StreamContext`'s per-iteration stats and stream records
and the workers' byte stores. The counters are per iteration; the timeline is
that of the last step's device instructions (`last_timeline` waits for that
step's work first); the peaks run from construction or `reset_peaks`.
"""
from __future__ import annotations

from typing import Any

__all__ = ["RuntimeReports"]


class RuntimeReports:
    """Mixin of `Runtime`: its counters, its last step's measured timeline and its workers' peak memory.

    Reads `ctx` (the StreamContext: stats and records), `workers` (their stores' peaks) and `t`,
    and calls `flush` before reading the timeline.
    """

    def stats(self, t: int | None = None) -> dict[str, Any]:
        """Counters of iteration t (default: the last one stepped; call `flush()` first for complete numbers).

        Returns:
            {"host_waits", "issue_waits", "host_allocations", "device_allocations", "bytes_to_device",
             "bytes_to_host": int, "busy_s": {stream: seconds}}.
        """
        return self.stats_of(self.t - 1 if t is None else t)

    def stats_of(self, t: int) -> dict[str, Any]:
        """Counters of iteration t (see `stats`)."""
        return self.ctx.stats.get(t)

    @property
    def last_timeline(self) -> list[tuple[str, int, str, float, float]]:
        """(name, worker, lane, start, end) of the last step's device instructions, seconds from its first.

        Waits for the step's remaining work (`flush`) first.
        """
        self.flush()
        recs = [r for r in self.ctx.stats.records(self.t - 1) if r[0].startswith("w") and " " in r[0]]
        if not recs:
            return []
        t0 = min(r[2] for r in recs)
        out = [(label, int(label[1:].split(" ")[0]), stream.split("/")[1], a - t0, b - t0)
               for label, stream, a, b in recs]
        return sorted(out, key=lambda r: (r[3], r[0]))

    def peak_memory(self) -> list[int]:
        """Peak accounted bytes of each worker since construction (or `reset_peaks`)."""
        return [w.store.peak for w in self.workers]

    def reset_peaks(self) -> None:
        """Start new per-worker peak measurements."""
        for w in self.workers:
            w.store.reset_peak()
