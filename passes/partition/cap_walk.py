"""The heuristic part of `partition`: a best-first walk over stage-time caps.

A plan is (fused tail size f, forward layout, backward layout); its t_max is a
contiguous sum of stage times. For every f two generators walk the caps, the
contiguous sums of either side: one up from t_min (the fused stage or the
largest layer's fwd + bwd, whichever is larger), one down from just below it
(more stages: needed for tight memory budgets); a fused size whose bound at
t_min already reaches the most the tie's reach can grow to (`ties.ceiling`)
gets none, since every cap of it would be dropped. At a cap the fewest stages of
a side is a non-increasing step function of the cap (prefix sums, one binary
search per stage); the side is laid out over the fewest stages and up to
`_EXTRA` more, evenly by time (each cut at the prefix sum nearest j/k of the
work), larger-first and larger-last, and each new layout is paired with the
other side's layouts so far (a layout with a stage whose own bytes exceed the
memory budget is dropped: no plan could hold it). One heap orders generators
and plans by an estimate: a slot holds its worker for about
t_i + (R-1) * max(t_0..t_i) (it is paced by the slowest stage upstream), over
N workers. Plans are timed in heap order by `partition`'s search
(`_Search.consider`); generators and plans whose bound reaches the time a
plan may still tie (`_Search.reach`: the reference time x (1 + tie)) are dropped;
the walk ends when the heap is empty, when every estimate left exceeds that
time by `STOP`, or when `budget` (recurrence steps of the
timed plans plus the layouts' stages) is spent, once some plan fits. Where the
planner's kernel is built, a step of a walk (its next cap, the layouts there
and which of them are new and may fit) is one call into C (`native.CapWalks`,
the same caps and layouts as `_PyWalk`). Nothing here is guaranteed:
`partition`'s guarantees come from the reference plan, the even family and the
exhaustive search.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import math

from rpcompile.passes.partition import native

_EPS = 1e-12   # relative slack for float prefix-sum comparisons
_EXTRA = 1     # stage counts above the fewest tried at each cap (2 was slower and no better on random 41-100 layer cases)
_PER_LAYER = 16  # budget charged per layer for building and checking a plan
STOP = 0.05      # the walk ends once every estimate left exceeds the best time by this share
_GEN, _PLAN = 0, 1


def walk(search, budget: int) -> None:
    """Run the cap walk for `search` (a `partition._Search`) until its heap is empty or `budget` is spent."""
    heap, seq, start = [], itertools.count(), search.ev.timed
    spent = [0]
    lib = search.ev.lib  # the sides walk in C where the kernel is built (`native.CapWalks`), else in Python
    kernel = None if lib is None else native.cap_walks(lib, search.ev, search.pf, search.pb, _EXTRA)
    try:
        ceiling = search.ceiling()  # no reach to come exceeds it
        for f in range(1, search.nl + 1):
            if search.bound(f, least_cap(search, f)) >= ceiling:
                continue  # hopeless at its least cap, so at every cap: its walks would be dropped unstepped
            sides = _Sides(search, f, kernel)
            for down in (False, True):
                g = _Generator(search, f, down, sides, heap, seq, spent)
                heapq.heappush(heap, (g.key(), next(seq), _GEN, g))
        while heap and (spent[0] + search.ev.timed - start < budget or not search.near):
            if heap[0][0] > search.reach * (1 + STOP):
                break  # every estimate left is well above the best time
            _, _, kind, item = heapq.heappop(heap)
            if kind == _GEN:
                if search.bound(item.f, max(item.cap, item.t_min)) < search.reach and item.step():
                    heapq.heappush(heap, (item.key(), next(seq), _GEN, item))
            else:
                done = search.consider(*item)  # its recurrence steps count through search.ev.timed
                spent[0] += (len(item[0]) + len(item[2]) + 1 if done == "too big" else
                             _PER_LAYER * search.nl if done == "timed" else 0)
    finally:
        heap.clear()  # its generators hold it: no cycle left for the garbage collector, and no walk on freed sides
        if kernel is not None:
            kernel.close()


def least_cap(search, f: int) -> float:
    """t_min of fused size f: the fused stage, or the largest layer's fwd + bwd (each sits in an FB or B stage)."""
    n = search.nl - f
    return max(search.pb[search.nl] - search.pb[n], search.wb_max[n])


