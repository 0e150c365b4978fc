"""The plans a person would write, for `partition` to never lose to: even plans, and every plan of tiny models.

An even plan fuses the last f layers (the family: f = 1, 2 or 3, the sizes a
person tries first, whatever the RoundPipe reference heuristic would fuse) and
lays the other n = L - f layers out evenly over a forward stages and b
backward stages: stage sizes differ by at most one layer, the larger stages
first in execution order (forward: from layer 0 up; backward: from layer n-1
down), 1 <= a, b <= n.

    >>> even_sizes(28, 12)
    (3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2)
    >>> list(fused_sizes(28)), list(fused_sizes(2))
    ([1, 2, 3], [1, 2])
"""
from __future__ import annotations

import itertools
import math
from typing import Iterator

from rpcompile.passes.partition import batch, native
from rpcompile.passes.partition.cap_walk import _NONE, aggregate
from rpcompile.passes.partition.evaluator import SCREEN

COMPLETE_LAYERS = 40  # models up to this many layers get the even family swept completely
_MAX_FUSED = 3        # the family's largest fused size
_WINDOW = 3          # partial sweep: stage counts within this of the balanced count
_BATCH = 64          # complete sweep: plans left by the bound from which they are timed at once (`batch.py`)


def even_sizes(n: int, k: int) -> tuple[int, ...]:
    """n layers in k stages whose sizes differ by at most one, the larger first."""
    q, r = divmod(n, k)
    return (q + 1,) * r + (q,) * (k - r)


def fused_sizes(nl: int) -> range:
    """The fused sizes of the even family of an nl-layer model: 1 to `_MAX_FUSED` (at most nl)."""
    return range(1, min(nl, _MAX_FUSED) + 1)


def compositions(n: int) -> Iterator[tuple[int, ...]]:
    """Every way to cut n layers into contiguous non-empty stages, as sizes (one empty layout for n = 0)."""
    if n == 0:
        yield ()
        return
    for cuts in itertools.product((False, True), repeat=n - 1):
        sizes, run = [], 1
        for cut in cuts:
            if cut:
                sizes.append(run)
                run = 1
            else:
                run += 1
        sizes.append(run)
        yield tuple(sizes)


def exhaustive(search) -> None:
    """Offer every plan to `search` (a `partition._Search`): fused size x forward x backward layout."""
    for f in range(1, search.nl + 1):
        layouts = list(compositions(search.nl - f))
        for fs in layouts:
            for bs in layouts:
                search.consider(fs, f, bs, rigorous=True)


def sweep(search, budget: int) -> bool:
    """Offer the even family to `search`, best estimate first; True if it was swept completely.

    Up to `COMPLETE_LAYERS` layers every one is offered (`_complete`: all timed at once); beyond, only
    the stage counts 1..2N+1, those within `_WINDOW` of the balanced count (stages near max(fused
    stage, slowest layer)) and, under a memory budget, the fewest that fit and up to 2 x `_WINDOW`
    more, until `budget` recurrence steps are spent.
    """
    ev, nl, fused = search.ev, search.nl, fused_sizes(search.nl)
    complete = nl <= COMPLETE_LAYERS
    if complete:
        _complete(search)
        return True
    order = []
    for f in fused:
        n = nl - f
        if n == 0:
            order.append((0.0, f, 0, 0))
            continue
        if search.work_bound(f) > search.reach * (1 + search.margin):
            continue   # no plan with this fused size can win (the family's pruning, see partition's Note)
        tfb = search.pb[nl] - search.pb[n]
        target = max(tfb, search.wb_max[n])
        fitting = (None, None) if complete else (_fewest_fitting(ev, n, f, True), _fewest_fitting(ev, n, f, False))
        fwd = {a: _side(ev.forward(even_sizes(n, a)), False)
               for a in _counts(n, search, search.pf[n], target, complete, fitting[0])}
        bwd = {b: _side(ev.backward(even_sizes(n, b)), True)
               for b in _counts(n, search, search.pb[n], target, complete, fitting[1])}
        for a, fside in fwd.items():
            for b, bside in bwd.items():
                order.append((search.estimate(f, tfb, fside, bside, b), f, a, b))
    order.sort()
    start = ev.timed
    for _, f, a, b in order:
        if not complete and ev.timed - start >= budget and search.near:
            return False
        n = nl - f
        search.consider(even_sizes(n, a) if n else (), f, even_sizes(n, b) if n else (), rigorous=True)
    return complete


