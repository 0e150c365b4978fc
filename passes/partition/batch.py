"""`steady.steady_time` for many plans at once: one tensor row per plan, slot by slot.

The even family of a model of up to 40 layers is about 3 n^2 plans (n the
layers outside the fused stage), each timed unless a bound rules it out; one
plan at a time that is most of `partition`'s time. Here every plan is a row of
float64 tensors and each slot of an iteration is a few elementwise operations
over all rows: the same formulas as `steady.py` (first and last microbatch of
each slot, the max-plus state, a stop at the steady state or once the
increments prove the plan slower than the cutoff), so the same values to
about 1e-12.

Rows are sorted by slots per iteration (longest first), so the plans that
still have a slot at step j are a prefix of the rows; workers are indexed
relative to the iteration's first slot (each row is rotated between
iterations), so slot j's worker is column j mod N in every row; the optimizer
state is kept per layer (steps and copies are equal within a segment, so the
maxima are those per segment), so every row is as wide as the model. The
operations run on one intra-op thread (restored after): a few thousand rows
are too few to share, and on a loaded machine a second thread only waits.

    >>> from rpcompile.ir.costs import CostTable
    >>> from rpcompile.passes.partition.evaluator import Evaluator
    >>> ev = Evaluator(CostTable.from_lists([1.0] * 4, [2.0] * 4), gpus=1, microbatches=2, round_size=2,
    ...                staleness=0, memory=None)
    >>> steady_times(ev, [((3,), 1, (3,)), ((1, 2), 1, (2, 1))])
    [30.0, 30.0]
"""
from __future__ import annotations

import math

import torch

from rpcompile.passes.partition.steady import TOLERANCE
from rpcompile.passes.partition.timing import layer_sums, steady_state_window

_INF = math.inf
_F64 = torch.float64


def steady_times(ev, plans: list[tuple], cutoff: float | None = None) -> list[float]:
    """`steady.steady_time` of each plan (fwd sizes, fused size, bwd sizes) of `ev`'s problem.

    Args:
        ev: an `evaluator.Evaluator` (costs, workers, microbatches, round size, staleness).
        plans: (forward sizes, fused size, backward sizes in execution order) per plan.
        cutoff: a plan proven slower than this gets math.inf (None: every plan is timed); one within
            about 1e-12 of it may go either way, so callers leave a margin (`evaluator.SCREEN`).
    Returns:
        Seconds per plan, in order (math.inf: above `cutoff`).
    """
    if not plans:
        return []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            return _Batch(ev, plans).run(_INF if cutoff is None else cutoff)
    finally:
        torch.set_num_threads(threads)


