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

import bisect
import math
from dataclasses import dataclass

from rpcompile.ir.costs import CostTable
from rpcompile.ir.plan import StageKind, StagePlan


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
                   round_size: int | None = None, staleness: int = 0,
                   cutoff: float | None = None) -> float:
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
        cutoff: optional upper bound; once the result is known to exceed it the
            recurrence stops early and `math.inf` is returned (a search passes
            its best time so far).
    Returns:
        Seconds (or `math.inf` when above `cutoff`).

    >>> c = CostTable.from_lists(fwd=[1.0] * 4, bwd=[2.0] * 4)
    >>> iteration_time(StagePlan.from_str("3|1|3"), c, gpus=1, microbatches=2)
    30.0
    """
    if round_size is not None and (round_size < 1 or microbatches % round_size):
        raise ValueError(f"round_size {round_size} must divide microbatches {microbatches}")
    if len(costs.fwd) != plan.num_layers:
        raise ValueError(f"plan has {plan.num_layers} layers but the cost table has {len(costs.fwd)}")
    return shape_time(plan_shape(plan, costs), gpus=gpus, microbatches=microbatches,
                      round_size=round_size or default_round_size(gpus, microbatches), staleness=staleness,
                      cutoff=cutoff)


def bubble_ratio(plan: StagePlan, costs: CostTable, *, gpus: int, microbatches: int,
                 round_size: int | None = None, staleness: int = 0) -> float:
    """Idle share of N workers over one iteration: 1 - work / (N * iteration_time)."""
    t = iteration_time(plan, costs, gpus=gpus, microbatches=microbatches,
                       round_size=round_size, staleness=staleness)
    work = microbatches * sum(pre + post for pre, post in _stage_times(plan, costs))
    return 1.0 - work / (gpus * t) if t > 0 else 0.0


def _stage_times(plan: StagePlan, costs: CostTable) -> list[tuple[float, float]]:
    """Per stage (time before the upstream dependency, time after it) for one microbatch.

    F and FB: (0, all of it); B: (recompute, backward).
    """
    return [pre_post(_CODE[s.kind], *layer_sums(costs, s.layers.start, s.layers.stop)) for s in plan.stages]


_CODE = {StageKind.F: 0, StageKind.FB: 1, StageKind.B: 2}  # kind codes of the recurrence


def layer_sums(costs: CostTable, lo: int, hi: int) -> tuple[float, float]:
    """(sum of fwd, sum of bwd) over layers [lo, hi), summed in layer order (the recurrence's stage times)."""
    return sum(costs.fwd[lo:hi]), sum(costs.bwd[lo:hi])


def pre_post(code: int, f: float, b: float) -> tuple[float, float]:
    """A stage's (pre, post) from its fwd and bwd sums: F (0, f), FB (0, f + b), B (f, b) (code 0, 1, 2)."""
    return (0.0, f) if code == 0 else (0.0, f + b) if code == 1 else (f, b)


@dataclass(frozen=True, slots=True)
class Shape:
    """What the recurrence needs of a plan: per stage (index, kind code, pre, post, saved-input producer),
    and the layer segments (runs of layers between stage boundaries) each stage uploads.

    Built by `shape` from (kind code, first layer, end layer, fwd sum, bwd sum) per stage in slot order,
    so a search can time a plan without building a StagePlan.
    """

    info: tuple[tuple[int, int, float, float, int | None], ...]
    layers: tuple[range, ...]          # per stage, the segments it holds
    holders: tuple[tuple[int, ...], ...]  # per segment, the stages uploading it (slot order)
    grad_stage: tuple[int, ...]        # per segment, the stage whose backward completes its gradient
    num_layers: int


def shape(stages) -> Shape:
    """The recurrence's view of stages given as (code, lo, hi, fwd sum, bwd sum) in slot order.

    >>> sh = shape([(0, 0, 2, 2.0, 4.0), (1, 2, 3, 1.0, 2.0), (2, 1, 2, 1.0, 2.0), (2, 0, 1, 1.0, 2.0)])
    >>> sh.info[2], sh.info[3]  # B over layer 1 recomputes from F1's output; B over layer 0 from the batch
    ((2, 2, 1.0, 2.0, 0), (3, 2, 1.0, 2.0, None))
    """
    f_starts = [lo for code, lo, _, _, _ in stages if code == 0]
    nl = max(hi for _, _, hi, _, _ in stages)
    info = []
    for i, (code, lo, hi, f, b) in enumerate(stages):
        prod = bisect.bisect_right(f_starts, lo - 1) - 1 if code == 2 and lo > 0 else None
        info.append((i, code) + pre_post(code, f, b) + (prod,))
    # Layers between consecutive stage boundaries share their stages, so every per-layer optimizer
    # value is equal across such a segment: the recurrence keeps one value per segment.
    cuts = sorted({0, nl} | {s[1] for s in stages} | {s[2] for s in stages})
    seg_of = {c: g for g, c in enumerate(cuts)}
    nseg = len(cuts) - 1
    holders: list[list[int]] = [[] for _ in range(nseg)]
    grad_stage = [0] * nseg
    layers = []
    for i, (code, lo, hi, _, _) in enumerate(stages):
        segs = range(seg_of[lo], seg_of[hi])
        layers.append(segs)
        for g in segs:
            holders[g].append(i)
            if code != 0:
                grad_stage[g] = i
    return Shape(tuple(info), tuple(layers), tuple(map(tuple, holders)), tuple(grad_stage), nl)


def plan_shape(plan: StagePlan, costs: CostTable) -> Shape:
    """`shape` of a StagePlan's stages."""
    return shape([(_CODE[s.kind], s.layers.start, s.layers.stop)
                  + layer_sums(costs, s.layers.start, s.layers.stop) for s in plan.stages])


def schedule(plan: StagePlan, costs: CostTable, *, gpus: int, microbatches: int,
             round_size: int, staleness: int, iterations: int, cutoff: float | None = None,
             window: int = 1) -> ScheduleTimes | None:
    """Run the timing recurrence for `iterations` back-to-back iterations.

    With `cutoff`, returns None as soon as the time averaged over the last
    `window` iterations is known to exceed it.
    """
    if round_size < 1 or microbatches % round_size:
        raise ValueError(f"round_size {round_size} must divide microbatches {microbatches}")
    if len(costs.fwd) != plan.num_layers:
        raise ValueError(f"plan has {plan.num_layers} layers but the cost table has {len(costs.fwd)}")
    return run(plan_shape(plan, costs), gpus=gpus, microbatches=microbatches, round_size=round_size,
               staleness=staleness, iterations=iterations, cutoff=cutoff, window=window)


def shape_time(sh: Shape, *, gpus: int, microbatches: int, round_size: int, staleness: int,
               cutoff: float | None = None) -> float:
    """`iteration_time` of a plan given as a Shape (round_size already resolved)."""
    if staleness == 0:
        s = run(sh, gpus=gpus, microbatches=microbatches, round_size=round_size, staleness=0,
                iterations=1, cutoff=cutoff)
        return math.inf if s is None else s.makespan
    if staleness != 1:
        raise ValueError(f"staleness must be 0 or 1, got {staleness!r}")
    k, p = steady_state_window(gpus, len(sh.info), microbatches // round_size)
    s = run(sh, gpus=gpus, microbatches=microbatches, round_size=round_size, staleness=1, iterations=k,
            cutoff=cutoff, window=p)
    if s is None:
        return math.inf
    t = (s.ends[-1] - s.ends[-1 - p]) / p
    return math.inf if cutoff is not None and t > cutoff else t


def _remaining_load(info, n: int, rounds: int, rr: int) -> list[float]:
    """Per slot of one iteration: the compute its worker still has to do after it (later slots)."""
    load = [rr * (pre + post) for _, _, pre, post, _ in info] * rounds
    rem = [0.0] * len(load)
    for k in range(len(load) - 1 - n, -1, -1):
        rem[k] = load[k + n] + rem[k + n]
    return rem


def run(sh: Shape, *, gpus: int, microbatches: int, round_size: int, staleness: int, iterations: int,
        cutoff: float | None = None, window: int = 1) -> ScheduleTimes | None:
    """The recurrence itself (see the module Note) on a Shape; `schedule` without the plan."""
    n, m_total, rr = gpus, microbatches, round_size
    info, layers, holders, grad_stage = sh.info, sh.layers, sh.holders, sh.grad_stage
    ns, rounds, nseg = len(info), m_total // rr, len(grad_stage)
    free = [0.0] * n                      # when each worker's compute lane is free
    first_start = [0.0] * n               # start of the first compute of each worker's current slot
    steps: list[list[float]] = []         # steps[u][l] = step(u, l)
    copies: list[list[float]] = []        # copies[u][l] = copy(u, l), once its readers' uploads are known
    uploaded = [0.0] * ns                 # latest parameter upload per stage, over all iterations so far
    last_step = 0.0                       # end of the optimizer's latest step
    ends, busy = [], 0.0
    limit = math.inf if cutoff is None or staleness == 1 else cutoff
    # A worker still owes this iteration the compute of its later slots, so its clock plus that load is a
    # lower bound on the iteration's end, held against `limit` like a clock (1e-9: float sums round).
    rem = None if cutoff is None else _remaining_load(info, n, rounds, rr)
    owed = limit * (1 + 1e-9)
    first_window = iterations - 1 - window
    for t in range(iterations):
        # A clock above `limit` proves the result exceeds `cutoff`: ends[-1] is the largest clock of
        # the last iteration, and ends never decreases when every worker has a slot each iteration.
        if cutoff is not None and staleness == 1 and (t == iterations - 1 or (t > first_window >= 0
                                                                               and ns * rounds >= n)):
            limit = ends[first_window] + window * cutoff if first_window >= 0 else math.inf
            owed = limit + abs(limit) * 1e-9
        k0 = t * rounds * ns
        src = t - 1 - staleness           # the gradient iteration whose copy this iteration reads
        if src >= 0:
            cp = copies[src]
            ready = [max(cp[l] for l in lay) for lay in layers]  # parameter version ready, per stage
        else:
            ready = [0.0] * ns
        gend = [0.0] * ns
        t_end = 0.0
        for r in range(rounds):
            done = [0.0] * rr             # end of m on the previous slot (activation or gradient)
            fwd_end: list[list[float]] = []  # per forward stage, end of each microbatch
            k = (t * rounds + r) * ns
            for i, kind, pre, post, prod in info:
                w = k % n
                up = ready[i]
                if k >= n and first_start[w] > up:
                    up = first_start[w]
                if up > uploaded[i]:
                    uploaded[i] = up
                clock = free[w]
                if up > clock:
                    clock = up
                new_done = []
                if kind == 2:             # B: recompute from the saved input, then backward
                    if prod is not None:
                        saved = fwd_end[prod]
                        start0 = clock if clock >= saved[0] else saved[0]
                        for sv, d in zip(saved, done):
                            a = clock if clock >= sv else sv
                            x = a + pre
                            clock = (x if x >= d else d) + post
                            new_done.append(clock)
                    else:
                        start0 = clock
                        for d in done:
                            x = clock + pre
                            clock = (x if x >= d else d) + post
                            new_done.append(clock)
                elif i > 0:               # F or FB after the first slot: wait for m's input
                    start0 = clock if clock >= done[0] else done[0]
                    for d in done:
                        clock = (clock if clock >= d else d) + post
                        new_done.append(clock)
                else:
                    start0 = clock
                    for _ in range(rr):
                        clock = clock + post
                        new_done.append(clock)
                busy += rr * (pre + post)
                free[w] = clock
                first_start[w] = start0
                if kind == 0:
                    fwd_end.append(new_done)
                else:
                    gend[i] = clock
                done = new_done
                if clock > t_end:
                    t_end = clock
                    if clock > limit:
                        return None
                if rem is not None and clock + rem[k - k0] > owed:
                    return None
                k += 1
        ends.append(t_end)
        # Zero-cost optimizer. A copy is final once every iteration reading the version it
        # overwrites has uploaded (R1): iteration t for staleness 0, t+1 for staleness 1.
        if staleness == 1 and t >= 1:
            copies.append(_copies(steps[t - 1], holders, uploaded))
        step = [0.0] * nseg
        prev = copies[t - 1] if t >= 1 else None
        for l in range(nseg - 1, -1, -1):  # R3, R5 and one step at a time, layers descending
            last_step = max(gend[grad_stage[l]], prev[l] if prev is not None else 0.0, last_step)
            step[l] = last_step
        steps.append(step)
        if staleness == 0:
            copies.append(_copies(step, holders, uploaded))
    return ScheduleTimes(tuple(ends), busy, n)


def _copies(step: list[float], holders: list[list[int]], uploaded: list[float]) -> list[float]:
    """copy(u, l): after step(u, l) and after every upload of l reading the old version (R1)."""
    return [max(step[l], max(uploaded[i] for i in holders[l])) for l in range(len(step))]
