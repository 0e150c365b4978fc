"""The simulator's core: an event-driven list scheduler over FIFO lanes and shared channels.

Plain integers and floats only; `simulator.py` turns a Program into `Job`s and
the result back into a Timeline.

    >>> jobs = [Job(lane=0, channel=0, priority=0, duration=1.0, deps=()),
    ...         Job(lane=1, channel=1, priority=0, duration=2.0, deps=(0,))]
    >>> run_jobs(jobs)
    ([0.0, 1.0], [1.0, 3.0])

Note: the rule, exact when no channel is shared: a job starts at
max(end of its deps, end of the previous job of its lane) -- each lane runs its
jobs in list order (FIFO). Lanes on one channel (a GPU's PCIe direction) also
wait for the channel: when it frees, the ready lane heads compete and the one
with the lowest `priority` goes first (ties: the one ready first, then the
lower lane id); a started transfer is never preempted. All completions at a
time are processed before any start decision at that time, so zero-duration
jobs chain within one instant.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from rpcompile.runtime.sim.native import exposed_native, load, run_native

_END, _TRY = 0, 1  # event kinds; completions at a time are handled before starts


@dataclass(frozen=True, slots=True)
class Job:
    """One unit of work for the scheduler."""

    lane: int                # FIFO queue id: a lane runs its jobs in list order
    channel: int             # server id: lanes sharing a channel run one job at a time
    priority: int            # lower starts first among ready lane heads of one channel
    duration: float          # seconds
    deps: tuple[int, ...]    # indices of jobs that must end before this one starts


class StuckError(RuntimeError):
    """Some jobs never became ready (a dependency cycle or a FIFO-order deadlock)."""

    def __init__(self, stuck: list[int]):
        super().__init__(f"{len(stuck)} jobs never ran (dependency cycle or lane-order deadlock); "
                         f"first: {stuck[:8]}")
        self.stuck = stuck


@dataclass(frozen=True, slots=True)
class Jobs:
    """The work as columns, what `simulate` builds (`Jobs.of` converts a list of `Job`s): job j's dependencies
    are dep_idx[dep_ptr[j]:dep_ptr[j + 1]]."""

    lane: Sequence[int]
    channel: Sequence[int]
    priority: Sequence[int]
    duration: Sequence[float]
    dep_ptr: Sequence[int]   # len(lane) + 1 offsets into dep_idx
    dep_idx: Sequence[int]

    @classmethod
    def of(cls, jobs: list[Job]) -> "Jobs":
        """The columns of a list of jobs."""
        ptr, idx = [0], []
        for job in jobs:
            idx += job.deps
            ptr.append(len(idx))
        return cls([j.lane for j in jobs], [j.channel for j in jobs], [j.priority for j in jobs],
                   [j.duration for j in jobs], ptr, idx)

    def __len__(self) -> int:
        return len(self.lane)

    def deps(self, j: int) -> Sequence[int]:
        """Job j's dependencies."""
        return self.dep_idx[self.dep_ptr[j]:self.dep_ptr[j + 1]]


def run_jobs(jobs: list[Job] | Jobs, *, native: bool = True) -> tuple[list[float], list[float]]:
    """Schedule `jobs`; return (starts, ends), one entry per job.

    Args:
        jobs: the work, each lane's FIFO order given by list order.
        native: run the loop in C (`runtime/sim/native.py`: the same floats) where the kernel is available;
            False: in Python (`run_python`).
    Returns:
        Start and end time of every job.
    Raises:
        StuckError: naming the jobs that could never start.
        ValueError: a dependency on a job that does not exist, or a lane on several channels.

    >>> run_jobs([Job(0, 0, 0, 1.0, ()), Job(0, 0, 0, 1.0, ())])
    ([0.0, 1.0], [1.0, 2.0])
    """
    cols = jobs if isinstance(jobs, Jobs) else Jobs.of(jobs)
    n = len(cols)
    if cols.dep_idx and not (0 <= min(cols.dep_idx) and max(cols.dep_idx) < n):
        j = next(j for j in range(n) for d in cols.deps(j) if not 0 <= d < n)
        d = next(d for d in cols.deps(j) if not 0 <= d < n)
        raise ValueError(f"job {j} depends on job {d}, which does not exist")
    lanes, n_lanes = _dense(cols.lane)  # a lane's rank among the lane ids: ties between lane heads go to the lower
    chans, n_chans = _dense(cols.channel)
    lib = load() if native else None
    if lib is not None:
        result = run_native(lib, n, lanes, chans, cols, n_lanes, n_chans)
    else:
        result = run_python(n, lanes, chans, cols, n_lanes)
    if isinstance(result, int):
        raise ValueError(f"lane {cols.lane[result]} spans several channels")
    starts, ends, done = result
    if not all(done):
        raise StuckError([j for j in range(n) if not done[j]])
    return starts, ends


def _dense(ids: Sequence[int]) -> tuple[Sequence[int], int]:
    """(each id's rank among the distinct ids, how many there are): the ids themselves when they are 0 .. k - 1."""
    distinct = sorted(set(ids))
    if distinct == list(range(len(distinct))):
        return ids, len(distinct)
    rank = {v: k for k, v in enumerate(distinct)}
    return [rank[v] for v in ids], len(distinct)


