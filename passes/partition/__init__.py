"""partition: choose the asymmetric stage plan that minimises `iteration_time`.

The fourth pass of the pipeline (trace -> shard_lm_head -> estimate_costs -> partition -> emit -> verify).
This folder holds it and what it is built from:

    timing.py      `iteration_time`: exact compute-only timing of the schedule for a plan (also used by
                   emit, the host-memory count and the simulator)
    evaluator.py   plans as stage sizes: stage tuples, device memory and exact time without a StagePlan
    steady.py      `iteration_time` fast (to 1e-12): first and last microbatch per slot, until the state repeats
    batch.py       the same for many plans at once, as float64 tensor rows (the complete even family)
    native.py      the recurrences and the cap walk's caps and layouts in C (*.c, built once per machine): the
                   same floats
    cap_walk.py    the heuristic part: a best-first walk over stage-time caps
    even_plans.py  the plans a person would write (even plans, every plan of tiny models)
    ties.py        the tie rule: one canonical plan among those within the tie of the fastest
    report.py      a plan's report: stage times and memory, t_max, iteration time and bubble
    host_lean.py   compile's fallback where the fastest plan's saved inputs are over the host: the widest
                   backward stages a worker holds

    >>> from rpcompile.ir.costs import CostTable
    >>> c = CostTable.from_lists(fwd=[1e-3] * 8, bwd=[2e-3] * 8)
    >>> partition(c, gpus=4, microbatches=8, staleness=0).to_str()
    '1,2,2,2|1|1,1,1,1,1,1,1'

What is guaranteed. Every plan is ranked by the exact `iteration_time` under
the given memory budget (`StagePlan.stage_memory` of every stage within it);
the result is at least as fast as each of:

(a) the RoundPipe reference heuristic's plan: caps t_max from the slowest
    layer's fwd + bwd up to 1.1x it in 1% steps; for each cap every fused size
    whose fused stage fits it, both sides filled greedily up to the cap; of the
    candidates that fit the memory budget, the least max(S, N) * cap (the first
    on ties, caps ascending, then fused sizes ascending);
(b) every even plan (`even_plans.py`) with a fused stage of 1, 2 or 3 layers,
    whatever the reference heuristic fuses, for models of at most 40 layers:
    the last f layers fused (f = 1, 2, 3), the other n layers in a forward
    and b backward stages of sizes differing by at most one, the larger first
    in execution order, for every 1 <= a, b <= n. Larger models get the family
    only at 1..2N+1 stages per side and near the balanced count, within the
    search budget, which is heuristic; other fused sizes are the cap walk's;
(c) every plan at all (fused size x forward layout x backward layout) when
    the model has at most 7 layers.

Ties (`ties.py`): a plan ties when its iteration time is within `tie` (a
share, default 0) of the reference: the fastest even plan timed (both sides
laid out evenly, any fused size) when that is within the tie of the fastest
plan timed, else the fastest plan. The plan returned is the tied one with the
fewest stages, then the most fused layers, then the fewest stage boundaries
off the even layout's, then the smallest forward sizes and then backward sizes
(compared as tuples): a function of the plans' structure, with no time in it.
With tie > 0 the search first offers every even plan (every fused size) with
the fewest stages of a tied plan and, one count down at a time, with fewer
while a count has a tied plan, and snaps each uneven tied plan of the fewest
stages towards the even layout, boundary by boundary while it still ties; so
which of the tied even plans wins does not depend on which plans the heuristic
walk timed. With tie = 0 only equal floats tie, the reference is the fastest
plan and the guarantees above are exact; with tie > 0 the result is within
1 + tie of the reference, so guarantee (b) holds within the factor 1 + tie and
(a) and (c) within (1 + tie)^2, and every bound prunes against the reference x
(1 + tie), so every plan of the guaranteed families that could tie is timed.
With at most 7 layers the result is therefore the least plan by that order
over all plans within the tie. The search is deterministic: the same
CostTable and options always give the same plan. `compile` ranks measured
costs with tie = 0.05 on a GPU and 0.2 on the CPU (`rpcompile.pipeline.measured_tie`:
measured times move between processes, on a loaded CPU by far more, and a plan
with fewer stages hands fewer activations between workers, which this
compute-only objective does not price).

What is heuristic: everything else, a best-first walk over stage-time caps
(`cap_walk.py`) run before the even family so that the family's pruning
starts from a good plan. It finds the plans that fuse much of the model
(staleness 1 without a memory budget) and uneven layouts.

Note: pruning. A plan with fused size f (work w per microbatch: the fwd of the
n other layers twice, everything else once) takes at least M w / N (the
workers' throughput) and, with staleness 0, D + (R-1) t_max (D the fwd + bwd
of all layers: one microbatch's dependency chain, which the recompute is off;
the slowest stage runs the round's R microbatches one after another). With
staleness 1 the window of `iteration_time` averages p iterations, and with p
even and every worker in each round (S >= N, or one round) iteration t + 2
starts after iteration t ends, so it is at least half the staleness-0 bound;
the throughput bound M w / N is the steady state's and holds for the window
in every case tested (tests/passes/partition/test_partition_guarantees.py checks both bounds
on random plans). The guaranteed families drop a plan only when its bound
exceeds the time up to which plans tie (`ties.reach`; the best time with
tie = 0) by more than 1e-9 (relative), so every plan that could tie is timed;
with staleness 1 a plan that passes those bounds is also dropped when half of
its isolated (staleness-0) iteration exceeds that time, an exact bound
(`Evaluator.isolated_floor`) that costs one iteration instead of the window's
3P; `iteration_time`'s cutoff is that time plus that slack.

Note: speed (issue 31). A plan is first timed by `steady.py` (each slot by
its first and last microbatch, and only until the state repeats, shifted, from
one iteration or every few to the next: usually 2-3 iterations instead of 3P),
and the complete even family of a model of up to 40 layers all at once
(`batch.py`: step-major float64 tables, after dropping every plan whose
busiest worker alone is slower than the cutoff, `batch.busiest_worker`, about
a third of the family on the paper models); both agree with `iteration_time`
to about 1e-12, and a plan they put within 1e-10 of the cutoff is timed again
by `iteration_time` itself. So every time the search compares, stores or
reports is `iteration_time`'s float, and the plans are those of the one-by-one
exact search: on the paper models up to 40x faster than before, with the same
plans. Where the machine has a C compiler, both recurrences, the batch and the
cap walk's walk over caps and its layout search run in C (`native.py`): the
same operations on the same doubles, so the same floats bit for bit, and the
same plans as without it (another 2-5x on the paper models).
"""
from __future__ import annotations