class _Generator:
    """Plans with f fused layers, cap by cap: up from t_min, or (down) from just below t_min to the least cap."""

    def __init__(self, search, f: int, down: bool, sides: _Sides, heap: list, seq, spent: list):
        self.s, self.f, self.n, self.down, self.sides = search, f, search.nl - f, down, sides
        self.heap, self.seq, self.spent = heap, seq, spent  # the walk's heap, its order of entry and effort
        self.tfb = search.pb[search.nl] - search.pb[self.n]
        self.t_min = least_cap(search, f)
        self.cap, self.count = self.t_min, min(self.n, 1)  # the next cap and the fewest backward stages under it
        self.work = search.work(f)
        self.caps = None  # the walk over both sides' caps (`_Sides.walk`), made on the first step
        # what `key` needs of the search, once: R-1, the forward side's and fused stage's work (the sum key
        # took first: the same float), the backward side's work, the rounds
        self._fixed = (search.rr - 1, search.pf[self.n] + self.tfb, search.pb[self.n], search.m // search.rr)

    def key(self) -> float:
        """Heap order of the next cap: the bound, or the workers held at its fewest stages if larger.

        The backward stages are paced by the cap (new layouts reach it): each holds its worker about
        (R-1) * cap.
        """
        s, t = self.s, max(self.cap, self.t_min)
        r1, head, tail, rounds = self._fixed
        held = self.work + r1 * (head + max(self.count * t, tail))
        return max(s.bound(self.f, t), held * rounds / s.n_gpu) + s.fill(t)

    def step(self) -> bool:
        """Advance to the next cap, queue the new plans; False when no caps remain."""
        s, n = self.s, self.n
        if n == 0:
            if not self.down:
                self._queue(0, [((), _NONE, (), _NONE)], [((), _NONE, (), _NONE)])
            return False
        if self.caps is None:
            lo = (s.f_max[n], s.wb_max[n]) if self.down else (self.t_min, self.t_min)
            self.caps = self.sides.walk(self.down, lo, self.t_min if self.down else math.inf)
        got = self.caps.step()
        if got is None:
            return False
        fresh, following = got
        for i, (k0, layouts) in enumerate(fresh):  # forward, then backward
            if k0 < 0:
                continue  # the cap is not one of this side's
            top = min(n, k0 + _EXTRA)
            self.spent[0] += k0 + 2 * (k0 + top) * (top - k0 + 1)  # the stages computed: k0 + 4 * (k0 + .. + top)
            if layouts:
                new = self.sides.accept(i, layouts)
                if new:
                    self._queue(i, new, self.sides.done[1 - i])
        if following is None:
            return False
        self.cap, self.count = following
        self.spent[0] += self.count
        return True

    def _queue(self, i: int, new: list, others: list) -> None:
        """Queue each new layout of side i (0 forward, 1 backward) with each of the other side's `others`
        (`_Sides.done` entries), unless hopeless by the bound. Each plan is queued once, with no set of plans
        to check: a layout is new to its side once (both walks of a fused size share the sides), and at a cap
        that is both sides' the forward side's new layouts are paired before the backward side's join `done`."""
        s, f, tfb, heap, seq = self.s, self.f, self.tfb, self.heap, self.seq
        bound, estimate, reach, effort = s.bound, s.estimate, s.reach, 0
        for mine in new:  # a forward layout is paired as it is, a backward one in execution order
            for theirs in others:
                fwd_side, bwd_side = (mine, theirs) if i == 0 else (theirs, mine)
                fwd, bwd, fs, bs = fwd_side[1], bwd_side[3], fwd_side[0], bwd_side[2]
                if bound(f, max(fwd[1], tfb, bwd[1])) < reach:
                    heapq.heappush(heap, (estimate(f, tfb, fwd, bwd, len(bs)), next(seq), _PLAN, (fs, f, bs)))
                    effort += len(fs) + len(bs) + 1
        self.spent[0] += effort


class _Sides:
    """Both sides of one fused size, shared by its two walks: each side's layouts so far that may fit.

    Per side, `done` holds those layouts, each as (sizes, forward aggregate, sizes in execution order as a
    backward side, backward aggregate): `partition._Search.estimate`'s sides (`aggregate`). A layout with a
    stage whose own bytes exceed the memory budget (`Evaluator.side_fits`) is never paired: no plan could hold it.
    """

    def __init__(self, search, f: int, kernel: native.CapWalks | None):
        self.s, self.n, self.kernel = search, search.nl - f, kernel
        self.done: tuple[list, list] = ([], [])
        self.seen: tuple[set, set] = (set(), set())  # every layout found so far (Python walks)
        self.native = None  # (forward, backward) C sides (`native.CapWalks.pair`), made with the first walk

    def walk(self, down: bool, lo: tuple[float, float], hi: float):
        """The walk over both sides' caps in [lo, hi) (lo per side): `native.Walk` where the kernel is built,
        else `_PyWalk`; either gives the same caps and layouts."""
        s, n = self.s, self.n
        if self.kernel is None:
            return _PyWalk(tuple(_Caps(p, n, lo[i], hi, self.seen[i],
                                       ok=lambda sizes, b=bool(i): s.ev.side_fits(sizes, backward=b))
                                 for i, p in enumerate((s.pf, s.pb))), down)
        if self.native is None:
            self.native = self.kernel.pair(n)
        return self.kernel.walk(self.native, n, down, lo, hi)

    def accept(self, i: int, layouts: list[tuple]) -> list[tuple]:
        """New layouts of side i (0 forward, 1 backward) that may fit, added to the side's `done` as its entries."""
        p = (self.s.pf, self.s.pb)[i]
        out = []
        for sizes in layouts:
            agg = aggregate(_sums(p, sizes))  # as either side: (layer order, its aggregate), reversed
            out.append((sizes, agg[:3], sizes[::-1], agg[:2] + agg[3:]))
        self.done[i].extend(out)
        return out


class _PyWalk:
    """`native.Walk` in Python: both sides' `_Caps` walking one way."""

    def __init__(self, caps: tuple, down: bool):
        self.caps, self.down = caps, down

    def step(self) -> tuple | None:
        """None when no cap is left, else ([(k0, new layouts) forward, backward], (next cap, the backward
        side's fewest stages under it) or None): each side whose next cap is the next cap of either is popped
        and its new layouts at the cap that may fit are found (`_Caps.layouts`; k0 is the fewest stages at
        the cap, -1 for a side whose caps do not include it)."""
        cap = self._next()
        if cap is None:
            return None
        fresh = []
        for side in self.caps:
            if side.head() != cap:
                fresh.append((-1, []))
                continue
            side.pop()
            fresh.append(side.layouts(cap))
        cap = self._next()
        bwd = self.caps[1]
        return fresh, None if cap is None else (cap, _fewest(bwd.p, bwd.n, cap))

    def _next(self) -> float | None:
        """The next cap of either side in walking order, None when both are done."""
        heads = [h for h in (self.caps[0].head(), self.caps[1].head()) if h is not None]
        return None if not heads else (max if self.down else min)(heads)


class _Caps:
    """One side's caps (contiguous sums of layers 0..n-1, prefix sums p) in [lo, hi), walked up or down.

    Walking up starts at lo itself; walking down starts at the largest sum below hi. `seen` (the side's
    layouts so far) is shared by both walks of one fused size; `ok(sizes)`: whether a layout may fit.
    """

    def __init__(self, p: list[float], n: int, lo: float, hi: float, seen: set, ok=None):
        self.p, self.n, self.lo, self.seen, self.ok = p, n, lo, seen, ok
        self.rp: list[float] | None = None  # prefix sums from the last layer down, once a layout needs them
        self.down = not math.isinf(hi)
        self.heap = [] if self.down else [(lo, -1, -1)]  # (+-sum of layers [i, j), i, j), one per start i
        # per start i the bisection of p[i + 1 .. n] for p[i] + hi (down) or p[i] + lo (up); p does not
        # decrease, so that end only moves right as i does: one pass of k (the same ends as bisect's)
        k, heap = 1, self.heap
        if self.down:
            reach, floor = hi * (1 - _EPS), lo * (1 - _EPS)
            for i in range(n):
                x = p[i] + reach
                if k <= i:
                    k = i + 1
                while k <= n and p[k] < x:  # bisect_left(p, x, i + 1, n + 1)
                    k += 1
                j = k - 1
                if j > i and p[j] - p[i] >= floor:
                    heap.append((p[i] - p[j], i, j))
        else:
            reach = lo * (1 + _EPS)
            for i in range(n):
                x = p[i] + reach
                if k <= i:
                    k = i + 1
                while k <= n and p[k] <= x:  # bisect_right(p, x, i + 1, n + 1)
                    k += 1
                if k <= n:
                    heap.append((p[k] - p[i], i, k))
        heapq.heapify(heap)

    def head(self) -> float | None:
        """The next cap, or None when the walk is over."""
        if not self.heap:
            return None
        return -self.heap[0][0] if self.down else self.heap[0][0]

    def pop(self) -> None:
        """Drop every entry equal to the head cap, advancing each start to its next sum (in place of the head:
        the entries are distinct tuples, so the order they leave the heap in is the same)."""
        heap, p, n = self.heap, self.p, self.n
        key = heap[0][0]
        tol, floor = abs(key) * _EPS, self.lo * (1 - _EPS)
        while heap and abs(heap[0][0] - key) <= tol:
            _, i, j = heap[0]
            if self.down:
                if j - 1 > i and p[j - 1] - p[i] >= floor:
                    heapq.heapreplace(heap, (p[i] - p[j - 1], i, j - 1))
                    continue
            elif 0 <= j < n:
                heapq.heapreplace(heap, (p[j + 1] - p[i], i, j + 1))
                continue
            heapq.heappop(heap)

    def layouts(self, cap: float) -> tuple[int, list[tuple]]:
        """(k0, the new layouts under cap): for k = k0 (the fewest stages) .. k0 + `_EXTRA`, each even,
        larger-first and larger-last, those not seen before (all are seen from now on) that may fit (`ok`)."""
        p, n, out = self.p, self.n, []
        k0 = _fewest(p, n, cap)
        if self.rp is None:
            self.rp = [p[n] - x for x in reversed(p[:n + 1])]
        for k in range(k0, min(n, k0 + _EXTRA) + 1):
            right = _greedy(self.rp, n, cap, k)  # filled from the last layer: the same on the reversed sums
            for sizes in (_even(p, n, cap, k), _greedy(p, n, cap, k), right and right[::-1]):
                if sizes is not None and sizes not in self.seen:
                    self.seen.add(sizes)
                    if self.ok is None or self.ok(sizes):
                        out.append(sizes)
        return k0, out


_NONE = (0.0, 0.0, 0.0)  # the aggregate of an empty side


def aggregate(times: tuple[float, ...]) -> tuple[float, float, float, float]:
    """(total, slowest, sum of the running maximum in layer order, the same in reverse order) of stage times:
    what `partition._Search.estimate` needs of a forward side (layer order) or a backward side (reverse)."""
    out = []
    for seq in (times, times[::-1]):
        pace = paced = 0.0
        for t in seq:
            pace = t if t > pace else pace
            paced += pace
        out.append(paced)
    return sum(times), max(times), out[0], out[1]


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


def _greedy(p: list[float], n: int, cap: float, k: int) -> tuple[int, ...] | None:
    """k stages under cap, filled from the first layer; None if that needs more or fewer (on the reversed
    prefix sums, `_Caps.rp`, it fills from the last layer, the sizes reversed)."""
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