class _Batch:
    """The rows of a batch: per-step slot data, per-layer optimizer maps, and the recurrence over them."""

    def __init__(self, ev, plans: list[tuple]):
        self.n, self.rr, self.st, self.nl = ev.n_gpu, ev.rr, ev.st, ev.nl
        self.rounds = ev.m // ev.rr
        order = sorted(range(len(plans)), key=lambda p: -(len(plans[p][0]) + len(plans[p][2])))
        self.ids = order  # longest first: the rows with a slot at step j are a prefix
        self._tables(ev, [plans[p] for p in order])

    def _tables(self, ev, plans: list[tuple]) -> None:
        """Per row: stage data [P, S], per-step data [P, K], per-layer stage maps [P, L]."""
        nl, rounds, rows = self.nl, self.rounds, len(plans)
        sides: dict = {}
        for fs, _, bs in plans:
            for key in ((True, fs), (False, bs)):
                if key not in sides:
                    sides[key] = len(sides)
        width = max(1, max(len(k[1]) for k in sides))
        pre, post = [[0.0] * width for _ in sides], [[0.0] * width for _ in sides]
        lo = [[0] * width for _ in sides]
        of_layer = [[0] * nl for _ in sides]
        for (fwd, sizes), k in sides.items():
            for i, (_, a, b, f, bb) in enumerate(ev.forward(sizes) if fwd else ev.backward(sizes)):
                pre[k][i], post[k][i], lo[k][i] = (0.0, f, a) if fwd else (f, bb, a)
                of_layer[k][a:b] = [i] * (b - a)
        pre, post = torch.tensor(pre, dtype=_F64), torch.tensor(post, dtype=_F64)
        lo, of_layer = torch.tensor(lo), torch.tensor(of_layer)
        fi = torch.tensor([sides[(True, fs)] for fs, _, _ in plans])
        bi = torch.tensor([sides[(False, bs)] for _, _, bs in plans])
        fused = {f: sum(layer_sums(ev.costs, nl - f, nl)) for f in {p[1] for p in plans}}  # FB: f + b, no pre
        fb = torch.tensor([fused[f] for _, f, _ in plans], dtype=_F64)[:, None]
        a = torch.tensor([len(fs) for fs, _, _ in plans])[:, None]
        s = a[:, 0] + torch.tensor([len(bs) for _, _, bs in plans]) + 1
        s_max = int(s.max())
        col = torch.arange(s_max).expand(rows, s_max)
        is_f, is_fb = col < a, col == a
        is_b = (col > a) & (col < s[:, None])
        fcol, bcol = col.clamp(max=width - 1), (col - a - 1).clamp(0, width - 1)
        st_pre = torch.where(is_b, pre[bi].gather(1, bcol), 0.0)
        st_post = torch.where(is_f, post[fi].gather(1, fcol), torch.where(is_fb, fb, post[bi].gather(1, bcol)))
        blo = lo[bi].gather(1, bcol)
        prod = of_layer[fi].gather(1, (blo - 1).clamp(min=0))  # the F stage computing a B stage's saved input
        has_prod = is_b & (blo > 0)
        self.per = s * rounds
        k_max = int(self.per.max())
        j = torch.arange(k_max).expand(rows, k_max)
        stage = j % s[:, None]
        g = lambda t: t.gather(1, stage)  # noqa: E731 - the stage column of each step
        q = g(st_pre + st_post)
        start = torch.where(stage == 0, -_INF, 0.0)  # a round's first slot has no previous slot
        self.shift = start - g(st_pre)                # input ready: previous slot's end - recompute (F: pre 0)
        self.first_in = start + torch.where(g(is_b), -_INF, 0.0)  # B: the first start waits for the saved input
        self.q, self.rq = q, q * self.rr
        self.qr = torch.stack([q * self.rr, q], 2)    # added to (first, last) input ends
        self.prod = torch.where(g(has_prod), j - stage + g(prod), k_max)[:, :, None].expand(rows, k_max, 2)
        self.stage, self.last_round = stage, j >= (self.per - s)[:, None]
        self.grad = self.last_round & ~g(is_f)  # steps whose last end is a stage's gradient end (gend)
        self.pad_step = j >= self.per[:, None]
        lay = torch.arange(nl).expand(rows, nl)
        inside = lay < (nl - torch.tensor([f for _, f, _ in plans]))[:, None]
        self.h_f = torch.where(inside, of_layer[fi], a)          # F-or-FB stage holding each layer
        self.h_b = torch.where(inside, a + 1 + of_layer[bi], a)  # B-or-FB stage: completes its gradient
        self.pad_state = torch.cat([torch.zeros(rows, 2 * self.n, dtype=torch.bool), col >= s[:, None],
                                    torch.ones(rows, 1, dtype=torch.bool), torch.zeros(rows, 1 + 2 * nl,
                                                                                       dtype=torch.bool)], 1)
        windows = torch.tensor([steady_state_window(self.n, x, rounds) for x in range(s_max + 1)])
        self.iters = windows[s, 0] if self.st else torch.ones(rows, dtype=torch.long)
        self.window = windows[s, 1]
        self.s_max, self.k_max = s_max, k_max

    def _take(self, keep: torch.Tensor) -> None:
        """Keep only these rows of the per-row tables."""
        for name in ("per", "shift", "first_in", "q", "rq", "qr", "prod", "stage", "last_round", "grad",
                     "pad_step", "h_f", "h_b", "pad_state", "iters", "window"):
            setattr(self, name, getattr(self, name)[keep])

    def run(self, cutoff: float) -> list[float]:
        """Iterate all rows until each is steady, proven above `cutoff`, or through its window."""
        n, rows = self.n, len(self.ids)
        out = [_INF] * rows
        live = torch.arange(rows)
        free = torch.zeros(n, rows, dtype=_F64)   # per worker (relative to the iteration's first slot)
        first = torch.zeros(n, rows, dtype=_F64)  # start of the first compute of the worker's current slot
        uploaded = torch.zeros(rows, self.s_max + 1, dtype=_F64)
        last_step = torch.zeros(rows, 1, dtype=_F64)
        ends_ = torch.full((rows, self.k_max + 1, 2), -_INF, dtype=_F64)  # (first, last) end per step
        up = torch.empty(rows, self.k_max, dtype=_F64)
        copies: list[torch.Tensor] = []
        steps: list[torch.Tensor] = []
        ends: list[torch.Tensor] = []
        before = None
        t = 0
        while rows:
            per = self.per
            src = t - 1 - self.st
            ready = self._ready(copies[src]).gather(1, self.stage) if src >= 0 else torch.zeros(rows, self.k_max,
                                                                                                  dtype=_F64)
            if t * int(per[-1]) < n:  # a slot index below N: no upload waits for the worker's previous slot
                owed = torch.where(t * per[:, None] + torch.arange(self.k_max) >= n, 0.0, -_INF)
            else:
                owed = None
            counts = (per[:, None] > torch.arange(int(per[0]))).sum(0).tolist()
            d = None
            for j, m in enumerate(counts):
                w = j % n
                fw = first[w, :m] if owed is None else first[w, :m] + owed[:m, j]
                u = torch.maximum(ready[:m, j], fw, out=up[:m, j])
                c = torch.maximum(free[w, :m], u)
                sv = ends_[:m].gather(1, self.prod[:m, j:j + 1]).squeeze(1)  # the saved input's (first, last)
                if d is None:
                    d = torch.full((m, 2), -_INF, dtype=_F64)
                gin = torch.maximum(sv, d[:m] + self.shift[:m, j:j + 1])
                torch.maximum(c, torch.maximum(sv[:, 0], d[:m, 0] + self.first_in[:m, j]), out=first[w, :m])
                torch.add(torch.maximum(c, gin[:, 0]), self.q[:m, j], out=ends_[:m, j, 0])
                z = (gin + self.qr[:m, j]).amax(1)
                torch.maximum(z, c + self.rq[:m, j], out=ends_[:m, j, 1])
                free[w, :m] = ends_[:m, j, 1]
                d = ends_[:m, j]
            last = ends_[:, :self.k_max, 1]
            ends.append(last.amax(1))
            uploaded.scatter_reduce_(1, self.stage, up.masked_fill(self.pad_step, -_INF), "amax")
            gend = torch.zeros(rows, self.s_max + 1, dtype=_F64)
            gend.scatter_reduce_(1, torch.where(self.grad, self.stage, self.s_max), last, "amax", include_self=False)
            if self.st == 1 and t >= 1:
                copies.append(self._copies(steps[t - 1], uploaded))
            v = gend.gather(1, self.h_b)
            if t >= 1:
                v = torch.maximum(v, copies[t - 1])
            step = torch.maximum(v.flip(1).cummax(1).values.flip(1), last_step)
            last_step = step[:, :1]
            steps.append(step)
            if self.st == 0:
                for r, p in enumerate(live.tolist()):
                    x = float(ends[0][r])
                    out[p] = x if x <= cutoff else _INF
                break
            rot = (torch.arange(n)[:, None] + per) % n
            free, first = free.gather(0, rot), first.gather(0, rot)
            done = torch.zeros(rows, dtype=torch.bool)
            if t >= 1:
                state = torch.cat([free.T, first.T, uploaded, last_step, copies[t - 1], step], 1)
                if before is not None and t >= 2:
                    inc = state - before
                    lo = inc.masked_fill(self.pad_state, _INF).amin(1)
                    hi = inc.masked_fill(self.pad_state, -_INF).amax(1)
                    valid = t * per >= n
                    slower = valid & (lo > cutoff)
                    steady = valid & ~slower & (hi - lo <= TOLERANCE * ends[t].abs().clamp(min=1e-300))
                    last_inc = (ends[t] - ends[t - 1]).tolist()
                    for r in torch.nonzero(slower | steady).flatten().tolist():
                        out[int(live[r])] = _INF if bool(slower[r]) else last_inc[r]
                    done |= slower | steady
                before = state
            full = (t + 1 >= self.iters) & ~done
            for r in torch.nonzero(full).flatten().tolist():
                wdw = int(self.window[r])
                x = float((ends[t][r] - ends[t - wdw][r]) / wdw)
                out[int(live[r])] = x if x <= cutoff else _INF
            done |= full
            if bool(done.any()):
                keep = torch.nonzero(~done).flatten()
                live, rows = live[keep], len(keep)
                self._take(keep)
                free, first = free[:, keep], first[:, keep]
                uploaded, last_step, ends_, up = uploaded[keep], last_step[keep], ends_[keep], up[keep]
                copies, steps, ends = [x[keep] for x in copies], [x[keep] for x in steps], [x[keep] for x in ends]
                before = None if before is None else before[keep]
            t += 1
        result = [_INF] * len(out)
        for r, p in enumerate(self.ids):
            result[p] = out[r]
        return result

    def _ready(self, copy: torch.Tensor) -> torch.Tensor:
        """Per stage: the latest copy of its layers (the parameter version it uploads)."""
        ready = torch.full((len(copy), self.s_max + 1), -_INF, dtype=_F64)
        ready.scatter_reduce_(1, self.h_f, copy, "amax")
        return ready.scatter_reduce_(1, self.h_b, copy, "amax")

    def _copies(self, step: torch.Tensor, uploaded: torch.Tensor) -> torch.Tensor:
        """copy(u, l) per layer: after its step and every upload of l reading the old version."""
        return torch.maximum(step, torch.maximum(uploaded.gather(1, self.h_f), uploaded.gather(1, self.h_b)))