import itertools
import math

from rpcompile.ir.costs import CostTable, _fmt
from rpcompile.passes.partition import cap_walk, even_plans, ties
from rpcompile.passes.partition.evaluator import Evaluator
from rpcompile.passes.partition.report import with_report
from rpcompile.passes.partition.timing import default_round_size, steady_state_window
from rpcompile.ir.plan import StagePlan

_EPS = 1e-12     # relative slack for float cap comparisons (as the reference heuristic)
_MARGIN = 1e-9   # relative slack of the bounds and the cutoff (float sums round)
_FILL = 0.75     # staleness 0 heap order: fill and drain as a share of (N-1) t_max
_EXHAUSTIVE = 7  # layers up to which every plan is timed


def partition(costs: CostTable, *, gpus: int, microbatches: int, round_size: int | None = None,
              memory_budget: int | None = None, staleness: int = 1, budget: int | None = None,
              tie: float = 0.0) -> StagePlan:
    """The stage plan with the least `iteration_time` whose stages fit `memory_budget` (see the module doc).

    Args:
        costs: per-layer costs (times per microbatch, bytes).
        gpus: workers N.
        microbatches: microbatches per iteration M.
        round_size: microbatches per round R (default `default_round_size`).
        memory_budget: device bytes per worker (`StagePlan.stage_memory`); None = no limit.
        staleness: 0 or 1, the schedule the plan is ranked under.
        budget: effort of the heuristic cap walk (and of a partial even sweep) in recurrence steps and
            layout stages (default max(2**16, 40 * layers * M), 5x that with a memory budget beyond 40
            layers); the guarantees do not depend on it.
        tie: plans within this share of the fastest plan's time count as ties (see the module doc,
            Ties); 0 (default) ranks by time alone. `compile` passes `MEASURED_TIE` for measured costs.
    Returns:
        A StagePlan carrying its evaluation (`plan.report`), so `print(plan)` is the table.
    Raises:
        ValueError: a layer alone does not fit the budget, or no plan fits.

    >>> from rpcompile.ir.costs import CostTable
    >>> c = CostTable.from_lists(fwd=[1.0, 1.0], bwd=[2.0, 2.0])
    >>> partition(c, gpus=1, microbatches=1).to_str()
    '|2|'
    """
    if staleness not in (0, 1):
        raise ValueError(f"staleness must be 0 or 1, got {staleness!r}")
    if gpus < 1 or microbatches < 1:
        raise ValueError(f"partition: gpus and microbatches must be >= 1, got {gpus} and {microbatches}")
    if not (isinstance(tie, (int, float)) and 0 <= tie < 1):
        raise ValueError(f"partition: tie must be a share in [0, 1), got {tie!r}")
    rr = round_size or default_round_size(gpus, microbatches)
    if microbatches % rr:
        raise ValueError(f"partition: round_size {rr} must divide microbatches {microbatches}")
    _check_layers_fit(costs, memory_budget)
    if budget is None:  # beyond the complete families a memory budget leaves plans of many small stages, each
        budget = max(2 ** 16, 40 * costs.num_layers * microbatches)  # costlier to time: 5x the effort there
        if memory_budget is not None and costs.num_layers > even_plans.COMPLETE_LAYERS:
            budget *= 5
    search = _Search(costs, gpus, microbatches, rr, staleness, memory_budget, float(tie))
    search.run(budget)
    fs, f, bs = search.choice()
    return with_report(StagePlan.from_sizes(fs, f, bs), costs, gpus=gpus, microbatches=microbatches,
                       round_size=rr, staleness=staleness, memory_budget=memory_budget)


