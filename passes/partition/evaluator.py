"""Plans as stage sizes: stage tuples, device memory and exact time without building a StagePlan.

A search evaluates thousands of plans; building each as a `StagePlan` costs
more than timing it. `Evaluator` keeps per-layout stage tuples (first layer,
end layer, fwd sum, bwd sum), checks memory with integer prefix sums (the same
bytes as `StagePlan.stage_memory`) and times plans: with a cutoff, first with
`steady.py` (to about 1e-12, a few iterations instead of 3P), and a plan that
may come within the cutoff again with the recurrence of `timing.py`, so every
time it returns is the float `iteration_time` gives (stage sums are taken in
layer order, exactly as `iteration_time` takes them).

    >>> from rpcompile.ir.costs import CostTable
    >>> ev = Evaluator(CostTable.from_lists([1.0] * 4, [2.0] * 4), gpus=1, microbatches=2, round_size=2,
    ...                staleness=0, memory=None)
    >>> ev.time(ev.stages((3,), 1, (3,)))
    30.0
"""
from __future__ import annotations

import bisect
import itertools
import math
from typing import Iterator

from rpcompile.ir.costs import CostTable
from rpcompile.passes.partition import native
from rpcompile.passes.partition.steady import steady_time
from rpcompile.passes.partition.timing import layer_sums, shape, shape_time, steady_state_window

SCREEN = 1e-10  # relative: a fast time (`steady.py`, within about 1e-12) this far above a cutoff is above it
_SCREEN_WORK = 24  # window iterations x microbatches per round below which a plan is timed exactly at once


