"""`iteration_time` fast: each slot by its first and last microbatch, and the steady state once it repeats.

`timing.run` follows every microbatch of every slot for 3P iterations (P up
to N). This module computes the same quantity from two observations, to about
1e-12 (relative; float sums taken in another order), which is what a search
needs to rank plans; `partition` re-times with `iteration_time` every plan that
may tie, so every time it reports or compares for a tie is exact.

Note: two microbatches per slot suffice. A slot runs its R microbatches in
order, each when the worker and its input are ready: end_m = max(end_{m-1},
g_m) + q with end_{-1} = c (the worker's clock after the upload), q the
microbatch's compute and g_m when its input is ready (F, FB: the previous
slot's end of m; B: max(saved input of m, previous slot's end of m - recompute),
since the recompute needs only the saved input). So end_{R-1} = max(c + R q,
max_j g_j + (R - j) q), and end_0 = max(c, g_0) + q. Every g is a maximum of
sequences convex in m (the first slot's c + (m+1) q is linear; a maximum of
convex sequences and the running maximum above keep convexity), so g_j - j q
is convex and its maximum is at j = 0 or j = R-1: end_{R-1} = max(c + R q,
g_{R-1} + q, g_0 + R q). The first and last ends of every slot therefore
follow from the first and last ends of its inputs: O(1) per slot instead of O(R).

Note: the steady state. One iteration maps the state (each worker's clock and
its slot's first start, the latest upload per stage, the optimizer's clock, the
copies the next iteration reads and the last steps) to the next; the same map
every iteration once the rotation is accounted for (worker w of this iteration
is worker w + S * rounds of the next), from the second iteration on when every
slot index is >= N: the second reads no copy (the initial weights), which is
the third's rule reading copies that are all 0, so the state after the first
iteration carries zeros as the copies the second reads. The map is max-plus: monotone,
and adding a constant to the state adds it to the result. So if the state
after iteration t is the state after t - 1 (rotated) plus increments in [lo,
hi], every later iteration's increments are in [lo, hi] too, and so is the
window `iteration_time` averages. The run stops when hi - lo <= 1e-12 of the
clocks (the steady state: usually by the second or third iteration, instead of
3P up to 24) and returns the last increment; and (`cutoff`) as soon as lo
exceeds the cutoff, returning math.inf: the plan is slower.

Note: periodic steady states. Some plans never repeat from one iteration to
the next but do every q (increments 731.6, 754.1, 731.6, ... ms: q = 2; near
the best plans of Qwen3-1.7B at R = 16 these are the plans that ran all 3P
iterations). The same argument holds for the map applied q times, so the run
also compares the state with the one q iterations back, for every q it has
(the iterations in between all steady), and once one repeats shifted by a
constant it extends the ends q at a time up to the window (`periodic_window`).

    >>> from rpcompile.passes.partition.timing import shape
    >>> sh = shape([(0, 0, 3, 3.0, 6.0), (1, 3, 4, 1.0, 2.0), (2, 0, 3, 3.0, 6.0)])
    >>> steady_time(sh, gpus=1, microbatches=2, round_size=2, staleness=0)
    30.0
"""
from __future__ import annotations

import math

from rpcompile.passes.partition.timing import Shape, _copies, steady_state_window

TOLERANCE = 1e-12  # relative spread of the increments taken as the steady state (float sums round)