def _check_layers_fit(costs: CostTable, budget: int | None) -> None:
    """Raise naming the first layer whose own training footprint exceeds the budget."""
    if budget is None:
        return
    for i, name in enumerate(costs.names):
        need = costs.param_bytes[i] + costs.grad_bytes[i] + costs.peak_bytes[i]
        if need > budget:
            raise ValueError(f"partition: layer {i} {name!r} needs {_fmt(need, False)} ({need} bytes: params, "
                             f"grads, workspace) but the memory budget is {_fmt(budget, False)} ({budget} bytes)")


class _Search:
    """The best plan so far and the bounds and estimates the families and the cap walk share."""

    margin = _MARGIN

    def __init__(self, costs: CostTable, n_gpu: int, m: int, rr: int, staleness: int, memory: int | None,
                 tie: float = 0.0):
        self.tie = tie
        self.costs, self.n_gpu, self.m, self.rr, self.st, self.memory = costs, n_gpu, m, rr, staleness, memory
        self.ev = Evaluator(costs, gpus=n_gpu, microbatches=m, round_size=rr, staleness=staleness, memory=memory)
        self.nl = costs.num_layers
        self.wb = [a + b for a, b in zip(costs.fwd, costs.bwd)]
        self.pf = list(itertools.accumulate(costs.fwd, initial=0.0))
        self.pb = list(itertools.accumulate(self.wb, initial=0.0))
        self.chain = sum(costs.fwd) + sum(costs.bwd)
        self.wb_max = list(itertools.accumulate(self.wb, max, initial=0.0))  # max wb over layers [0, n)
        self.f_max = list(itertools.accumulate(costs.fwd, max, initial=0.0))  # max fwd over layers [0, n)
        # M w / N per fused size f (see work_bound), and the chain bound's parts: looked up, not recomputed
        self._work_bound = [self.m * self.work(f) / n_gpu for f in range(self.nl + 1)]
        self._rr1, self._st1 = rr - 1, 1 + staleness
        self._halves: dict = {}  # stage count -> whether `floor`'s chain bound applies, halved
        self.best = self.reach = math.inf  # the fastest time timed; up to `reach` a plan ties (`ties.reach`)
        self.even_best = math.inf  # the fastest even plan's time (kept with tie > 0 only: `ties.py`)
        self.near: dict = {}  # (fwd, f, bwd) -> time, of every timed plan that fits and was within reach
        self.seen: set = set()

    def run(self, budget: int) -> None:
        """(c) every plan, or the cap walk then (b) the even family; then (a) the reference plan.

        The walk goes first so that the families are pruned against a good plan; the order does not
        change which plan wins (the tie rule is a total order).
        """
        if self.nl <= _EXHAUSTIVE:
            even_plans.exhaustive(self)
        else:
            self._three_stage_seed()
            if not self.near:  # nothing fits so far: one layer per stage, the least memory per GPU
                self.consider((1,) * (self.nl - 1), 1, (1,) * (self.nl - 1))
            cap_walk.walk(self, budget)
            even_plans.sweep(self, budget)
        ref = reference_plan(self.costs, self.wb, self.n_gpu, self.ev)
        if ref is not None:
            self.consider(*ref, rigorous=True)
        if not self.near:
            one = self.ev.stages((1,) * (self.nl - 1), 1, (1,) * (self.nl - 1))
            raise ValueError(f"partition: no stage plan fits the memory budget {_fmt(self.memory, False)} per "
                             f"GPU (one layer per stage needs {_fmt(max(self.ev.stage_memory(one)), False)})")

    def _three_stage_seed(self) -> None:
        """Time 3-stage plans (n | f | n) from the fused size with the least bound, moving f either way while
        that improves: a first plan to prune against (under staleness 1 without a memory budget the best
        plans fuse about half the model into few stages)."""
        def plan(f: int) -> tuple:
            return (self.nl - f,), f, (self.nl - f,)

        def t_max(f: int) -> float:
            n = self.nl - f
            return max(self.pf[n], self.pb[self.nl] - self.pb[n], self.pb[n])
        start = min(range(1, self.nl), key=lambda f: (self.bound(f, t_max(f)), f))
        self.consider(*plan(start))
        for step in (1, -1):
            f = start + step
            while 1 <= f < self.nl:
                before = self.best
                self.consider(*plan(f))
                if not self.best < before:
                    break
                f += step

    def work(self, f: int) -> float:
        """Seconds of compute per microbatch with f fused layers (the forward of the rest runs twice)."""
        return self.pf[self.nl - f] + self.pb[self.nl]

    def work_bound(self, f: int) -> float:
        """M w / N: the workers' throughput bound for fused size f (see the module Note)."""
        return self._work_bound[f]

    def bound(self, f: int, t_max: float) -> float:
        """The cap walk's pruning bound (heuristic with staleness 1: the halved chain bound is not always valid)."""
        w, chain = self._work_bound[f], (self.chain + self._rr1 * t_max) / self._st1
        return w if w > chain else chain

    def floor(self, f: int, t_max: float, stages: int) -> float:
        """The bound the guaranteed families prune with (see the module Note)."""
        chain = self.chain + (self.rr - 1) * t_max
        if self.st == 0:
            return max(self._work_bound[f], chain)
        halves = self._halves.get(stages)
        if halves is None:  # whether the chain bound halves at this stage count (one answer per count)
            rounds = self.m // self.rr
            even = steady_state_window(self.n_gpu, stages, rounds)[1] % 2 == 0
            halves = self._halves[stages] = even and (stages >= self.n_gpu or rounds == 1)
        return max(self._work_bound[f], chain / 2 if halves else 0.0)

    def fill(self, t_max: float) -> float:
        """Heap order only: the fill and drain of an isolated (staleness 0) iteration."""
        return 0.0 if self.st else _FILL * (self.n_gpu - 1) * t_max

    def estimate(self, f: int, tfb: float, fwd: tuple, bwd: tuple, b: int) -> float:
        """Heap order of a plan from its sides' (total, slowest, sum of running max) in slot order, in O(1).

        A slot cannot finish its R microbatches faster than the slowest stage before it passes them on,
        so each slot holds its worker about t_i + (R-1) * max(t_0..t_i); the backward stages' pace starts at
        the forward side's and the fused stage's, hence b * that pace when it exceeds their running maxima.
        """
        f_sum, f_max, f_paced = fwd
        b_sum, b_max, b_paced = bwd
        r1 = self._rr1
        pace = f_max if f_max > tfb else tfb  # max(), spelled out: this runs for every queued plan
        b_pace = b * pace
        held = f_sum + r1 * f_paced + tfb + r1 * pace + b_sum + r1 * (b_paced if b_paced > b_pace else b_pace)
        return self._order(held, pace if pace > b_max else b_max)

    def _order(self, held: float, t_max: float) -> float:
        """Workers held per round over the iteration and N workers, or the chain bound if larger."""
        w, chain = held * (self.m // self.rr) / self.n_gpu, (self.chain + self._rr1 * t_max) / self._st1
        return (w if w > chain else chain) + self.fill(t_max)

    def consider(self, fs: tuple, f: int, bs: tuple, *, rigorous: bool = False, fast: float | None = None) -> str:
        """Time one plan unless seen, over the memory budget, or no better than the best by a bound.

        `rigorous`: prune only by the guaranteed families' `floor`; otherwise by the cap walk's `bound`,
        and a plan pruned so is not marked seen, so that a guaranteed family still times it.
        `fast`: the plan's `steady.steady_time`, computed beforehand (`Evaluator.time`).
        Returns what happened: "skipped", "too big" or "timed".
        """
        plan = (fs, f, bs)
        if plan in self.seen:
            return "skipped"
        t_max = self.ev.slowest(fs, f, bs)
        lim = self.reach * (1 + _MARGIN)
        if rigorous:
            if self.floor(f, t_max, len(fs) + 1 + len(bs)) > lim:
                self.seen.add(plan)
                return "skipped"
        elif self.bound(f, t_max) >= self.reach:
            return "skipped"
        self.seen.add(plan)
        stages = self.ev.stages(fs, f, bs)
        if not self.ev.fits(stages):
            return "too big"
        if fast is None and self.ev.isolated_floor(stages, lim) > lim:  # exact bound: the plan cannot tie the best
            return "timed"
        t = self.ev.time(stages, cutoff=lim, fast=fast)
        if t <= lim:
            self.near[plan] = t
            even = self.tie > 0 and t < self.even_best and ties.is_even(self.nl, plan)
            if t < self.best or even:
                self.best, self.even_best = min(t, self.best), t if even else self.even_best
                self.reach = ties.reach(self.best, self.even_best, self.tie)
                if len(self.near) > 64:  # drop the plans the new times put out of reach
                    self.near = {k: x for k, x in self.near.items() if x <= self.reach}
        return "timed"

    def ceiling(self) -> float:
        """The most `reach` can grow to from now on (`ties.ceiling`)."""
        return ties.ceiling(self.best, self.even_best, self.tie)

    def tied(self) -> list[tuple]:
        """The plans timed so far that fit and tie the fastest (module doc, Ties), as (fwd, f, bwd)."""
        return [k for k, t in self.near.items() if t <= self.reach]

    def ties(self, plan: tuple) -> bool:
        """Whether `plan` (fwd, f, bwd) was timed, fits and ties the fastest."""
        return self.near.get(plan, math.inf) <= self.reach

    def choice(self) -> tuple:
        """The plan the tie rule picks (`ties.py`) among those timed, as (fwd sizes, f, bwd sizes)."""
        return ties.choose(self)


def reference_plan(costs: CostTable, wb: list[float], n_gpu: int, ev: Evaluator) -> tuple | None:
    """Family (a): the RoundPipe reference plan among its candidates that fit the budget, as sizes."""
    best, nl = None, costs.num_layers
    for i in range(11):
        cap = max(wb) * (1 + 0.01 * i)
        for f in range(1, nl + 1):
            if sum(wb[nl - f:]) > cap * (1 + _EPS):
                break
            n = nl - f
            fs, bs = tuple(_greedy_fill(costs.fwd[:n], cap)), tuple(_greedy_fill(wb[:n][::-1], cap))
            cost = max(len(fs) + 1 + len(bs), n_gpu) * cap
            if (best is None or cost < best[0]) and ev.fits(ev.stages(fs, f, bs)):
                best = (cost, (fs, f, bs))
    return None if best is None else best[1]


def _greedy_fill(w, cap: float) -> list[int]:
    """Stage sizes filling each stage up to cap in order (a layer above cap stands alone)."""
    sizes, acc = [], 0.0
    for x in w:
        if sizes and acc + x <= cap * (1 + _EPS):
            sizes[-1] += 1
            acc += x
        else:
            sizes.append(1)
            acc = x
    return sizes
