"""The fast timing recurrence equals the original one (verbatim below, from the first commit of passes/partition/timing.py).

The reference functions are the committed originals with only their names prefixed `ref_`; the
fast `iteration_time` must give the same float on random plans for both stalenesses, and its
`cutoff` must never discard a plan whose true time is below the cutoff.
"""
import math
import random

import pytest

from rpcompile import CostTable, StagePlan
from rpcompile.passes.partition.timing import ScheduleTimes, default_round_size, iteration_time, steady_state_window
from rpcompile.ir.plan import StageKind


# ---- reference implementation: `git show HEAD:passes/partition/timing.py`, verbatim but for the names ----

def ref_iteration_time(plan: StagePlan, costs: CostTable, *, gpus: int, microbatches: int,
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
        return ref_schedule(plan, costs, gpus=gpus, microbatches=microbatches, round_size=r,
                        staleness=0, iterations=1).makespan
    if staleness != 1:
        raise ValueError(f"staleness must be 0 or 1, got {staleness!r}")
    k, p = steady_state_window(gpus, plan.num_stages, microbatches // r)
    ends = ref_schedule(plan, costs, gpus=gpus, microbatches=microbatches, round_size=r,
                    staleness=1, iterations=k).ends
    return (ends[-1] - ends[-1 - p]) / p


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


def ref_schedule(plan: StagePlan, costs: CostTable, *, gpus: int, microbatches: int,
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


# ---- the comparison ----

def random_case(rng):
    """A random cost table, plan, worker count and microbatch count."""
    nl = rng.randint(1, 12)
    fwd = [rng.choice([rng.uniform(0.05, 4.0), float(rng.randint(1, 3))]) for _ in range(nl)]
    costs = CostTable.from_lists(fwd=fwd, bwd=[x * rng.uniform(0.0, 3.0) for x in fwd])
    f = rng.randint(1, nl)
    plan = StagePlan.from_sizes(_sizes(rng, nl - f), f, _sizes(rng, nl - f))
    n = rng.randint(1, 6)
    m = rng.randint(1, 3 * n)
    return costs, plan, n, m


def _sizes(rng, n):
    """A random composition of n."""
    out = []
    while n:
        out.append(rng.randint(1, n))
        n -= out[-1]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_fast_equals_reference(seed):
    rng = random.Random(seed)
    for _ in range(60):
        costs, plan, n, m = random_case(rng)
        for staleness in (0, 1):
            kw = dict(gpus=n, microbatches=m, staleness=staleness)
            assert iteration_time(plan, costs, **kw) == ref_iteration_time(plan, costs, **kw), (plan, kw)


@pytest.mark.parametrize("seed", range(2))
def test_cutoff_never_prunes_a_faster_plan(seed):
    rng = random.Random(100 + seed)
    for _ in range(120):
        costs, plan, n, m = random_case(rng)
        for staleness in (0, 1):
            kw = dict(gpus=n, microbatches=m, staleness=staleness)
            true = ref_iteration_time(plan, costs, **kw)
            above = true * rng.uniform(1.0, 1.5) + 1e-9
            assert iteration_time(plan, costs, cutoff=above, **kw) == true
            below = true * rng.uniform(0.3, 0.999)
            assert iteration_time(plan, costs, cutoff=below, **kw) in (true, math.inf)
