"""What `simulate` returns: the `Timeline` of a simulated run and the `Record` of each instruction in it.

A Timeline holds the run's numbers (makespan, iteration times, bubbles, exposed
communication, peak memory) and every instruction instance's `Record`; its
views print them (`summary`), write a chrome://tracing file (`to_chrome_trace`)
or draw a Gantt chart (`plot`, matplotlib imported only when drawing). The
runtime's measured runs reuse `Record` (`Compiled.last_timeline`).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from rpcompile.ir.program import COMPUTE_OPS


@dataclass(frozen=True, slots=True)
class Record:
    """When one instruction instance ran."""

    name: str        # physical name in its iteration (workers rotated), e.g. "w1 F0.m0"
    template: str    # the name in the program's template (iteration 0 numbering)
    iteration: int
    worker: int      # physical worker, -1 = host
    lane: str
    op: str
    start: float     # seconds
    end: float


class Records(Sequence):
    """A simulated run's `Record`s, made when read: a run of 24 iterations has ~90,000 of them, and a
    plan or a round-size choice reads only the Timeline's numbers.

    Record j is instance j // n of template instruction j % n (n = len(templates)); `workers[j]` is
    its physical worker. Equal to any sequence of the same Records (a tuple included).
    """

    __slots__ = ("_templates", "_shorts", "_host", "_lanes", "_ops", "_workers", "_starts", "_ends")

    def __init__(self, templates: Sequence[str], shorts: Sequence[str], host: Sequence[bool], lanes: Sequence[str],
                 ops: Sequence[str], workers: Sequence[int], starts: Sequence[float], ends: Sequence[float]) -> None:
        self._templates, self._shorts, self._host, self._lanes, self._ops = templates, shorts, host, lanes, ops
        self._workers, self._starts, self._ends = workers, starts, ends

    def __len__(self) -> int:
        return len(self._workers)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return tuple(self[k] for k in range(*j.indices(len(self))))
        if j < 0:
            j += len(self)
        if not 0 <= j < len(self):
            raise IndexError(f"record {j} of {len(self)}")
        n, w = len(self._templates), self._workers[j]
        k = j % n
        name = self._templates[k] if w < 0 or self._host[k] else f"w{w} {self._shorts[k]}"
        return Record(name, self._templates[k], j // n, w, self._lanes[k], self._ops[k], self._starts[j],
                      self._ends[j])

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Records({len(self)} records)"


@dataclass(frozen=True, slots=True)
class Timeline:
    """The simulated run; times in seconds, memory in bytes.

    iteration_time is the makespan for one iteration, else `steady_iteration_time`.
    """

    gpus: int
    iterations: int
    makespan: float                   # end of the last instruction (optimizer and copies included)
    iteration_ends: tuple[float, ...]  # C_t: end of iteration t's last compute
    iteration_time: float
    steady_iteration_time: float      # per iteration over the steady-state window (see simulate)
    busy: tuple[float, ...]           # compute seconds per worker over the run
    bubble_ratio: float               # idle compute share over the run: 1 - sum(busy) / (N * makespan)
    steady_bubble: float              # 1 - work per iteration / (N * steady_iteration_time)
    exposed_comm: float               # seconds compute lanes waited on transfers, all workers
    exposed_per_worker: tuple[float, ...]
    peak_memory: tuple[int, ...]      # per worker peak device bytes
    records: Sequence[Record]         # every instruction instance, in program order per iteration (`Records`:
                                      # made when read)

    @property
    def start(self) -> dict[str, float]:
        """{template name: start} of iteration 0 (for Program.to_chrome_trace)."""
        return {r.template: r.start for r in self.records if r.iteration == 0}

    @property
    def end(self) -> dict[str, float]:
        """{template name: end} of iteration 0."""
        return {r.template: r.end for r in self.records if r.iteration == 0}

    def times(self) -> dict[tuple[int, str], tuple[float, float]]:
        """{(iteration, template name): (start, end)}."""
        return {(r.iteration, r.template): (r.start, r.end) for r in self.records}

    def worker_busy(self, t0: float, t1: float) -> tuple[float, ...]:
        """Compute seconds of each worker inside the window [t0, t1]."""
        out = [0.0] * self.gpus
        for r in self.records:
            if r.op in _COMPUTE_LETTERS and r.worker >= 0:
                out[r.worker] += max(0.0, min(r.end, t1) - max(r.start, t0))
        return tuple(out)

    def summary(self) -> str:
        """A few lines: times, bubbles, exposed communication, peak memory."""
        gib = [f"{m / 2**30:.2f}" for m in self.peak_memory]
        return (f"Timeline(gpus={self.gpus}, iterations={self.iterations}): makespan {self.makespan:.6g} s, "
                f"iteration {self.iteration_time:.6g} s, steady {self.steady_iteration_time:.6g} s, "
                f"bubble {self.bubble_ratio:.2%}, steady bubble {self.steady_bubble:.2%}, "
                f"exposed comm {self.exposed_comm:.6g} s, peak GiB {gib}")

    def __str__(self) -> str:
        return self.summary()

    def to_chrome_trace(self, path) -> None:
        """Write chrome://tracing JSON: one process per worker (host last), one thread per lane."""
        events = []
        for r in self.records:
            pid = r.worker if r.worker >= 0 else self.gpus
            events.append({"name": r.name.split(" ", 1)[1], "cat": r.op, "ph": "X", "pid": pid, "tid": r.lane,
                           "ts": r.start * 1e6, "dur": (r.end - r.start) * 1e6,
                           "args": {"iteration": r.iteration, "template": r.template}})
        for w in range(self.gpus + 1):
            events.append({"name": "process_name", "ph": "M", "pid": w,
                           "args": {"name": f"w{w}" if w < self.gpus else "host"}})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)

    def plot(self, path, *, title: str | None = None) -> None:
        """Save a Gantt chart PNG: one row per (worker, lane) that ran something."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        rows = sorted({(r.worker if r.worker >= 0 else self.gpus, r.lane) for r in self.records})
        row_of = {k: i for i, k in enumerate(rows)}
        colors = dict(F="tab:blue", X="tab:purple", R="tab:cyan", B="tab:green", U="tab:orange",
                      P="tab:olive", D="tab:red", G="tab:brown", O="tab:gray", C="tab:pink", E="black")
        fig, ax = plt.subplots(figsize=(14, 0.35 * len(rows) + 1.5))
        for r in self.records:
            if r.end > r.start:
                y = row_of[(r.worker if r.worker >= 0 else self.gpus, r.lane)]
                ax.barh(y, r.end - r.start, left=r.start, height=0.8, color=colors.get(r.op, "k"),
                        edgecolor="white", linewidth=0.2)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"{'w' + str(w) if w < self.gpus else 'host'} {lane}" for w, lane in rows])
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        ax.set_title(title or self.summary()[:120], fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


_COMPUTE_LETTERS = frozenset(o.value for o in COMPUTE_OPS)
