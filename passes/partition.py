"""partition: choose the asymmetric stage plan that minimises `iteration_time`.

    >>> from rpcompile.costs import CostTable
    >>> c = CostTable.from_lists(fwd=[1e-3] * 8, bwd=[2e-3] * 8)
    >>> partition(c, gpus=4, microbatches=8, staleness=0).to_str()
    '1,2,2,2|1|1,1,1,1,1,1,1'

Note: the search. A plan is (fused tail size f, forward layout, backward
layout); its t_max is a contiguous sum of stage times. For every f (all of
them, down to everything fused) two generators walk the caps, the contiguous
sums of either side: one up from t_min (the fused stage or the largest layer's
fwd + bwd, whichever is larger), one down from just below it (more stages:
needed for tight memory budgets). At a cap the fewest stages of a side is a
non-increasing step function of the cap (prefix sums, one binary search per
stage); the side is laid out over the fewest stages and up to `_EXTRA` more,
evenly (each cut at the prefix sum nearest j/k of the work), larger-first and
larger-last, and each new layout is paired with the other side's layouts so
far. One heap orders generators and plans by an estimate: a slot holds its
worker for about t_i + (R-1) * max(t_0..t_i) (it is paced by the slowest
stage upstream), over N workers. The RoundPipe reference greedy plans are
timed first, so the result is never worse than them; then plans are timed in
heap order with the exact `iteration_time` (cutoff: the best so far). With w
the work per microbatch (fixed by f) and D the sum of fwd + bwd over all
layers (the dependency chain of one microbatch; a B stage's recompute is off
it), a plan with t_max T takes at least max(M w / N, (D + (R-1) T) / (1 +
staleness)): with staleness 1 iteration t+2 cannot start before iteration t's
last backward, hence the halving. Plans and generators whose bound reaches the
best time are dropped; the search ends when the heap is empty or `budget`
(recurrence steps of the timed plans plus the layouts' stages) is spent, once
some plan fits. Tiny inputs are searched exhaustively by the same rules.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import math

from rpcompile.costs import CostTable, _fmt
from rpcompile.passes.timing import default_round_size, iteration_time, steady_state_window
from rpcompile.plan import StagePlan

_EPS = 1e-12   # relative slack for float prefix-sum comparisons
_EXTRA = 2     # stage counts above the fewest tried at each cap
_FILL = 0.75  # staleness 0 heap order: fill and drain as a share of (N-1) t_max
_PER_LAYER = 16  # budget charged per layer for building and checking a plan
_GEN, _PLAN = 0, 1


def partition(costs: CostTable, *, gpus: int, microbatches: int, round_size: int | None = None,
              memory_budget: int | None = None, staleness: int = 1, budget: int | None = None) -> StagePlan:
    """The stage plan with the least `iteration_time` whose stages fit `memory_budget`.

    Args:
        costs: per-layer costs (times per microbatch, bytes).
        gpus: workers N.
        microbatches: microbatches per iteration M.
        round_size: microbatches per round R (default `default_round_size`).
        memory_budget: device bytes per worker (`StagePlan.stage_memory`); None = no limit.
        staleness: 0 or 1, the schedule the plan is ranked under.
        budget: search effort in recurrence steps and layout stages (default max(2**16, 40 * layers * M)).
    Returns:
        A StagePlan carrying its evaluation (`plan.report`), so `print(plan)` is the table.
    Raises:
        ValueError: a layer alone does not fit the budget, or no plan fits.

    >>> from rpcompile.costs import CostTable
    >>> c = CostTable.from_lists(fwd=[1.0, 1.0], bwd=[2.0, 2.0])
    >>> partition(c, gpus=1, microbatches=1).to_str()
    '|2|'
    """
    if staleness not in (0, 1):
        raise ValueError(f"staleness must be 0 or 1, got {staleness!r}")
    rr = round_size or default_round_size(gpus, microbatches)
    _check_layers_fit(costs, memory_budget)
    if budget is None:
        budget = max(2 ** 16, 40 * costs.num_layers * microbatches)
    search = _Search(costs, gpus, microbatches, rr, staleness, memory_budget)
    plan = search.run(budget)
    return plan.evaluated(costs, gpus=gpus, microbatches=microbatches, round_size=rr, staleness=staleness,
                          memory_budget=memory_budget)


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
    """Best-first search over (fused size, forward layout, backward layout); see the module Note."""

    def __init__(self, costs: CostTable, n_gpu: int, m: int, rr: int, staleness: int, memory: int | None):
        self.costs, self.n_gpu, self.m, self.rr, self.st, self.memory = costs, n_gpu, m, rr, staleness, memory
        self.nl = costs.num_layers
        self.wb = [a + b for a, b in zip(costs.fwd, costs.bwd)]
        self.pf, self.pb = _prefix(costs.fwd), _prefix(self.wb)
        self.chain = sum(costs.fwd) + sum(costs.bwd)
        self.wb_max = list(itertools.accumulate(self.wb, max, initial=0.0))  # max wb over layers [0, n)
        self.f_max = list(itertools.accumulate(costs.fwd, max, initial=0.0))  # max fwd over layers [0, n)
        self.heap: list = []
        self.seq = itertools.count()
        self.best, self.best_plan, self.spent = math.inf, None, 0
        self.seen: set = set()

    def work(self, f: int) -> float:
        """Seconds of compute per microbatch with f fused layers (the forward of the rest runs twice)."""
        return self.pf[self.nl - f] + self.pb[self.nl]

    def bound(self, f: int, t_max: float) -> float:
        """Lower bound on the iteration time of any plan with fused size f and this t_max."""
        return max(self.m * self.work(f) / self.n_gpu, (self.chain + (self.rr - 1) * t_max) / (1 + self.st))

    def fill(self, t_max: float) -> float:
        """Heap order only: the fill and drain of an isolated (staleness 0) iteration."""
        return 0.0 if self.st else _FILL * (self.n_gpu - 1) * t_max

    def estimate(self, f: int, fwd: tuple, bwd: tuple) -> float:
        """Heap order of a plan (stage times in slot order): workers held, paced by the slowest stage upstream.

        A slot cannot finish its R microbatches faster than the slowest stage before it passes them on,
        so each slot holds its worker about t_i + (R-1) * max(t_0..t_i).
        """
        pace = held = 0.0
        for t in itertools.chain(fwd, (self.pb[self.nl] - self.pb[self.nl - f],), bwd):
            pace = t if t > pace else pace
            held += t + (self.rr - 1) * pace
        t_max = pace
        est = max(held * (self.m // self.rr) / self.n_gpu, (self.chain + (self.rr - 1) * t_max) / (1 + self.st))
        return est + self.fill(t_max)

    def push_plan(self, fs: tuple, f: int, bs: tuple, fwd_t: tuple = None, bwd_t: tuple = None) -> None:
        """Queue a plan (backward sizes and times in execution order) unless seen before."""
        k = (fs, f, bs)
        if k not in self.seen:
            self.seen.add(k)
            if fwd_t is None:
                t = StagePlan.from_sizes(fs, f, bs).stage_times(self.costs)
                fwd_t, bwd_t = t[:len(fs)], t[len(fs) + 1:]
            heapq.heappush(self.heap, (self.estimate(f, fwd_t, bwd_t), next(self.seq), _PLAN, k))
            self.spent += len(fs) + len(bs) + 1

    def run(self, budget: int) -> StagePlan:
        """Pop and expand heap entries until it is empty or the budget is spent (with a plan found)."""
        for seed in _reference_seeds(self.costs, self.wb, self.n_gpu):
            self._evaluate(*seed)
        for f in range(1, self.nl + 1):
            shared: list = []
            for down in (False, True):
                g = _Generator(self, f, down, shared)
                heapq.heappush(self.heap, (g.key(), next(self.seq), _GEN, g))
        while self.heap and (self.spent < budget or self.best_plan is None):
            _, _, kind, item = heapq.heappop(self.heap)
            if kind == _GEN:
                if self.bound(item.f, max(item.cap, item.t_min)) < self.best and item.step():
                    heapq.heappush(self.heap, (item.key(), next(self.seq), _GEN, item))
            else:
                self._evaluate(*item)
        if self.best_plan is None:
            one = StagePlan.from_sizes([1] * (self.nl - 1), 1, [1] * (self.nl - 1))
            raise ValueError(f"partition: no stage plan fits the memory budget {_fmt(self.memory, False)} per "
                             f"GPU (one layer per stage needs "
                             f"{_fmt(max(one.stage_memory(self.costs, gpus=self.n_gpu)), False)})")
        return self.best_plan

    def _evaluate(self, fs: tuple, f: int, bs: tuple) -> None:
        """Time one plan exactly (cutoff: the best so far); charge S * M * iterations steps."""
        plan = StagePlan.from_sizes(fs, f, bs)
        times = plan.stage_times(self.costs)
        if self.bound(f, max(times)) >= self.best:
            return
        if self.memory is not None and max(plan.stage_memory(self.costs, gpus=self.n_gpu)) > self.memory:
            self.spent += plan.num_stages
            return
        iters = 1 if self.st == 0 else steady_state_window(self.n_gpu, plan.num_stages, self.m // self.rr)[0]
        self.spent += plan.num_stages * self.m * iters + _PER_LAYER * self.nl
        t = iteration_time(plan, self.costs, gpus=self.n_gpu, microbatches=self.m, round_size=self.rr,
                           staleness=self.st, cutoff=None if math.isinf(self.best) else self.best)
        if t < self.best:
            self.best, self.best_plan = t, plan


class _Generator:
    """Plans with f fused layers, cap by cap: up from t_min, or (down) from just below t_min to the least cap."""

    def __init__(self, search: _Search, f: int, down: bool, shared: list):
        self.s, self.f, self.n, self.down, self.shared = search, f, search.nl - f, down, shared
        self.tfb = search.pb[search.nl] - search.pb[self.n]
        self.t_min = max(self.tfb, search.wb_max[self.n])  # every layer's fwd + bwd sits in an FB or B stage
        self.cap, self.count = self.t_min, min(self.n, 1)  # the next cap and the fewest backward stages under it
        self.sides = None  # (forward, backward) _Caps, built on the first step

    def key(self) -> float:
        """Heap order of the next cap: the bound, or the workers held at its fewest stages if larger.

        The backward stages are paced by the cap (new layouts reach it): each holds its worker about
        (R-1) * cap.
        """
        s, n, t = self.s, self.n, max(self.cap, self.t_min)
        held = s.work(self.f) + (s.rr - 1) * (s.pf[n] + self.tfb + max(self.count * t, s.pb[n]))
        return max(s.bound(self.f, t), held * (s.m // s.rr) / s.n_gpu) + s.fill(t)

    def step(self) -> bool:
        """Advance to the next cap, queue the new plans; False when no caps remain."""
        s, n = self.s, self.n
        if n == 0:
            if not self.down:
                s.push_plan((), self.f, (), (), ())
            return False
        if self.sides is None:
            if not self.shared:  # per side, shared by both directions: layouts so far and their set
                self.shared.extend([([], set()), ([], set())])
            lo = (s.f_max[n], s.wb_max[n]) if self.down else (self.t_min, self.t_min)
            self.sides = tuple(_Caps(p, n, lo[i], self.t_min if self.down else math.inf, *self.shared[i])
                               for i, p in enumerate((s.pf, s.pb)))
        fwd, bwd = self.sides
        cap = self._next()
        if cap is None:
            return False
        for side, other, is_fwd in ((fwd, bwd, True), (bwd, fwd, False)):
            if side.head() != cap:
                continue
            side.pop()
            new, cost = side.layouts(cap)
            s.spent += cost
            for sizes, times in new:
                for o_sizes, o_times in other.done:
                    fs, bs = (sizes, o_sizes) if is_fwd else (o_sizes, sizes)
                    ft, bt = (times, o_times) if is_fwd else (o_times, times)
                    s.push_plan(fs, self.f, bs[::-1], ft, bt[::-1])
        cap = self._next()
        if cap is None:
            return False
        self.cap = cap
        self.count = _fewest(s.pb, n, self.cap)
        s.spent += self.count
        return True


    def _next(self) -> float | None:
        """The next cap of either side in walking order, None when both are done."""
        heads = [h for h in (self.sides[0].head(), self.sides[1].head()) if h is not None]
        return None if not heads else (max if self.down else min)(heads)


class _Caps:
    """One side's caps (contiguous sums of layers 0..n-1, prefix sums p) in [lo, hi), walked up or down.

    Walking up starts at lo itself; walking down starts at the largest sum below hi. `done` and `seen`
    (the side's layouts so far) are shared by both walks of one fused size.
    """

    def __init__(self, p: list[float], n: int, lo: float, hi: float, done: list, seen: set):
        self.p, self.n, self.lo, self.done, self.seen = p, n, lo, done, seen
        self.down = not math.isinf(hi)
        self.heap = [] if self.down else [(lo, -1, -1)]  # (+-sum of layers [i, j), i, j), one per start i
        for i in range(n):
            if self.down:
                j = bisect.bisect_left(p, p[i] + hi * (1 - _EPS), i + 1, n + 1) - 1
                if j > i and p[j] - p[i] >= lo * (1 - _EPS):
                    self.heap.append((p[i] - p[j], i, j))
            else:
                j = bisect.bisect_right(p, p[i] + lo * (1 + _EPS), i + 1, n + 1)
                if j <= n:
                    self.heap.append((p[j] - p[i], i, j))
        heapq.heapify(self.heap)

    def head(self) -> float | None:
        """The next cap, or None when the walk is over."""
        if not self.heap:
            return None
        return -self.heap[0][0] if self.down else self.heap[0][0]

    def pop(self) -> None:
        """Drop every entry equal to the head cap, advancing each start to its next sum."""
        key = self.heap[0][0]
        while self.heap and abs(self.heap[0][0] - key) <= abs(key) * _EPS:
            _, i, j = heapq.heappop(self.heap)
            nj = j - 1 if self.down else j + 1
            if self.down and nj > i and self.p[nj] - self.p[i] >= self.lo * (1 - _EPS):
                heapq.heappush(self.heap, (self.p[i] - self.p[nj], i, nj))
            elif not self.down and 0 <= j < self.n:
                heapq.heappush(self.heap, (self.p[nj] - self.p[i], i, nj))

    def layouts(self, cap: float) -> tuple[list[tuple[tuple[int, ...], tuple[float, ...]]], int]:
        """New layouts under cap (fewest stages .. +_EXTRA, each even, larger-first and larger-last), and the
        stages computed on the way (the effort)."""
        p, n, out = self.p, self.n, []
        k0 = _fewest(p, n, cap)
        ks = range(k0, min(n, k0 + _EXTRA) + 1)
        for k in ks:
            for sizes in (_even(p, n, cap, k), _greedy(p, n, cap, k, left=True), _greedy(p, n, cap, k, left=False)):
                if sizes is not None and sizes not in self.seen:
                    self.seen.add(sizes)
                    out.append((sizes, _sums(p, sizes)))
        self.done.extend(out)
        return out, k0 + 4 * sum(ks)


def _reference_seeds(costs: CostTable, wb: list[float], n_gpu: int) -> list[tuple]:
    """The RoundPipe reference plans: t_max in [max layer, 1.1 max layer], greedy, ranked by max(S, N) t_max."""
    best, nl = None, costs.num_layers
    for i in range(11):
        cap = max(wb) * (1 + 0.01 * i)
        for f in range(1, nl + 1):
            if sum(wb[nl - f:]) > cap * (1 + _EPS):
                break
            n = nl - f
            fs, bs = _greedy_fill(costs.fwd[:n], cap), _greedy_fill(wb[:n][::-1], cap)
            cost = max(len(fs) + 1 + len(bs), n_gpu) * cap
            if best is None or cost < best[0]:
                best = (cost, (tuple(fs), f, tuple(bs)))
    return [] if best is None else [best[1]]


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


def _prefix(w) -> list[float]:
    """Prefix sums, p[0] = 0."""
    return list(itertools.accumulate(w, initial=0.0))


def _fewest(p: list[float], n: int, cap: float) -> int:
    """Fewest contiguous stages over p's n layers with every stage <= cap (a layer above cap stands alone)."""
    k, i, slack = 0, 0, cap * _EPS
    while i < n:
        j = bisect.bisect_right(p, p[i] + cap + slack, i + 1, n + 1) - 1
        i = max(j, i + 1)
        k += 1
    return k


def _even(p: list[float], n: int, cap: float, k: int) -> tuple[int, ...] | None:
    """k stages under cap with each cut at the prefix sum nearest to j/k of the total that keeps the rest feasible."""
    slack, reach = cap * _EPS, [n]           # reach[q]: least start whose suffix fits in q stages
    for _ in range(k):
        i = reach[-1]
        reach.append(max(0, min(bisect.bisect_left(p, p[i] - cap - slack, 0, i), i - 1)) if i > 0 else 0)
    if reach[k] > 0:
        return None
    cuts = [0]
    for j in range(1, k):
        prev = cuts[-1]
        hi = min(max(bisect.bisect_right(p, p[prev] + cap + slack, prev + 1, n + 1) - 1, prev + 1), n - (k - j))
        lo = min(max(reach[k - j], prev + 1), hi)
        target = p[n] * j / k
        i = min(bisect.bisect_left(p, target, lo, hi + 1), hi)
        if i > lo and target - p[i - 1] <= p[i] - target:
            i -= 1
        cuts.append(i)
    cuts.append(n)
    return tuple(cuts[j + 1] - cuts[j] for j in range(k))


def _greedy(p: list[float], n: int, cap: float, k: int, *, left: bool) -> tuple[int, ...] | None:
    """k stages under cap, filled from the first layer (left) or the last; None if that needs more or fewer."""
    if not left:
        q = [p[n] - x for x in reversed(p[:n + 1])]
        sizes = _greedy(q, n, cap, k, left=True)
        return None if sizes is None else sizes[::-1]
    sizes, i, slack = [], 0, cap * _EPS
    while i < n:
        j = bisect.bisect_right(p, p[i] + cap + slack, i + 1, n + 1) - 1
        j = min(max(j, i + 1), n - (k - len(sizes) - 1))
        if j <= i:
            return None
        sizes.append(j - i)
        i = j
    return tuple(sizes) if len(sizes) == k else None


def _sums(p: list[float], sizes: tuple[int, ...]) -> tuple[float, ...]:
    """The stage sums of a layout."""
    cuts = list(itertools.accumulate(sizes, initial=0))
    return tuple(p[b] - p[a] for a, b in zip(cuts, cuts[1:]))
