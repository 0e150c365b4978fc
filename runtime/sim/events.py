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


def run_jobs(jobs: list[Job]) -> tuple[list[float], list[float]]:
    """Schedule `jobs`; return (starts, ends), one entry per job.

    Args:
        jobs: the work, each lane's FIFO order given by list order.
    Returns:
        Start and end time of every job.
    Raises:
        StuckError: naming the jobs that could never start.

    >>> run_jobs([Job(0, 0, 0, 1.0, ()), Job(0, 0, 0, 1.0, ())])
    ([0.0, 1.0], [1.0, 2.0])
    """
    n = len(jobs)
    lanes: dict[int, list[int]] = {}
    for j, job in enumerate(jobs):
        lanes.setdefault(job.lane, []).append(j)
    lane_ids = sorted(lanes)
    channel_lanes: dict[int, list[int]] = {}
    for lane in lane_ids:
        channel_lanes.setdefault(jobs[lanes[lane][0]].channel, []).append(lane)
    for lane in lane_ids:
        if any(jobs[j].channel != jobs[lanes[lane][0]].channel for j in lanes[lane]):
            raise ValueError(f"lane {lane} spans several channels")
    head = {lane: 0 for lane in lane_ids}
    pending = [len(job.deps) for job in jobs]
    ready = [0.0] * n
    dependents: list[list[int]] = [[] for _ in range(n)]
    for j, job in enumerate(jobs):
        for d in job.deps:
            if not 0 <= d < n:
                raise ValueError(f"job {j} depends on job {d}, which does not exist")
            dependents[d].append(j)
    starts, ends = [0.0] * n, [0.0] * n
    done = [False] * n
    channel_free = {c: 0.0 for c in channel_lanes}
    channel_busy = {c: False for c in channel_lanes}
    events: list[tuple[float, int, int, int]] = []
    seq = 0
    for c in channel_lanes:
        events.append((0.0, _TRY, seq, c))
        seq += 1
    heapq.heapify(events)

    while events:
        now, kind, _, x = heapq.heappop(events)
        if kind == _END:
            done[x] = True
            c = jobs[x].channel
            channel_busy[c] = False
            heapq.heappush(events, (now, _TRY, seq, c))
            seq += 1
            for d in dependents[x]:
                pending[d] -= 1
                if ends[x] > ready[d]:
                    ready[d] = ends[x]
                if pending[d] == 0:
                    heapq.heappush(events, (now, _TRY, seq, jobs[d].channel))
                    seq += 1
            continue
        c = x
        if channel_busy[c]:
            continue
        best, best_key = -1, None
        for lane in channel_lanes[c]:
            q = lanes[lane]
            h = head[lane]
            if h < len(q) and pending[q[h]] == 0:
                key = (jobs[q[h]].priority, ready[q[h]], lane)
                if best_key is None or key < best_key:
                    best, best_key = q[h], key
        if best < 0:
            continue
        start = max(now, ready[best], channel_free[c])
        starts[best] = start
        ends[best] = start + jobs[best].duration
        head[jobs[best].lane] += 1
        channel_busy[c] = True
        channel_free[c] = ends[best]
        heapq.heappush(events, (ends[best], _END, seq, best))
        seq += 1
    stuck = [j for j in range(n) if not done[j]]
    if stuck:
        raise StuckError(stuck)
    return starts, ends


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


def exposed_waits(jobs: list[Job], starts: list[float], ends: list[float], transfer: list[bool],
                  compute: list[bool]) -> list[float]:
    """Per job: how long a compute job waited on transfers beyond its lane and non-transfer inputs.

    A transfer's input is "available" when the non-transfer work behind it ended
    (through chains of transfers); a compute job's exposed wait is its start
    minus the latest of its lane predecessor's end and its deps' availability.

    >>> js = [Job(0, 0, 0, 1.0, ()), Job(1, 1, 0, 4.0, (0,)), Job(0, 0, 0, 1.0, (1,))]
    >>> exposed_waits(js, [0.0, 1.0, 5.0], [1.0, 5.0, 6.0], [False, True, False], [True, False, True])
    [0.0, 0.0, 4.0]
    """
    avail = [0.0] * len(jobs)
    for j, job in enumerate(jobs):  # jobs are listed in a topological order
        avail[j] = max((avail[d] for d in job.deps), default=0.0) if transfer[j] else ends[j]
    prev: dict[int, float] = {}
    out = [0.0] * len(jobs)
    for j, job in enumerate(jobs):
        if compute[j]:
            bound = max([prev.get(job.lane, 0.0)] + [avail[d] for d in job.deps])
            out[j] = max(0.0, starts[j] - bound)
        prev[job.lane] = ends[j]
    return out
