"""`steady.steady_time` for many plans at once: one tensor row per plan, slot by slot.

Where the planner's C kernel is built (`native.py`) it times the batch instead; this module is what runs
without a C compiler.

The even family of a model of up to 40 layers is about 3 n^2 plans (n the
layers outside the fused stage), each timed unless a bound rules it out; one
plan at a time that is most of `partition`'s time. Here every plan is a row of
float64 tensors and each slot of an iteration is a few elementwise operations
over all rows: the same formulas as `steady.py` (first and last microbatch of
each slot, the max-plus state, a stop at the steady state or once the
increments prove the plan slower than the cutoff), so the same values to
about 1e-12.

The tables are step-major ([step, row], contiguous), so each step's operands
are whole rows of memory: an operation on a few thousand plans then costs about
what torch charges for any call, and a step is about fifteen of them. Every
row runs every step of the longest plan: a step past a plan's end is made a
no-op (no compute, its input and upload never ready, and its worker's first
start put back), so no step slices out the rows that still have a slot.
Workers are indexed relative to the iteration's first slot (each row is
rotated between iterations), so slot j's worker is j mod N in every row; the
optimizer state is kept per layer (steps and copies are equal within a
segment, so the maxima are those per segment), so every row is as wide as the
model. A row leaves the batch once it is steady, periodic (`steady.py`'s Note:
its state q iterations back, shifted) or proven slower than the cutoff. The
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

from rpcompile.passes.partition.steady import TOLERANCE, periodic_window
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
            cut = _INF if cutoff is None else cutoff
            return _Batch(ev, plans, cut).run(cut)
    finally:
        torch.set_num_threads(threads)


def busiest_worker(times: torch.Tensor, stages: torch.Tensor, gpus: int, rounds: int, round_size: int,
                   staleness: int) -> torch.Tensor:
    """A lower bound on `iteration_time` per plan: the compute of its busiest worker.

    Args:
        times: [P, S] per plan, each stage's compute per microbatch in slot order (recompute included).
        stages: [P] stages per plan (columns beyond are ignored).
    Returns:
        [P] seconds.

    Slot k runs on worker k mod N and holds it for R times its stage's time. With staleness 0 the one
    iteration is at least its busiest worker's slots. With staleness 1 the rotation hands each worker, over
    the P = N / g iterations of `steady_state_window` (g = gcd(N, slots per iteration)), the slots of one
    class k mod g, each once; in the steady state each period then takes at least the heaviest class, so
    an iteration at least that over P. It never falls below the workers' throughput bound M w / N (the
    classes' mean), and is above it when g > 1 and the classes differ: a third of the even family of the
    paper models at R = 16 or at R = 8 and two rounds is proven slower by it alone.

        >>> busiest_worker(torch.tensor([[1.0, 3.0, 1.0, 3.0]]), torch.tensor([4]), 2, 1, 2, 1)  # worker 1: 2 x 3 x R
        tensor([12.])
    """
    per = stages * rounds
    classes = torch.gcd(per, torch.tensor(gpus)) if staleness else torch.full_like(per, gpus)
    col = torch.arange(times.shape[1])
    load = torch.zeros(len(per), gpus, dtype=times.dtype)
    busy = torch.where(col < stages[:, None], times * round_size, 0.0)
    for r in range(rounds):
        load.scatter_add_(1, (r * stages[:, None] + col) % classes[:, None], busy)
    return load.amax(1) * classes / gpus


class _Batch:
    """The rows of a batch: per-step slot data, per-layer optimizer maps, and the recurrence over them."""

    def __init__(self, ev, plans: list[tuple], cutoff: float = _INF):
        self.n, self.rr, self.st, self.nl = ev.n_gpu, ev.rr, ev.st, ev.nl
        self.rounds = ev.m // ev.rr
        self._tables(ev, plans, cutoff)

    def _tables(self, ev, plans: list[tuple], cutoff: float) -> None:
        """Per row: stage data [P, S] and per-layer stage maps [P, L]; per step: slot data [K, P]. Rows whose
        busiest worker alone exceeds `cutoff` (`busiest_worker`) are left out: `self.ids` are the
        plans kept."""
        nl, rounds = self.nl, self.rounds
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
        fl = torch.tensor([f for _, f, _ in plans])
        s_max = int(s.max())
        col = torch.arange(s_max).expand(len(plans), s_max)
        is_f, is_fb = col < a, col == a
        is_b = (col > a) & (col < s[:, None])
        bcol = (col - a - 1).clamp(0, width - 1)
        st_pre = torch.where(is_b, pre[bi].gather(1, bcol), 0.0)
        st_post = torch.where(is_f, post[fi].gather(1, col.clamp(max=width - 1)),
                              torch.where(is_fb, fb, post[bi].gather(1, bcol)))
        keep = busiest_worker(st_pre + st_post, s, self.n, rounds, self.rr, self.st) <= cutoff
        if not bool(keep.all()):
            keep = torch.nonzero(keep).flatten()
            fi, bi, a, s, fl, is_f, is_fb, is_b, bcol, st_pre, st_post = (
                x[keep] for x in (fi, bi, a, s, fl, is_f, is_fb, is_b, bcol, st_pre, st_post))
            self.ids = keep.tolist()
        else:
            self.ids = list(range(len(plans)))
        rows, self.total = len(self.ids), len(plans)
        if not rows:
            return
        s_max = int(s.max())
        col, is_f, is_fb, is_b, bcol = (x[:, :s_max] for x in (col[keep] if rows < len(plans) else col, is_f,
                                                                    is_fb, is_b, bcol))
        st_pre, st_post = st_pre[:, :s_max], st_post[:, :s_max]
        blo = lo[bi].gather(1, bcol)
        prod = of_layer[fi].gather(1, (blo - 1).clamp(min=0))  # the F stage computing a B stage's saved input
        has_prod = is_b & (blo > 0)
        self.per = s * rounds
        k_max = int(self.per.max())
        jt = torch.arange(k_max)[:, None]
        stage = jt % s  # [K, P]: step-major from here on, so each step's operand is one row of memory
        pad = jt >= self.per  # steps past the row's last slot: no-ops (see the module doc)
        if rounds == 1:  # step j is stage j: the stage tables are the step tables
            g = lambda t: t.T.contiguous()  # noqa: E731
        else:
            g = lambda t: t.T.contiguous().gather(0, stage)  # noqa: E731 - the stage row of each step
        q = g(st_pre + st_post).masked_fill(pad, -_INF)  # a no-op step ends at -inf
        start = torch.where((stage == 0) | pad, -_INF, 0.0)  # a round's first slot has no previous slot
        self.shift = start - g(st_pre)  # input ready: previous slot's end - recompute (F: pre 0)
        self.is_b = g(is_b)  # B: the first start waits for the saved input alone (the recompute needs no more)
        self.q, self.rq = q, q * self.rr
        prod_step = torch.where(g(has_prod) & ~pad, jt - stage + g(prod), k_max)  # k_max: a row of -inf
        self.prod = prod_step[:, None, :].expand(k_max, 2, rows).contiguous()
        self.stage, self.pad = stage, pad
        self.up_at = torch.where(pad, s_max, stage)  # a no-op step's upload goes to the spare column s_max
        grad = (jt >= self.per - s) & ~g(is_f) & ~pad  # steps whose last end is a stage's gradient end (gend)
        self.grad_at = torch.where(grad, stage, s_max)
        lay = torch.arange(nl).expand(rows, nl)
        inside = lay < (nl - fl)[:, None]
        self.h_f = torch.where(inside, of_layer[fi], a)          # F-or-FB stage holding each layer
        self.h_b = torch.where(inside, a + 1 + of_layer[bi], a)  # B-or-FB stage: completes its gradient
        self.pad_state = torch.cat([torch.zeros(rows, 2 * self.n, dtype=torch.bool), col >= s[:, None],
                                    torch.ones(rows, 1, dtype=torch.bool), torch.zeros(rows, 1 + 2 * nl,
                                                                                       dtype=torch.bool)], 1)
        windows = torch.tensor([steady_state_window(self.n, x, rounds) for x in range(s_max + 1)])
        self.iters = windows[s, 0] if self.st else torch.ones(rows, dtype=torch.long)
        self.window = windows[s, 1]
        self.s_max, self.k_max = s_max, k_max
        self._steps()

    _ROW_MAJOR = ("per", "h_f", "h_b", "pad_state", "iters", "window")
    _STEP_MAJOR = ("shift", "is_b", "q", "rq", "prod", "stage", "pad", "up_at", "grad_at")

    def _steps(self) -> None:
        """Each step's operands as a list, one view per step, made once (indexing a tensor costs a call)."""
        self.steps_ = {name: list(getattr(self, name).split(1, 0)) if name == "prod" else
                       list(getattr(self, name).unbind(0)) for name in ("shift", "is_b", "q", "rq",
                                                                         "prod", "pad")}
        self.has_pad = self.pad.any(1).tolist()

    def _take(self, keep: torch.Tensor) -> None:
        """Keep only these rows of the tables, and only the steps the longest of them has."""
        for name in self._ROW_MAJOR:
            setattr(self, name, getattr(self, name)[keep])
        k = int(self.per.max()) if len(keep) else 0
        for name in self._STEP_MAJOR:
            setattr(self, name, getattr(self, name)[:k, ..., keep])
        self.prod = self.prod.clamp(max=k)  # the spare row of -inf moves to k (a producer precedes its B)
        self.k_max = k
        self._steps()

    def run(self, cutoff: float) -> list[float]:
        """Iterate all rows until each is steady or periodic, proven above `cutoff`, or through its window."""
        out = [_INF] * self.total
        if not self.ids:
            return out
        n, rows, k_max = self.n, len(self.ids), self.k_max
        live = torch.tensor(self.ids, dtype=torch.long)
        free = list(torch.zeros(n, rows, dtype=_F64).unbind(0))   # per worker (relative to the iteration's
        first = list(torch.zeros(n, rows, dtype=_F64).unbind(0))  # first slot); the start of the first
        uploaded = torch.zeros(self.s_max + 1, rows, dtype=_F64)  # compute of the worker's current slot;
        # uploaded: the latest upload per stage [stage, row]
        last_step = torch.zeros(rows, 1, dtype=_F64)
        ends_ = torch.full((k_max + 1, 2, rows), -_INF, dtype=_F64)  # (first, last) end per step; row
        up = torch.empty(k_max, rows, dtype=_F64)                     # k_max stays -inf (no producer)
        copies: list[torch.Tensor] = []
        steps: list[torch.Tensor] = []
        ends: list[torch.Tensor] = []
        states: dict[int, torch.Tensor] = {}
        t = 0
        while rows:
            per, tab = self.per, self.steps_
            src = t - 1 - self.st
            if src >= 0:
                ready = self._ready(copies[src]).T.gather(0, self.stage)
            else:
                ready = torch.zeros(k_max, rows, dtype=_F64)
            if t * int(per.min()) < n:  # a slot index below N: no upload waits for the worker's previous slot
                owed = torch.where(t * per + torch.arange(k_max)[:, None] >= n, 0.0, -_INF).unbind(0)
            else:
                owed = None
            ready, ups, e01 = ready.unbind(0), up.unbind(0), ends_.unbind(0)
            e0s, e1s = ends_[:, 0].unbind(0), ends_[:, 1].unbind(0)
            d = torch.full((2, rows), -_INF, dtype=_F64)
            for j in range(k_max):
                w = j % n
                fw = first[w] if owed is None else first[w] + owed[j]
                u = torch.maximum(ready[j], fw, out=ups[j])
                c = torch.maximum(free[w], u)
                sv = ends_.gather(0, tab["prod"][j])[0]  # the saved input's (first, last) end
                g0, g1 = torch.maximum(sv, d + tab["shift"][j]).unbind(0)  # when m's input is ready, m = 0, R-1
                m0 = torch.maximum(c, g0)
                torch.add(m0, tab["q"][j], out=e0s[j])
                e1 = torch.maximum(m0 + tab["rq"][j], g1 + tab["q"][j], out=e1s[j])  # max(c, g0) + Rq: c + Rq too
                nf = torch.maximum(c, torch.where(tab["is_b"][j], sv[0], g0))  # B: its recompute waits for sv alone
                if self.has_pad[j]:  # a no-op step leaves its worker as it was
                    free[w] = torch.where(tab["pad"][j], free[w], e1)
                    first[w] = torch.where(tab["pad"][j], first[w], nf)
                else:
                    free[w], first[w] = e1, nf
                d = e01[j]
            last = ends_[:k_max, 1]
            ends.append(last.amax(0))
            uploaded.scatter_reduce_(0, self.up_at, up, "amax")
            gend = torch.zeros(self.s_max + 1, rows, dtype=_F64)
            gend = gend.scatter_reduce_(0, self.grad_at, last, "amax", include_self=False).T
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
            free = list(torch.stack(free).gather(0, rot).unbind(0))
            first = list(torch.stack(first).gather(0, rot).unbind(0))
            read = copies[t - 1] if t >= 1 else torch.zeros_like(step)  # iteration 1 reads no copy: zeros
            states[t] = torch.cat([torch.stack(free, 1), torch.stack(first, 1), uploaded.T, last_step, read, step], 1)
            done = self._settled(t, states, ends, cutoff, live, out)
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
                k_max = self.k_max
                free, first = [x[keep] for x in free], [x[keep] for x in first]
                uploaded, last_step, up = uploaded[:, keep], last_step[keep], up[:k_max, keep]
                ends_ = torch.cat([ends_[:k_max, :, keep], torch.full((1, 2, rows), -_INF, dtype=_F64)])
                copies, steps, ends = [x[keep] for x in copies], [x[keep] for x in steps], [x[keep] for x in ends]
                states = {u: x[keep] for u, x in states.items()}
            t += 1
        return out

    def _settled(self, t: int, states: dict, ends: list, cutoff: float, live: torch.Tensor,
                 out: list[float]) -> torch.Tensor:
        """Rows whose result is known after iteration t (`steady.py`'s Notes): proven above `cutoff` by the
        increments over q iterations (`steady.window_floor`), or repeating every q iterations, q = 1, 2, ...
        (the window extended by `steady.periodic_window`); their results go to `out`. Returns the
        mask of those rows."""
        per, state = self.per, states[t]
        done = torch.zeros(len(per), dtype=torch.bool)
        scale = TOLERANCE * ends[t].abs().clamp(min=1e-300)
        first = self.iters - 1 - self.window  # `steady.window_floor`, for every row at once
        known = torch.where(t > first, ends[t] - torch.stack(ends, 1).gather(1, first.clamp(max=t)[:, None])[:, 0],
                            0.0)
        m = self.iters - 1 - first.clamp(min=t)
        for q in range(1, t + 1):
            valid = ((t - q + 1) * per >= self.n) & ~done  # iterations t-q+1..t all the same map
            if not bool(valid.any()):
                break
            inc = state - states[t - q]
            lo = inc.masked_fill(self.pad_state, _INF).amin(1)
            hi = inc.masked_fill(self.pad_state, -_INF).amax(1)
            lo1 = lo if q == 1 else lo1
            slower = valid & ((known + (m // q) * lo + (m % q) * lo1) / self.window > cutoff)
            for r in torch.nonzero(slower).flatten().tolist():
                out[int(live[r])] = _INF
            done |= slower
            valid &= ~slower
            rep = valid & (hi - lo <= scale)
            if bool(rep.any()):  # few rows: each extended by `periodic_window` itself
                idx = torch.nonzero(rep).flatten()
                history = torch.stack(ends, 1)[idx].tolist()
                for r, e, inc_q in zip(idx.tolist(), history, ((lo + hi) / 2)[idx].tolist()):
                    x = periodic_window(e, q, inc_q, int(self.iters[r]), int(self.window[r]))
                    out[int(live[r])] = x if x <= cutoff else _INF
                done |= rep
        return done

    def _ready(self, copy: torch.Tensor) -> torch.Tensor:
        """Per stage: the latest copy of its layers (the parameter version it uploads)."""
        ready = torch.full((len(copy), self.s_max + 1), -_INF, dtype=_F64)
        ready.scatter_reduce_(1, self.h_f, copy, "amax")
        return ready.scatter_reduce_(1, self.h_b, copy, "amax")

    def _copies(self, step: torch.Tensor, uploaded: torch.Tensor) -> torch.Tensor:
        """copy(u, l) per layer: after its step and every upload of l reading the old version (`uploaded`:
        [stage, row])."""
        up = uploaded.T
        return torch.maximum(step, torch.maximum(up.gather(1, self.h_f), up.gather(1, self.h_b)))
