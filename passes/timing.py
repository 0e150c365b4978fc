"""Exact compute-only timing of the RoundPipe schedule for a plan (no transfers).

This is the objective the partitioner minimises and the reference the
simulator must reproduce when transfers and the optimizer cost nothing.

Note: the rules, for slot k (global slot index; iteration t, round r, stage i;
k = (t*rounds + r)*S + i) on worker k mod N, microbatch m of the round:
  - a worker runs its slots in order of k, each slot's microbatches in order;
  - F and FB of m wait for m of the previous slot (none for the first slot);
  - B: the recompute of m waits only for the worker and m's saved input (the
    forward slot that computed the stage's input layer); the backward of m then
    waits for m's gradient from the previous slot (FB or the previous B);
  - the first compute of slot k waits for its parameter upload, which starts
    once the worker has released the slot before its previous one (k - 2N:
    a worker holds the running stage and the prefetched next one) and once
    the parameter version the iteration reads is in the compute copy;
  - per layer l (zero-cost optimizer): step(u, l) applies iteration u's
    gradient once l's last backward of u is done (R3), after copy(u-1, l)
    (R5) and after the previous step in the optimizer's order (gradient
    iterations in order, layers descending); copy(u, l) writes theta_{u+1}
    after step(u, l) and after every upload of l that reads the old version
    (R1). Iteration t reads copy(t-2) with staleness 1, copy(t-1) with
    staleness 0 (R2); the initial weights before that.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rpcompile.costs import CostTable
from rpcompile.plan import StageKind, StagePlan


def default_round_size(gpus: int, microbatches: int) -> int:
    """The smallest R >= gpus that divides microbatches, else R = microbatches."""
    for r in range(gpus, microbatches + 1):
        if microbatches % r == 0:
            return r
    return microbatches


def steady_state_window(gpus: int, num_stages: int, rounds: int) -> tuple[int, int]:
    """(iterations to run, iterations averaged) for the staleness-1 steady state.

    The rotation shifts by S*rounds slots per iteration, so worker assignment
    repeats every P = N / gcd(N, S*rounds mod N) iterations; we run 3P (at
    least 4) iterations back to back and average the last P.
    """
    period = gpus // math.gcd(gpus, (num_stages * rounds) % gpus)
    return max(4, 3 * period), period


@dataclass(frozen=True, slots=True)
class ScheduleTimes:
    """Start/end of every compute of a run of back-to-back iterations."""

    ends: tuple[float, ...]   # C_t: when iteration t's last compute ends
    busy: float               # total compute time over all workers
    gpus: int

    @property
    def makespan(self) -> float:
        return self.ends[-1]


def iteration_time(plan: StagePlan, costs: CostTable, *, gpus: int, microbatches: int,
                   round_size: int | None = None, staleness: int = 0) -> float:
    """Compute-only time of one iteration of the RoundPipe schedule for `plan`.

    Args:
        plan: the stage grouping.
        costs: per-layer per-microbatch times (`fwd`, `bwd`).
        gpus: number of workers N.
        microbatches: microbatches per iteration M.
        round_size: microbatches per round R (default `default_round_size`).
        staleness: 0 = one isolated iteration, fill and drain included;
            1 = steady-state time per iteration, the rotation running on into
            the next iterations (see `steady_state_window`).
    Returns:
        Seconds.

    >>> c = CostTable.from_lists(fwd=[1.0] * 4, bwd=[2.0] * 4)
    >>> iteration_time(StagePlan.from_str("3|1|3"), c, gpus=1, microbatches=2)
    30.0
    """
    r = round_size or default_round_size(gpus, microbatches)
    if staleness == 0:
        return schedule(plan, costs, gpus=gpus, microbatches=microbatches, round_size=r,
                        staleness=0, iterations=1).makespan
    if staleness != 1:
        raise ValueError(f"staleness must be 0 or 1, got {staleness!r}")
    k, p = steady_state_window(gpus, plan.num_stages, microbatches // r)
    ends = schedule(plan, costs, gpus=gpus, microbatches=microbatches, round_size=r,
                    staleness=1, iterations=k).ends
    return (ends[-1] - ends[-1 - p]) / p


def bubble_ratio(plan: StagePlan, costs: CostTable, *, gpus: int, microbatches: int,
                 round_size: int | None = None, staleness: int = 0) -> float:
    """Idle share of N workers over one iteration: 1 - work / (N * iteration_time)."""
    t = iteration_time(plan, costs, gpus=gpus, microbatches=microbatches,
                       round_size=round_size, staleness=staleness)
    work = microbatches * sum(_stage_times(plan, costs)[i][0] + _stage_times(plan, costs)[i][1]
                              for i in range(plan.num_stages))
    return 1.0 - work / (gpus * t) if t > 0 else 0.0


def _stage_times(plan: StagePlan, costs: CostTable) -> list[tuple[float, float]]:
    """Per stage (time before the upstream dependency, time after it) for one microbatch.

    F and FB: (0, all of it); B: (recompute, backward).
    """
    out = []
    for s in plan.stages:
        f = sum(costs.fwd[i] for i in s.layers)
        b = sum(costs.bwd[i] for i in s.layers)
        out.append((0.0, f) if s.kind is StageKind.F else (0.0, f + b) if s.kind is StageKind.FB else (f, b))
    return out


def _saved_input_producer(plan: StagePlan) -> list[int | None]:
    """For each stage, the forward stage that computes its saved input (B stages only)."""
    out: list[int | None] = [None] * plan.num_stages
    for s in plan.stages:
        if s.kind is StageKind.B and s.layers.start > 0:
            out[s.index] = next(i for i, r in enumerate(plan.fwd) if s.layers.start - 1 in r)
    return out


def schedule(plan: StagePlan, costs: CostTable, *, gpus: int, microbatches: int,
             round_size: int, staleness: int, iterations: int) -> ScheduleTimes:
    """Run the timing recurrence for `iterations` back-to-back iterations."""
    n, m_total, rr = gpus, microbatches, round_size
    if rr < 1 or m_total % rr:
        raise ValueError(f"round_size {rr} must divide microbatches {m_total}")
    if len(costs.fwd) != plan.num_layers:
        raise ValueError(f"plan has {plan.num_layers} layers but the cost table has {len(costs.fwd)}")
    stages = plan.stages
    ns, rounds, nl = len(stages), m_total // rr, plan.num_layers
    times = _stage_times(plan, costs)
    producer = _saved_input_producer(plan)
    grad_stage = [0] * nl  # the stage whose backward completes layer l's gradient
    for s in stages:
        if s.kind is not StageKind.F:
            for l in s.layers:
                grad_stage[l] = s.index

    holders = [[s.index for s in stages if l in s.layers] for l in range(nl)]  # stages uploading layer l
    free = [0.0] * n                      # when each worker's compute lane is free
    released = [[0.0, 0.0] for _ in range(n)]  # per worker: end of its last two slots (older first)
    steps: list[list[float]] = []         # steps[u][l] = step(u, l)
    copies: list[list[float]] = []        # copies[u][l] = copy(u, l), once its readers' uploads are known
    uploaded = [0.0] * ns                 # latest parameter upload per stage, over all iterations so far
    last_step = 0.0                       # end of the optimizer's latest step
    ends, busy = [], 0.0
    for t in range(iterations):
        src = t - 1 - staleness           # the gradient iteration whose copy this iteration reads
        ready = [0.0] * ns                # parameter version ready, per stage
        if src >= 0:
            for s in stages:
                ready[s.index] = max(copies[src][l] for l in s.layers)
        gend = [0.0] * ns
        t_end = 0.0
        for r in range(rounds):
            done = [0.0] * rr             # end of m on the previous slot (activation or gradient)
            fwd_end: list[list[float]] = []  # per forward stage, end of each microbatch
            for s in stages:
                k = (t * rounds + r) * ns + s.index
                w = k % n
                up = max(ready[s.index], released[w][0])
                uploaded[s.index] = max(uploaded[s.index], up)
                pre, post = times[s.index]
                clock = max(free[w], up)
                saved = fwd_end[producer[s.index]] if producer[s.index] is not None else None
                new_done = [0.0] * rr
                for m in range(rr):
                    if s.kind is StageKind.B:
                        a = max(clock, saved[m]) if saved is not None else clock
                        clock = max(a + pre, done[m]) + post
                    else:
                        a = max(clock, done[m]) if s.index > 0 else clock
                        clock = a + post
                    new_done[m] = clock
                busy += rr * (pre + post)
                free[w] = clock
                released[w] = [released[w][1], clock]
                if s.kind is StageKind.F:
                    fwd_end.append(new_done)
                done = new_done
                if s.kind is not StageKind.F:
                    gend[s.index] = clock
                t_end = max(t_end, clock)
        ends.append(t_end)
        # Zero-cost optimizer. A copy is final once every iteration reading the version it
        # overwrites has uploaded (R1): iteration t for staleness 0, t+1 for staleness 1.
        if staleness == 1 and t >= 1:
            copies.append(_copies(steps[t - 1], holders, uploaded))
        step = [0.0] * nl
        for l in range(nl - 1, -1, -1):   # R3, R5 and one step at a time, layers descending
            last_step = max(gend[grad_stage[l]], copies[t - 1][l] if t >= 1 else 0.0, last_step)
            step[l] = last_step
        steps.append(step)
        if staleness == 0:
            copies.append(_copies(step, holders, uploaded))
    return ScheduleTimes(tuple(ends), busy, n)


def _copies(step: list[float], holders: list[list[int]], uploaded: list[float]) -> list[float]:
    """copy(u, l): after step(u, l) and after every upload of l reading the old version (R1)."""
    return [max(step[l], max(uploaded[i] for i in holders[l])) for l in range(len(step))]