def _complete(search) -> None:
    """Offer every even plan to `search`: those the family's bound leaves are timed at once
    (`native.steady_times`, else `batch.steady_times`) against the time up to which a plan may tie when the sweep starts; those that
    may tie are then offered in the sweep's order (best estimate first), exactly as one by one: the time a
    plan may tie up to only falls, so a plan above it now is above it later too; the rest are marked seen,
    as the bound or the timing would have left them."""
    ev, nl = search.ev, search.nl
    lim = search.reach * (1 + search.margin)
    todo, info = [], {}
    for f in fused_sizes(nl):
        n = nl - f
        if search.work_bound(f) > lim:
            continue   # no plan with this fused size can win (the family's pruning, see partition's Note)
        tfb = search.pb[nl] - search.pb[n]
        fwd = {fs: _side(ev.forward(fs), False) for fs in (even_sizes(n, k) for k in range(1, n + 1))} if n else {(): _NONE}
        bwd = {bs: _side(ev.backward(bs), True) for bs in (even_sizes(n, k) for k in range(1, n + 1))} if n else {(): _NONE}
        f_ok = {fs: ev.side_fits(fs, backward=False) for fs in fwd}  # a stage too big for any plan: no
        b_ok = {bs: ev.side_fits(bs[::-1], backward=True) for bs in bwd}  # plan with this side can fit
        for fs, fa in fwd.items():
            for bs, ba in bwd.items():
                plan = (fs, f, bs)
                if plan in search.seen:
                    continue
                if not (f_ok[fs] and b_ok[bs]):
                    search.seen.add(plan)  # as `consider` marks a plan too big for the budget
                    continue
                if search.floor(f, max(fa[1], tfb, ba[1]), len(fs) + 1 + len(bs)) > lim:
                    search.seen.add(plan)  # as `consider` marks a plan its bound rules out
                    continue
                todo.append(plan)
                info[plan] = (tfb, fa, ba)
    if len(todo) < _BATCH:  # too few to share the tensors' overhead: one by one, as the sweep's order
        for plan in sorted(todo, key=lambda p: (search.estimate(p[1], info[p][0], info[p][1], info[p][2],
                                                               len(p[2])), p[1], len(p[0]), len(p[2]))):
            search.consider(*plan, rigorous=True)
        return
    cutoff = None if math.isinf(lim) else lim * (1 + SCREEN)
    if ev.lib is not None:  # the C kernel (`native.py`), else the tensor rows: the same plans either way
        times = native.steady_times(ev.lib, ev, todo, cutoff)
    else:
        times = batch.steady_times(ev, todo, cutoff)
    order = []
    for plan, t in zip(todo, times):
        if math.isinf(t):
            search.seen.add(plan)
            continue
        fs, f, bs = plan
        tfb, fa, ba = info[plan]
        order.append((search.estimate(f, tfb, fa, ba, len(bs)), f, len(fs), len(bs), t, plan))
    for *_, t, plan in sorted(order, key=lambda o: o[:4]):
        search.consider(*plan, rigorous=True, fast=t)


def _counts(n: int, search, total: float, target: float, complete: bool, fitting: int | None = None) -> list[int]:
    """Stage counts of one side to sweep: all of 1..n, or (partial) 1..2N+1, the balanced ones and, under a
    memory budget, the fewest that fit (`fitting`, None without a budget) and a few more."""
    if complete:
        return list(range(1, n + 1))
    k = max(1, min(n, int(total / target + 0.5))) if target > 0 else n
    near_fit = set(range(fitting, min(n, fitting + 2 * _WINDOW) + 1)) if fitting else set()
    return sorted(set(range(1, min(n, 2 * search.n_gpu + 1) + 1)) | set(range(max(1, k - _WINDOW),
                                                                               min(n, k + _WINDOW) + 1))
                  | near_fit)


def _fewest_fitting(ev, n: int, f: int, forward: bool) -> int | None:
    """About the fewest even stages of one side whose plans fit the memory budget, with the other side at
    one layer per stage (its least memory): a binary search, as if fitting were monotone in the count (it
    nearly is: more stages hold fewer layers each). None without a budget."""
    if ev.memory is None or n == 0:
        return None
    ones = (1,) * n

    def fits(k: int) -> bool:
        sizes = even_sizes(n, k)
        return ev.fits(ev.stages(sizes, f, ones) if forward else ev.stages(ones, f, sizes))
    lo, hi = 1, n
    if not fits(hi):
        return n
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _side(stages: tuple, backward: bool) -> tuple[float, float, float]:
    """(total, slowest, sum of the running maximum) of one side's stage tuples in slot order."""
    return aggregate(tuple(f + b if backward else f for _, _, _, f, b in stages))[:3]