def steady_time(sh: Shape, *, gpus: int, microbatches: int, round_size: int, staleness: int,
                cutoff: float | None = None) -> float:
    """`iteration_time` of a plan given as a `timing.Shape`, to about 1e-12 relative (see the module Note).

    Args:
        sh: the plan's shape (`timing.shape`).
        gpus, microbatches, round_size, staleness: as `iteration_time` (round_size resolved).
        cutoff: once the time is proven above this, return math.inf (None: never); a time within
            about 1e-12 of it may go either way, so callers leave a margin (`evaluator.SCREEN`).
    Returns:
        Seconds, or math.inf (above `cutoff`).
    """
    n, rr = gpus, round_size
    info, layers, holders, grad_stage = sh.info, sh.layers, sh.holders, sh.grad_stage
    ns, rounds, nseg = len(info), microbatches // rr, len(grad_stage)
    iters, window = (1, 1) if staleness == 0 else steady_state_window(n, ns, rounds)
    per = ns * rounds
    free, first_start, uploaded = [0.0] * n, [0.0] * n, [0.0] * ns
    copies: list[list[float]] = []
    steps: list[list[float]] = []
    last_step, ends = 0.0, []
    states: list[list[float]] = []  # the normalized state after each iteration
    zero_copies = [0.0] * nseg      # the copies iteration 1 reads: none, so its uploads wait for nothing
    for t in range(iters):
        k = t * per
        src = t - 1 - staleness
        if src >= 0:
            cp = copies[src]
            ready = [max(cp[g] for g in lay) for lay in layers]
        else:
            ready = [0.0] * ns
        gend = [0.0] * ns
        t_end = 0.0
        for _ in range(rounds):
            d0 = dr = -math.inf  # first and last end of the previous slot (none before the round's first)
            f0: list[float] = []
            fr: list[float] = []
            for i, kind, pre, post, prod in info:  # the upload rule as timing.run's, inlined (the hot loop)
                w = k % n
                up = ready[i]
                if k >= n and first_start[w] > up:
                    up = first_start[w]
                if up > uploaded[i]:
                    uploaded[i] = up
                c = free[w] if free[w] >= up else up
                if kind == 2:
                    q = pre + post
                    g0, gr = d0 - pre, dr - pre
                    if prod is not None:
                        s0 = c if c >= f0[prod] else f0[prod]
                        g0 = g0 if g0 >= f0[prod] else f0[prod]
                        gr = gr if gr >= fr[prod] else fr[prod]
                    else:
                        s0 = c
                else:
                    q, g0, gr = post, d0, dr
                    s0 = c if c >= d0 else d0
                a = (c if c >= g0 else g0) + q
                z = c + rr * q
                x = gr + q
                if x > z:
                    z = x
                x = g0 + rr * q
                if x > z:
                    z = x
                free[w], first_start[w] = z, s0
                if kind == 0:
                    f0.append(a)
                    fr.append(z)
                else:
                    gend[i] = z
                d0, dr = a, z
                if z > t_end:
                    t_end = z
                k += 1
        ends.append(t_end)
        if staleness == 1 and t >= 1:
            copies.append(_copies(steps[t - 1], holders, uploaded))
        step = [0.0] * nseg
        prev = copies[t - 1] if t >= 1 else None
        for g in range(nseg - 1, -1, -1):  # as timing.run: one step at a time, layers descending
            x = gend[grad_stage[g]]
            if prev is not None and prev[g] > x:
                x = prev[g]
            if x > last_step:
                last_step = x
            step[g] = last_step
        steps.append(step)
        if staleness == 0:
            copies.append(_copies(step, holders, uploaded))
            continue
        shift = ((t + 1) * per) % n
        state = [*free[shift:], *free[:shift], *first_start[shift:], *first_start[:shift], *uploaded,
                 last_step, *(copies[t - 1] if t >= 1 else zero_copies), *step]
        states.append(state)
        # state(t) = Map^q(state(t - q)) when iterations t-q+1..t are all the same map (the second on,
        # every slot index >= N); the first q whose increments agree gives the period
        for q in range(1, t + 1):
            if (t - q + 1) * per < n:
                break
            inc = [a - b for a, b in zip(state, states[-1 - q])]
            lo, hi = min(inc), max(inc)
            lo1 = lo if q == 1 else lo1
            if cutoff is not None and window_floor(ends, q, lo, lo1, iters, window) > cutoff:
                return math.inf
            if hi - lo <= TOLERANCE * max(t_end, 1e-300):
                out = periodic_window(ends, q, (lo + hi) / 2, iters, window)
                return out if cutoff is None or out <= cutoff else math.inf
    if staleness == 0:
        return ends[0] if cutoff is None or ends[0] <= cutoff else math.inf
    out = (ends[-1] - ends[-1 - window]) / window
    return out if cutoff is None or out <= cutoff else math.inf


def window_floor(ends: list[float], q: int, lo_q: float, lo_1: float, iters: int, window: int) -> float:
    """A lower bound on `iteration_time`'s window average from what iterations 0..t (`ends`) proved.

    Every end q iterations after iteration t is at least `lo_q` above the end q before it, and every end at
    least `lo_1` above the one before (the state grew by at least that much, and the map is monotone): the
    window's ends already known count as they are, the rest in blocks of q, then single steps.

        >>> window_floor([0.0, 1.0, 3.0], 2, 4.0, 1.0, 6, 2)  # ends 3 and 5 unknown: at least 4 apart
        2.0
    """
    t, first = len(ends) - 1, iters - 1 - window
    known = ends[t] - ends[first] if t > first else 0.0
    m = iters - 1 - max(first, t)
    return (known + (m // q) * lo_q + (m % q) * lo_1) / window


def periodic_window(ends: list[float], q: int, inc: float, iters: int, window: int) -> float:
    """`iteration_time`'s window average once the state repeats every q iterations, `inc` later.

    `ends` holds iterations 0..t; every later end is the end q iterations before plus `inc` (the map is
    max-plus, so the state q iterations on is this one shifted by `inc`, and so on), which gives ends up
    to iteration `iters` - 1 and the average of the last `window` increments there.

        >>> periodic_window([0.0, 3.0, 5.0, 8.0], 2, 5.0, 6, 2)  # increments 3, 2, 3, 2, ...
        2.5
    """
    ends = list(ends)
    while len(ends) < iters:
        ends.append(ends[-q] + inc)
    return (ends[iters - 1] - ends[iters - 1 - window]) / window
