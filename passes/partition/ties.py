"""`partition`'s tie rule: one canonical plan among those within the tie of the fastest (issue 26).

Plans tie when their iteration time is within `tie` (a share) of the
reference: the fastest even plan timed (both sides laid out as
`even_plans.even_sizes`, any fused size) when it is within the tie of the
fastest plan timed, else the fastest plan. The fastest plan of a heuristic
search is the extreme of whichever plans it happened to time, and it is the
plan that gains most from measurement noise; the fastest even plan is the best
of a family that is searched in full, so ties are measured from it. The plan
returned is the least tied plan by `key`, a function of its structure only (no
time in it):

1. the fewest stages;
2. the most fused layers (they need no recompute and no activation round trip);
3. the fewest stage boundaries off the even layout's (0: an even plan);
4. the smaller forward sizes, then backward sizes (execution order), as tuples.

    >>> key(6, ((3, 2), 1, (3, 2))) < key(6, ((2, 3), 1, (3, 2)))   # even before uneven
    True
    >>> key(6, ((2, 2), 2, (2, 2))) < key(6, ((3, 2), 1, (3, 2)))   # 5 stages each: 2 fused before 1
    True

With tie > 0 the search first makes the tied set complete where the rule looks
(`settle`): it offers every even plan (every fused size) with as many stages as
the fewest of the tied plans, and with fewer, one count down at a time while a
count still has a tied plan; then it snaps each uneven tied plan of the fewest
stages towards the even layout, one boundary at a time from the first forward
cut to the last backward one, keeping each move whose plan still ties. So the
choice among tied even plans does not depend on which of them the heuristic
search happened to time, and measured times decide only which plans tie (which
moves with the noise near the edge of the tie), never which of the tied ones
wins. With tie = 0 only equal floats tie (the reference is the fastest plan)
and the rule orders the tied plans the search timed, with no extra plans.
"""
from __future__ import annotations

import itertools

from rpcompile.passes.partition.even_plans import even_sizes

_ROUNDS = 3  # settle: rounds of completion + snapping while they find a faster plan


def off_even(n: int, sizes: tuple[int, ...]) -> int:
    """How many of a side's stage boundaries differ from the even layout's of as many stages over n layers."""
    if not sizes:
        return 0
    got, even = itertools.accumulate(sizes), itertools.accumulate(even_sizes(n, len(sizes)))
    return sum(a != b for a, b in zip(got, even))


def is_even(nl: int, plan: tuple) -> bool:
    """Whether both sides of `plan` (fwd sizes, f, bwd sizes) are the even layout of their stage count."""
    fs, f, bs = plan
    return not (off_even(nl - f, fs) or off_even(nl - f, bs))


def reach(best: float, even_best: float, tie: float) -> float:
    """The time up to which a plan ties: the reference (module doc) x (1 + tie).

    >>> reach(100.0, 103.0, 0.05), reach(100.0, 106.0, 0.05)
    (108.15, 105.0)
    """
    ref = even_best if even_best <= best * (1 + tie) else best
    return ref * (1 + tie)


def ceiling(best: float, even_best: float, tie: float) -> float:
    """The most `reach` can grow to from these times on, since both only fall.

    `reach` is the reference x (1 + tie), and the reference is the fastest even plan's time when that is
    within best x (1 + tie), else the fastest time, which is at most the fastest even plan's. So no reach
    to come exceeds min(best x (1 + tie) x (1 + tie), even_best x (1 + tie)): with tie = 0 (no even plan
    tracked) the fastest time. The same float operations as `reach`, so the bound holds for its floats.

    >>> ceiling(100.0, 104.0, 0.05) >= reach(100.0, 104.0, 0.05), ceiling(100.0, 120.0, 0.05)
    (True, 110.25)
    """
    return min(best * (1 + tie) * (1 + tie), even_best * (1 + tie))


def key(nl: int, plan: tuple) -> tuple:
    """The tie rule's order of a plan (forward sizes, fused size, backward sizes) of an nl-layer model."""
    fs, f, bs = plan
    return (len(fs) + 1 + len(bs), -f, off_even(nl - f, fs) + off_even(nl - f, bs), fs, bs)


def choose(search) -> tuple:
    """The tied plan `key` ranks first, as (fwd sizes, f, bwd sizes); `search` is a `partition._Search`."""
    if search.tie > 0:
        settle(search)
    return min(search.tied(), key=lambda p: key(search.nl, p))


def settle(search) -> None:
    """Offer the plans the rule looks at (module doc) until a round finds no faster plan."""
    for _ in range(_ROUNDS):
        best = search.best
        _complete(search)
        _snap_all(search)
        if not search.best < best:
            return


def _complete(search) -> None:
    """Offer every even plan with the fewest stages of a tied plan, then with fewer while a count has a tied one."""
    start = min(_stages(p) for p in search.tied())
    count = start
    while count >= 1:
        found = False
        for plan in _even_plans_with(search.nl, count):
            search.consider(*plan, rigorous=True)
            found |= search.ties(plan)
        if not found and count < start:
            return
        count -= 1


def _stages(plan: tuple) -> int:
    """Stages of a plan (fwd sizes, f, bwd sizes)."""
    return len(plan[0]) + 1 + len(plan[2])


def _even_plans_with(nl: int, stages: int):
    """Every even plan of nl layers with `stages` stages: fused size f, a forward and b backward stages."""
    if stages == 1:
        yield (), nl, ()
        return
    for f in range(1, nl):
        n = nl - f
        for a in range(max(1, stages - 1 - n), min(n, stages - 2) + 1):
            yield even_sizes(n, a), f, even_sizes(n, stages - 1 - a)


def _snap_all(search) -> None:
    """Snap each uneven tied plan of the fewest stages towards the even layout."""
    tied = search.tied()
    fewest = min(map(_stages, tied))
    for plan in sorted(p for p in tied if _stages(p) == fewest and not is_even(search.nl, p)):
        _snap(search, plan)


def _snap(search, plan: tuple) -> tuple:
    """Move each boundary of `plan` to the even layout's, first forward cut to last backward, while it ties."""
    fs, f, bs = plan
    n = search.nl - f
    sides = [list(itertools.accumulate(fs))[:-1], list(itertools.accumulate(bs))[:-1]]
    for side in (0, 1):
        cuts = sides[side]
        target = list(itertools.accumulate(even_sizes(n, len(cuts) + 1)))[:-1]
        for i, want in enumerate(target):
            lo, hi = cuts[i - 1] if i else 0, cuts[i + 1] if i + 1 < len(cuts) else n
            if cuts[i] == want or not lo < want < hi:
                continue
            trial = [list(cuts) for cuts in sides]
            trial[side][i] = want
            candidate = tuple(_sizes(c, n) for c in trial)
            plan_t = (candidate[0], f, candidate[1])
            search.consider(*plan_t, rigorous=True)
            if search.ties(plan_t):
                sides, cuts = trial, trial[side]
    return _sizes(sides[0], n), f, _sizes(sides[1], n)


def _sizes(cuts: list[int], n: int) -> tuple[int, ...]:
    """Stage sizes from the inner boundaries of a side of n layers."""
    return tuple(b - a for a, b in itertools.pairwise([0, *cuts, n]))