def run_python(n: int, lane_of: Sequence[int], chan: Sequence[int], cols: Jobs, n_lanes: int):
    """The event loop of `run_jobs` (dense lanes and channels): (starts, ends, done), or the first job whose lane
    is already on another channel."""
    queue: list[list[int]] = [[] for _ in range(n_lanes)]  # each lane's jobs in list order
    lane_channel: list[int | None] = [None] * n_lanes
    prio, dur, ptr, idx = cols.priority, cols.duration, cols.dep_ptr, cols.dep_idx
    pending = [ptr[j + 1] - ptr[j] for j in range(n)]
    dependents: list[list[int]] = [[] for _ in range(n)]
    for j in range(n):
        q = lane_of[j]
        queue[q].append(j)
        if lane_channel[q] is None:
            lane_channel[q] = chan[j]
        elif lane_channel[q] != chan[j]:
            return j
        for d in idx[ptr[j]:ptr[j + 1]]:
            dependents[d].append(j)
    channel_lanes: dict[int, list[int]] = {}  # per channel its lanes, by rank
    for q, c in enumerate(lane_channel):
        channel_lanes.setdefault(c, []).append(q)
    head = [0] * n_lanes
    length = [len(q) for q in queue]
    ready = [0.0] * n
    starts, ends = [0.0] * n, [0.0] * n
    done = [False] * n
    channel_free = {c: 0.0 for c in channel_lanes}
    channel_busy = {c: False for c in channel_lanes}
    events: list[tuple[float, int, int, int]] = [(0.0, _TRY, seq, c) for seq, c in enumerate(channel_lanes)]
    seq = len(events)
    heapq.heapify(events)
    pop, push = heapq.heappop, heapq.heappush

    while events:
        now, kind, _, x = pop(events)
        if kind == _END:
            done[x] = True
            c = chan[x]
            channel_busy[c] = False
            push(events, (now, _TRY, seq, c))
            seq += 1
            end = ends[x]
            for d in dependents[x]:
                pending[d] -= 1
                if end > ready[d]:
                    ready[d] = end
                if pending[d] == 0:
                    push(events, (now, _TRY, seq, chan[d]))
                    seq += 1
            continue
        c = x
        if channel_busy[c]:
            continue
        best = -1
        for q in channel_lanes[c]:  # the ready lane head with the least (priority, ready time, lane)
            h = head[q]
            if h < length[q]:
                j = queue[q][h]
                if pending[j] == 0 and (best < 0 or prio[j] < prio[best]
                                        or (prio[j] == prio[best] and ready[j] < ready[best])):
                    best = j  # lanes are visited by rank: an equal key keeps the lower lane
        if best < 0:
            continue
        start = max(now, ready[best], channel_free[c])
        starts[best] = start
        ends[best] = end = start + dur[best]
        head[lane_of[best]] += 1
        channel_busy[c] = True
        channel_free[c] = end
        push(events, (end, _END, seq, best))
        seq += 1
    return starts, ends, done


def peak_usage(intervals: list[tuple[float, float, int]]) -> int:
    """Peak of the summed sizes of (alloc time, free time, bytes) buffers; frees at t come before allocs at t.

    >>> peak_usage([(0.0, 2.0, 5), (1.0, 3.0, 7), (2.0, 4.0, 1)])
    12
    """
    events = sorted([(a, 1, b) for a, _, b in intervals] + [(f, 0, -b) for _, f, b in intervals])
    cur = peak = 0
    for _, _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return peak


def exposed_waits(jobs: Jobs, starts: list[float], ends: list[float], transfer: list[bool],
                  compute: list[bool], *, native: bool = True) -> list[float]:
    """Per job: how long a compute job waited on transfers beyond its lane and non-transfer inputs.

    A transfer's input is "available" when the non-transfer work behind it ended
    (through chains of transfers); a compute job's exposed wait is its start
    minus the latest of its lane predecessor's end and its deps' availability.
    Lanes are numbered 0 .. L - 1 (as `simulate` numbers them). In C where the
    kernel is available (`native.exposed_native`: the same floats), else in Python.

    >>> js = Jobs.of([Job(0, 0, 0, 1.0, ()), Job(1, 1, 0, 4.0, (0,)), Job(0, 0, 0, 1.0, (1,))])
    >>> exposed_waits(js, [0.0, 1.0, 5.0], [1.0, 5.0, 6.0], [False, True, False], [True, False, True])
    [0.0, 0.0, 4.0]
    """
    lib = load() if native else None
    if lib is not None and len(jobs):
        return exposed_native(lib, jobs, starts, ends, transfer, compute)
    return exposed_waits_python(jobs, starts, ends, transfer, compute)


def exposed_waits_python(jobs: Jobs, starts: list[float], ends: list[float], transfer: list[bool],
                         compute: list[bool]) -> list[float]:
    """`exposed_waits` in Python."""
    n, ptr, idx = len(jobs), jobs.dep_ptr, jobs.dep_idx
    avail = [0.0] * n
    for j in range(n):  # jobs are listed in a topological order
        if transfer[j]:
            a = 0.0
            for d in idx[ptr[j]:ptr[j + 1]]:
                if avail[d] > a:
                    a = avail[d]
            avail[j] = a
        else:
            avail[j] = ends[j]
    prev: dict[int, float] = {}
    out = [0.0] * n
    lane = jobs.lane
    for j in range(n):
        if compute[j]:
            bound = prev.get(lane[j], 0.0)
            for d in idx[ptr[j]:ptr[j + 1]]:
                if avail[d] > bound:
                    bound = avail[d]
            out[j] = max(0.0, starts[j] - bound)
        prev[lane[j]] = ends[j]
    return out