class Evaluator:
    """Stage tuples, memory and time of plans (forward sizes, fused size, backward sizes) of one problem."""

    def __init__(self, costs: CostTable, *, gpus: int, microbatches: int, round_size: int, staleness: int,
                 memory: int | None):
        self.costs, self.n_gpu, self.m, self.rr, self.st, self.memory = (
            costs, gpus, microbatches, round_size, staleness, memory)
        self.nl = costs.num_layers
        self.p_param = list(itertools.accumulate(costs.param_bytes, initial=0))
        self.p_work = list(itertools.accumulate((g + p for g, p in zip(costs.grad_bytes, costs.peak_bytes)),
                                                initial=0))
        self._sums: dict = {}  # (lo, hi) -> layer_sums(costs, lo, hi): layouts share most of their stages
        self._own: dict = {}   # stage tuple -> `_own_bytes` (`fits`): plans share most of their stages
        self._fwd: dict = {}   # (sizes) -> forward stage tuples
        self._bwd: dict = {}   # (sizes) -> backward stage tuples, execution order
        self._fused: dict = {}  # fused size -> its stage tuple
        self._f_slow: dict = {}  # (sizes) -> the forward side's slowest stage time (`slowest`)
        self._b_slow: dict = {}  # (sizes) -> the backward side's
        self.timed = 0         # recurrence steps spent (stages x microbatches x iterations)
        self.lib = native.load()  # the C recurrences (the same floats), or None: timing.py's and steady.py's

    def forward(self, sizes: tuple[int, ...]) -> tuple:
        """Forward stage tuples (0, lo, hi, fwd sum, bwd sum) of a layout from layer 0 up."""
        out = self._fwd.get(sizes)
        if out is None:
            cuts = itertools.accumulate(sizes, initial=0)
            out = self._fwd[sizes] = tuple((0, lo, hi) + self.sums(lo, hi) for lo, hi in itertools.pairwise(cuts))
        return out

    def backward(self, sizes: tuple[int, ...]) -> tuple:
        """Backward stage tuples (2, lo, hi, ...) of a layout in execution order (descending layers)."""
        out = self._bwd.get(sizes)
        if out is None:
            hi, stages = sum(sizes), []
            for s in sizes:
                stages.append((2, hi - s, hi) + self.sums(hi - s, hi))
                hi -= s
            out = self._bwd[sizes] = tuple(stages)
        return out

    def stages(self, fs: tuple[int, ...], f: int, bs: tuple[int, ...]) -> list:
        """All stage tuples in slot order: F1..Fa, FB, B1..Bb."""
        return [*self.forward(fs), self.fused(f), *self.backward(bs)]

    def fused(self, f: int) -> tuple:
        """The fused stage tuple (1, lo, hi, fwd sum, bwd sum) of the last f layers."""
        out = self._fused.get(f)
        if out is None:
            n = self.nl - f
            out = self._fused[f] = (1, n, self.nl) + self.sums(n, self.nl)
        return out

    def slowest(self, fs: tuple[int, ...], f: int, bs: tuple[int, ...]) -> float:
        """t_max: the time of the plan's slowest stage (F: its fwd sum; FB, B: fwd + bwd), from each side's
        slowest, kept per layout (an empty side counts 0.0), and the fused stage's. The same float as the max
        over all its `stages`: either way max returns one of the times, and equal times are the same float
        (a sum of costs >= 0 is never -0.0, the one float equal to another without being it)."""
        a = self._f_slow.get(fs)
        if a is None:
            a = self._f_slow[fs] = max((x for _, _, _, x, _ in self.forward(fs)), default=0.0)
        b = self._b_slow.get(bs)
        if b is None:
            b = self._b_slow[bs] = max((x + y for _, _, _, x, y in self.backward(bs)), default=0.0)
        _, _, _, x, y = self.fused(f)
        return max(a, x + y, b)

    def sums(self, lo: int, hi: int) -> tuple[float, float]:
        """`timing.layer_sums(costs, lo, hi)`, each range summed once (the same floats)."""
        out = self._sums.get((lo, hi))
        if out is None:
            out = self._sums[lo, hi] = layer_sums(self.costs, lo, hi)
        return out

    def side_fits(self, sizes: tuple[int, ...], *, backward: bool, start: int = 0) -> bool:
        """False if a stage of this layout (sizes in layer order from `start`) cannot fit the budget in any
        plan: its own parameters, plus for a backward stage its gradients and workspace, exceed it."""
        if self.memory is None:
            return True
        pp, pw, lo = self.p_param, self.p_work, start
        for s in sizes:
            if pp[lo + s] - pp[lo] + (pw[lo + s] - pw[lo] if backward else 0) > self.memory:
                return False
            lo += s
        return True

    def fits(self, stages: list) -> bool:
        """True if every stage fits the memory budget (bytes as `StagePlan.stage_memory` with gpus=N); stops at
        the first stage that does not (most plans a search offers under a tight budget do not fit).

        The stages are checked from the last slot back: nearly every plan that does not fit has a B stage over
        the budget (its gradients and workspace), and the B stages need no saved-input sums (`_held`).
        """
        if self.memory is None:
            return True
        budget, pp, own, n, ns = self.memory, self.p_param, self._own, self.n_gpu, len(stages)
        held = None
        for i in range(ns - 1, -1, -1):
            stage = stages[i]
            mem = own.get(stage)
            if mem is None:
                mem = own[stage] = self._own_bytes(*stage[:3])
            nxt = stages[(i + n) % ns]  # the stage prefetched while this one runs
            mem += pp[nxt[2]] - pp[nxt[1]]
            if stage[0] == 0:
                if held is None:
                    held = self._held(stages)
                mem += held(stage[1], stage[2] - 1)
            if mem > budget:
                return False
        return True

    def stage_memory(self, stages: list) -> list[int]:
        """`StagePlan.stage_memory(costs, gpus=N)` of the plan, from prefix sums."""
        return list(self._stage_bytes(stages))

    def _stage_bytes(self, stages: list) -> Iterator[int]:
        """Each stage's device bytes, in slot order (see `stage_memory`)."""
        pp, n, ns = self.p_param, self.n_gpu, len(stages)
        held = self._held(stages)
        for i, (code, lo, hi, _, _) in enumerate(stages):
            _, nlo, nhi, _, _ = stages[(i + n) % ns]  # the stage prefetched while this one runs
            yield self._own_bytes(code, lo, hi) + pp[nhi] - pp[nlo] + (held(lo, hi - 1) if code == 0 else 0)

    def _own_bytes(self, code: int, lo: int, hi: int) -> int:
        """A stage's device bytes but for the stage it prefetches and (F) the saved inputs it keeps: its
        parameters, input (twice) and output, and for FB and B stages gradients, workspace and activations."""
        c, pp, pw = self.costs, self.p_param, self.p_work
        saved, act = c.saved_bytes, c.act_bytes
        last = hi - 1
        inp = saved[lo] if code == 2 or lo == 0 else act[lo - 1]
        mem = pp[hi] - pp[lo] + 2 * inp + act[last]
        if code != 0:
            mem += pw[hi] - pw[lo] + (act[lo - 1] if lo > 0 else 0)
            if code == 2:
                mem += act[last]
        return mem

    def _held(self, stages: list):
        """held(lo, last): the bytes of the saved inputs an F stage over layers lo..last keeps, those of the
        B stages that start inside it (after lo, up to last)."""
        saved = self.costs.saved_bytes
        cuts = sorted(lo for code, lo, _, _, _ in stages if code == 2 and lo > 0)  # the saved inputs' layers
        held = list(itertools.accumulate((saved[j] for j in cuts), initial=0))   # their bytes, summed in order
        right = bisect.bisect_right
        return lambda lo, last: held[right(cuts, last)] - held[right(cuts, lo)]

    def time(self, stages: list, cutoff: float | None = None, fast: float | None = None) -> float:
        """`iteration_time` of the plan (math.inf once known to exceed cutoff); charges its steps.

        With a cutoff the plan is first timed by `steady.steady_time` (or `fast`, that time computed
        beforehand, e.g. by `batch.steady_times`); only a plan within the cutoff by that time is timed
        again exactly, so the result is `iteration_time`'s float or math.inf, as without the screen.
        """
        ns = len(stages)
        iters = 1 if self.st == 0 else steady_state_window(self.n_gpu, ns, self.m // self.rr)[0]
        self.timed += ns * self.m * iters
        run = self._runner(stages, self.st)
        if cutoff is None or math.isinf(cutoff):
            return run(True, None)
        if fast is None and iters * self.rr < _SCREEN_WORK:
            return run(True, cutoff)  # a short window: the screen would not pay for itself
        if fast is None:
            fast = run(False, cutoff * (1 + SCREEN))
        if fast > cutoff * (1 + SCREEN):
            return math.inf
        return run(True, cutoff)

    def isolated_floor(self, stages: list, cutoff: float) -> float:
        """A lower bound on the staleness-1 `iteration_time` from one isolated iteration (0 if none applies).

        Iteration t + 2 reads the weights iteration t's steps wrote, so its first slot waits for t's last
        gradient and ends[t+2] >= ends[t] + T0, T0 being the iteration alone on free workers (the
        recurrence is max-plus, hence monotone: later inputs never give earlier times). The window of p
        iterations that `iteration_time` averages therefore spans at least p/2 such pairs when p is even:
        the time is at least T0 / 2. T0 is taken from `steady.steady_time` (one slot per step), and from
        the recurrence itself when that lands within 1e-10 of the cutoff, so it is on the same side of the
        cutoff as the exact bound.
        """
        if self.st != 1 or steady_state_window(self.n_gpu, len(stages), self.m // self.rr)[1] % 2:
            return 0.0
        self.timed += len(stages) * self.m
        run = self._runner(stages, 0)
        if self.rr * 3 < _SCREEN_WORK:  # few microbatches per slot: the recurrence is as quick
            return run(True, None if math.isinf(cutoff) else 2 * cutoff) / 2
        t0 = run(False, None) / 2  # within about 1e-12 of the recurrence's, one slot per step
        if math.isinf(cutoff) or abs(t0 - cutoff) > cutoff * SCREEN:
            return t0  # the same side of the cutoff as the exact value
        return run(True, 2 * cutoff) / 2

    def _runner(self, stages: list, staleness: int):
        """run(exact, cutoff): the plan's `timing.shape_time` (exact) or `steady.steady_time` under
        `staleness`, in C when the kernel is built (`native.py`: the same floats), else in Python."""
        kw = dict(gpus=self.n_gpu, microbatches=self.m, round_size=self.rr, staleness=staleness)
        if self.lib is not None:
            return lambda exact, cutoff: native.time(self.lib, stages, cutoff=cutoff, exact=exact, **kw)
        sh = shape(stages)
        return lambda exact, cutoff: (shape_time if exact else steady_time)(sh, cutoff=cutoff, **kw)
