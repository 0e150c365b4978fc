"""The cap walk: its first caps per start (one pass over the prefix sums, the same ends as a bisection each), the
caps it walks, and each plan queued once."""
from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random

import pytest

from rpcompile import CostTable
from rpcompile.passes import partition
from rpcompile.passes.partition import cap_walk, native
from rpcompile.passes.partition.cap_walk import _EPS, _Caps


def bisected(p, n, lo, hi):
    """The heap `_Caps` starts from, one bisection per start (the specification)."""
    heap = [] if not math.isinf(hi) else [(lo, -1, -1)]
    for i in range(n):
        if not math.isinf(hi):
            j = bisect.bisect_left(p, p[i] + hi * (1 - _EPS), i + 1, n + 1) - 1
            if j > i and p[j] - p[i] >= lo * (1 - _EPS):
                heap.append((p[i] - p[j], i, j))
        else:
            j = bisect.bisect_right(p, p[i] + lo * (1 + _EPS), i + 1, n + 1)
            if j <= n:
                heap.append((p[j] - p[i], i, j))
    heapq.heapify(heap)
    return heap


@pytest.mark.parametrize("seed", range(40))
def test_first_caps_equal_a_bisection_per_start(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    costs = [float(rng.choice([0, 1, 1, 2, 3, 5])) for _ in range(n + 3)]  # small integers: exact ties
    p = list(itertools.accumulate(costs, initial=0.0))
    for lo, hi in ((rng.choice([0.0, 1.0, 2.0, 4.0, 7.0]), math.inf),
                   (rng.choice([0.0, 1.0, 3.0]), rng.choice([0.0, 2.0, 4.0, 6.0, 9.0]))):
        caps = _Caps(p, n, lo, hi, set())
        assert caps.heap == bisected(p, n, lo, hi), (n, lo, hi, costs)


@pytest.mark.parametrize("seed", range(20))
def test_the_walk_visits_every_contiguous_sum_once_in_order(seed):
    # walking up from lo: every distinct contiguous sum >= lo, ascending; walking down from below hi: every one
    # in [lo, hi), descending (sums within _EPS of each other are one cap)
    rng = random.Random(100 + seed)
    n = rng.randint(1, 30)
    costs = [rng.choice([0.0, 1.0, 1.0, 2.0, 0.5, rng.uniform(0.1, 3.0)]) for _ in range(n + 2)]
    p = list(itertools.accumulate(costs, initial=0.0))
    sums = sorted({p[j] - p[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo = rng.choice(sums)
    hi = rng.choice([s for s in sums if s >= lo] + [sums[-1] * 2])

    def walked(caps):
        out = []
        while caps.head() is not None:
            out.append(caps.head())
            caps.pop()
        return out

    def distinct(xs):  # one per group of sums within _EPS
        out = []
        for x in xs:
            if not out or abs(x - out[-1]) > abs(out[-1]) * _EPS:
                out.append(x)
        return out

    up = [s for s in sums if s >= lo * (1 - _EPS)]
    assert walked(_Caps(p, n, lo, math.inf, set())) == [lo] + [x for x in distinct(up) if x > lo * (1 + _EPS)]
    down = [s for s in sums if lo * (1 - _EPS) <= s < hi * (1 - _EPS)][::-1]
    assert walked(_Caps(p, n, lo, hi, set())) == distinct(down), (costs[:n], lo, hi)


def problem(rng, most: int) -> tuple[CostTable, dict]:
    """Random costs of 8 to `most` layers (most alike, with memory) and `partition`'s arguments."""
    nl = rng.randint(8, most)
    layer = rng.uniform(0.5, 1.5)
    fwd = [rng.choice([layer, layer, rng.uniform(0.1, 2.0)]) for _ in range(nl)]
    costs = CostTable.from_lists(fwd=fwd, bwd=[2 * x for x in fwd], param_bytes=[100] * nl,
                                 grad_bytes=[100] * nl, peak_bytes=[rng.randint(0, 100) for _ in range(nl)])
    return costs, dict(gpus=rng.choice([2, 4, 8]), microbatches=16, round_size=rng.choice([4, 8, 16]),
                       staleness=rng.choice([0, 1]), memory_budget=rng.choice([None, 100 * rng.randint(4, 20)]))


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_the_walk_queues_each_plan_once(monkeypatch, kernel):
    # the walk keeps no set of the plans it queued: each side's layouts are new once, and each new one is
    # paired with the other side's layouts so far, so no plan comes twice (with the C walk and the Python one)
    monkeypatch.setenv(native.SWITCH, kernel)
    queued = []
    push = heapq.heappush

    def record(heap, item):
        if item[2] == cap_walk._PLAN:
            queued.append(item[3])
        push(heap, item)
    monkeypatch.setattr(cap_walk.heapq, "heappush", record)
    rng = random.Random(5)
    for _ in range(8):
        costs, kw = problem(rng, 40)
        queued.clear()
        partition(costs, **kw)
        assert queued and len(set(queued)) == len(queued)


def test_skipping_hopeless_fused_sizes_times_the_same_plans(monkeypatch):
    # the walk queues no walk for a fused size whose bound at its least cap reaches `_Search.ceiling` (the most
    # the tie's reach can grow to): with the skip switched off (an infinite ceiling) every problem, with tie 0
    # and with wide ties (where a slower even plan raises the reach), times the same plans in the same order,
    # with fewer walks
    mod = __import__("sys").modules["rpcompile.passes.partition"]
    calls: list = []
    consider = mod._Search.consider

    def record(self, *args, **kw):
        got = consider(self, *args, **kw)
        calls.append((args, kw.get("rigorous", False), got))
        return got
    monkeypatch.setattr(mod._Search, "consider", record)
    walks = {True: 0, False: 0}  # walks made, with and without the skip
    skipping = [True]
    init = cap_walk._Generator.__init__

    def count(self, *args):
        walks[skipping[0]] += 1
        init(self, *args)
    monkeypatch.setattr(cap_walk._Generator, "__init__", count)
    rng = random.Random(11)
    for _ in range(60):
        costs, kw = problem(rng, 60)
        kw["tie"] = rng.choice([0.0, 0.05, 0.2, 0.3])
        runs = []
        for skip in (True, False):
            calls.clear()
            skipping[0] = skip
            with monkeypatch.context() as m:
                if not skip:
                    m.setattr(mod._Search, "ceiling", lambda self: math.inf)
                plan = partition(costs, **kw)
            runs.append((plan.to_str(), list(calls)))
        assert runs[0] == runs[1], kw
    assert walks[True] < 0.9 * walks[False]  # and the skip is real
