"""Gradient statistics of `HostState` (a mixin; see runtime/host/optimizer.py): gradients landing,
each iteration's reductions, and the global barrier that clipping and loss scaling need.

`accumulate_grad` lands one device's gradient in the group's fp32 (or bf16) buffer (with the kernels, taking its
sum of squares and non-finite flag in the same pass); `grads_complete(l)` reduces group l's gradient
(unscale, inf check, per-parameter norms); the last group of an iteration completes its `_IterStats`:
the global norm, the clip coefficient, and the dynamic loss scale's backoff or growth. `step`
(runtime/host/optimizer.py) waits for those statistics and applies them.

Note:
    Global statistics. Clipping by global norm (`max_grad_norm`) and dynamic
    loss scaling need every layer's gradient of the iteration, so with either
    on, `step(l)` of iteration u waits until every trainable group has called
    `grads_complete` for u (each call reduces its group: unscale, inf check,
    per-parameter norms; with the kernels nothing, the landing pass took them), so
    the barrier itself is cheap. With staleness 1 this
    wait is hidden behind the next iteration's compute (iteration u+1 reads
    weights that do not depend on step u); with staleness 0 it is a barrier
    between the last backward and the first optimizer step. Without them no
    step waits for another layer.

Note:
    The dynamic loss scale is a function of the run, never of thread timing. Iteration t
    multiplies its loss by the scale that the overflow checks of iterations <= t - 1 - lag
    leave, lag being the staleness: as stale as the weights it reads (staleness 0: torch
    GradScaler's rule, t uses t-1's update; staleness 1: t uses t-2's, the last check made
    before t's forward can start, since t reads the weights made from t-2's gradient).
    `begin_iteration` waits for that check (the runtime waits for it abortably first), and
    `verdicts` keeps each iteration's scale, skip and resulting scale; `state_dict` saves the
    last two, so a resumed run uses the scales the uninterrupted one would.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rpcompile.runtime.host.lean import grad_key, land as land_bf16, to_float32
from rpcompile.runtime.host.kernels import KINDS

__all__ = ["GradStats", "NORMS_KEPT", "ScaleVerdict"]


@dataclass(frozen=True, slots=True)
class ScaleVerdict:
    """The dynamic loss scale's decision on one iteration (its overflow check)."""

    used: float  # the scale the iteration's loss was multiplied by
    skipped: bool  # an inf/nan gradient: the iteration's update was skipped
    after: float  # the scale this check leaves (backed off, grown or unchanged)


@dataclass(slots=True)
class _IterStats:
    """Reductions of one iteration's gradients, filled group by group."""

    pending: int  # trainable groups that have not called grads_complete yet
    norms: dict[str, Tensor] = field(default_factory=dict)  # per-parameter L2 norm of the unscaled grad (torch)
    sq: dict[str, float] = field(default_factory=dict)  # per-parameter sum of squares of the scaled grad (kernels)
    scale: float | None = None  # the loss scale of the iteration's gradients
    found_inf: bool = False  # an inf/nan gradient anywhere (dynamic loss scaling only)
    coef: Tensor | None = None  # clip coefficient min(1, max_norm / (norm + 1e-6)); None = no clipping
    coef_value: float | None = None  # float(coef), read once: the kernels' steps take it without a torch op
    norm: Tensor | None = None  # global L2 norm, set once pending == 0
    stepped: int = 0  # groups that have stepped this iteration
    done: bool = False  # the global statistics are final (`_finish` ran)


AVERAGE_WRITE = 0xFFFFFFFF  # the write index of a bf16 gradient's data-parallel average in `grad_key`
NORMS_KEPT = 16  # HostState.norms holds the global gradient norms of this many recent iterations


def _flat(t: Tensor) -> Tensor:
    """t as 1-D (itself when it is: no new view; see `step_factor` on torch operations between passes)."""
    return t if t.dim() == 1 else t.view(-1)


def _flat_cpu(grad: Tensor) -> Tensor:
    """A gradient as the kernels take it: on the CPU, contiguous, 1-D, of a dtype they read (else float32)."""
    if grad.device.type != "cpu" or not grad.is_contiguous():
        grad = grad.to("cpu").contiguous()
    return _flat(grad if grad.dtype in KINDS else grad.float())


def step_factor(unscale: float | None, coef: float | None) -> float:
    """The one float32 factor a step multiplies its gradients by: 1 / unscale (a loss scale not yet divided out;
    None or 1: none), times the clip coefficient (a float32 value; None: no clipping), each product rounded to
    float32 as eager torch's two float32 tensor multiplications round it. Python floats, not torch operations:
    a step runs this between two passes over memory that leave torch's code and data out of the cache, where its
    few scalar operations took 80 us a group.

    >>> step_factor(None, None), step_factor(3.0, None) == float(torch.tensor(1 / 3.0, dtype=torch.float32))
    (1.0, True)
    """
    factor = 1.0
    if unscale is not None and unscale != 1.0:
        factor = to_float32(1.0 / unscale)  # float32(1) * float32(1 / unscale)
    if coef is not None:
        factor = to_float32(factor * coef)  # exact in float64 (two float32 values), then rounded once
    return factor


class GradStats:
    """The gradient side of `HostState`: landing, per-iteration reductions, the global norm and loss scale.

    A mixin with no state of its own: `HostState.__init__` sets the buffers, locks and counters it uses.
    """

    @property
    def needs_global(self) -> bool:
        """True if `step` waits for every group's gradient (clipping or dynamic loss scaling)."""
        return self.config.max_grad_norm is not None or self.scaler is not None

    # -- the executor's calls: gradients -------------------------------------------------------
    def grad_of(self, name: str) -> Tensor | None:
        """The gradient accumulated for `name` this iteration (the buffer itself), None if none yet."""
        l = self.group_of.get(name := self.canonical(name))
        return self.grad[name] if l is not None and name in self._fresh[l] else None

    def begin_iteration(self, lag: int = 0) -> float:
        """Record the start of the next iteration t; returns the factor its loss must be multiplied by.

        With a dynamic loss scale: the scale left by the overflow checks of iterations <= t - 1 - lag
        (lag = the staleness; see the module Note), waiting up to `timeout_s` for that check.

        Example:
            >>> s.begin_iteration(lag=1)   # iteration 1 at staleness 1: the initial scale   # doctest: +SKIP
            65536.0
        """
        with self._cond:
            t = self._begun
            if self.scaler is not None:
                u = t - 1 - lag  # the last iteration whose check decides t's scale
                known = lambda: u in self.verdicts or u < self._base or not self._n_trainable  # noqa: E731
                if not self._cond.wait_for(known, timeout=self.timeout_s):
                    raise RuntimeError(f"waited {self.timeout_s}s for the overflow check of iteration {u}, which "
                                       f"fixes the loss scale of iteration {t}")
                self._scale_of[t] = self.verdicts[u].after if u in self.verdicts else self._base_scale
            self._begun += 1
            return self._scale_of[t] if self.scaler is not None else 1.0 if self.loss_scale is None \
                else self.loss_scale

    def accumulate_grad(self, name: str, grad: Tensor) -> bool:
        """Add `grad` (one device's accumulated gradient of one round, any dtype) into the gradient buffer.

        A bf16 buffer (`grad_dtype=torch.bfloat16`) takes the float32 sum rounded stochastically
        (runtime/host/lean.py: its own key per group, iteration and write of the parameter, so each round
        draws fresh bits; round to nearest would drop a contribution below half an ulp of the running
        sum, and every round adds one). A first write of a bf16 gradient is stored exactly (no rounding),
        so a layer whose gradient lands once per iteration keeps the device's values. The statistics are
        the stored values', taken in the same pass (C++ kernels or runtime/host/lean.py's `land`).

        Returns:
            False if the gradient accumulated for `name` so far has an inf or NaN (the kernels take
            that, and the sum of squares, in the pass that writes the buffer).
        """
        name = self.canonical(name)
        l = self.group_of.get(name)
        if l is None:
            raise KeyError(f"accumulate_grad({name!r}): not a trainable parameter")
        with self._locks[l]:
            if self._done[l] != self._stepped[l]:
                raise RuntimeError(f"R4 violated: gradient write to {name!r} (group {l}) after "
                                   f"grads_complete({l}) and before step({l})")
            buf, first = self.grad[name], name not in self._fresh[l]
            if buf.dtype == torch.bfloat16:
                self._writes[name] = write = 0 if first else self._writes[name] + 1
                key = grad_key(self.flat.seed, l, self._stepped[l], write)
                src = _flat_cpu(grad)
                land = self.kernels.land if self.kernels is not None else land_bf16
                self._sq[name], bad = land(_flat(buf), src, add=not first, key=key, offset=self.layout.master[name])
                self._bad[name] = bad
            elif self.kernels is not None:
                self._sq[name], bad = self.kernels.land(buf, _flat_cpu(grad), add=not first)
                self._bad[name] = bad
            else:
                if first:  # the first write of the iteration overwrites: the buffer is logically zero
                    buf.copy_(grad.to(buf.device))
                else:
                    buf.add_(grad.to(buf.device))
                bad = not bool(torch.isfinite(buf).all())
                if self._landed:  # sharded state without the kernels: the step unscales; these statistics
                    self._sq[name], self._bad[name] = float(buf.double().square().sum()), bad  # (a reducer's replace)
            self._fresh[l].add(name)
            self.on_grad(l)  # hook: count the write (data parallel: the last one starts l's all-reduce)
            return not bad

    def grads_complete(self, layer: int) -> None:
        """Declare group `layer`'s gradient of this iteration complete (R3) and reduce it.

        Unscales it (loss scaling), checks inf/nan (dynamic scaling) and takes its
        per-parameter norms (clipping); the last group completes the iteration's
        global statistics. `step(layer)` calls it itself if the executor has not.
        """
        self._complete(layer, strict=True)

    def grads_complete_all(self) -> None:
        """`grads_complete` of the oldest iteration not fully stepped, for each group that has not stepped it.

        For an executor whose first STEP of an iteration waits for all its gradient
        downloads: calling it before every STEP is safe (groups already stepped are left alone).
        """
        u = min((s for s, g in zip(self._stepped, self.groups) if g), default=0)
        for l in reversed(range(len(self.groups))):
            self._complete(l, strict=False, only=u)

    def average_grads(self, layer: int, world: int, all_reduce: Callable[[Tensor], None]) -> None:
        """Average group `layer`'s gradient over `world` processes, in place (data parallel, runtime/distributed.py).

        `all_reduce(flat)` sums the group's flat fp32 gradient buffer over the processes in place (always a
        float32 tensor: see bf16 below); one pass then divides it by `world` and (with the kernels) takes
        the statistics of the average that `grads_complete` uses: no copy in or out, no second statistics
        pass. Call it after the group's last gradient write of the iteration and before
        `grads_complete(layer)` returns (its `on_complete` hook waits for this call, holding the group's
        lock: nothing else touches the group meanwhile).

        bf16 gradients (`grad_dtype=torch.bfloat16`) are widened to a float32 copy of the group's buffer
        for the all-reduce (summing in bf16 would round each partial sum to nearest), and the average is
        stored back rounded stochastically with a key of its own (`grad_key`'s write `AVERAGE_WRITE`),
        taking the statistics in the same pass: every process gets the same sum, so the same bits.

        Example:
            >>> s.average_grads(0, 2, lambda flat: dist.all_reduce(flat))   # doctest: +SKIP
        """
        if self.flat.grads[layer].dtype == torch.bfloat16:
            wide = self.flat.grads[layer].float()
            all_reduce(wide)
            key = grad_key(self.flat.seed, layer, self._stepped[layer], AVERAGE_WRITE)
            land = self.kernels.land if self.kernels is not None else land_bf16
            for n in self.groups[layer]:
                g, off = self.grad[n].view(-1), self.layout.master[n]
                self._sq[n], self._bad[n] = land(g, wide[off:off + g.numel()], add=False, divisor=world, key=key,
                                                 offset=off)
            return
        all_reduce(self.flat.grads[layer])
        if self.kernels is None:
            self.flat.grads[layer].div_(world)
            return
        for n in self.groups[layer]:
            g = self.grad[n].view(-1)
            self._sq[n], self._bad[n] = self.kernels.land(g, g, add=False, divisor=world)

    def reduce_scatter_grads(self, layer: int, world: int, reduce_scatter: Callable[[Tensor], None]) -> tuple[float, bool]:
        """Average this rank's slice of group `layer`'s gradient over `world` processes (sharded state).

        `reduce_scatter(flat)` sums the group's flat float32 gradient over the processes into this rank's
        owned slice (`FlatGroups.owned`; runtime/host/shard_comm.py), leaving the rest of it as it was; one
        pass then divides the slice by `world` and takes the statistics of the average over the owned part
        of each parameter written this iteration (bf16 gradients: summed in a float32 copy and stored back
        rounded stochastically, with `average_grads`' key at the same element offsets). The rest of the
        buffer is never read again this iteration (the step covers the owned slice).

        Returns:
            (sum of squares, non-finite) of this rank's part of the average: the data-parallel reducer
            sums the ranks' parts into the iteration's global statistics (`on_totals`).
        """
        buf, (lo, hi) = self.flat.grads[layer], self.flat.owned[layer]
        wide = buf.float() if buf.dtype == torch.bfloat16 else buf
        reduce_scatter(wide)
        key = grad_key(self.flat.seed, layer, self._stepped[layer], AVERAGE_WRITE)
        total, bad = [], False
        for n in self.groups[layer]:
            off = self.layout.master[n]
            a, b = self.flat.part(n)
            self._sq[n], self._bad[n] = 0.0, False
            if a >= b:
                continue
            dst, src = buf[off + a:off + b], wide[off + a:off + b]
            if buf.dtype == torch.bfloat16:
                land = self.kernels.land if self.kernels is not None else land_bf16
                self._sq[n], self._bad[n] = land(dst, src, add=False, divisor=world, key=key, offset=off + a)
            elif self.kernels is not None:
                self._sq[n], self._bad[n] = self.kernels.land(dst, src, add=False, divisor=world)
            else:
                dst.div_(world)
                self._sq[n] = float(dst.double().square().sum())
                self._bad[n] = not bool(torch.isfinite(dst).all())
            if n in self._fresh[layer]:
                total.append(self._sq[n])
                bad = bad or self._bad[n]
        return math.fsum(total), bad

    def discard_grads(self) -> None:
        """Drop all gradients written since each group's last step (failure recovery, no step running).

        A re-run of the iteration keeps the scale `begin_iteration` recorded (do not call it again).
        """
        for l, lock in enumerate(self._locks):
            with lock:
                self._fresh[l].clear()
                self._done[l] = self._stepped[l]
        with self._cond:
            self._stats.clear()

    def _complete(self, layer: int, strict: bool, only: int | None = None) -> None:
        """grads_complete(layer); if not strict, a no-op when already called (or the group is not at `only`)."""
        group = self.groups[layer]
        with self._locks[layer]:
            if only is not None and self._stepped[layer] != only:
                return
            if self._done[layer] != self._stepped[layer]:
                if strict:
                    raise RuntimeError(f"grads_complete({layer}) called twice before step({layer})")
                return
            u, self._done[layer] = self._done[layer], self._done[layer] + 1
            if not group:
                return
            self.on_complete(layer)  # hook: data parallel waits for l's gradient averaged over processes
            scale = self._scale_of.get(u, self.loss_scale)  # set by begin_iteration before u's backward
            names = [n for n in group if n in self._fresh[layer]]
            grads = [self.grad[n] for n in names]
            found = torch.zeros(1)
            if self._landed:  # the landing pass (or `average_grads`) took the statistics; the step
                self._unscale[layer] = scale  # unscales
                sq = {n: self._sq[n] for n in names}
                found += any(self._bad[n] for n in names)
            elif grads and scale is not None and self.scaler is not None:
                inv = torch.tensor([scale], dtype=torch.float64).reciprocal().float()
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
            elif grads and scale is not None and scale != 1.0:
                torch._foreach_mul_(grads, 1.0 / scale)
            norms = (torch._foreach_norm(grads, 2.0) if grads and self.config.max_grad_norm is not None
                     and not self._landed else [])
        if not self.needs_global:
            return
        with self._cond:
            st = self._stats.setdefault(u, _IterStats(pending=self._n_trainable))
            st.norms.update(zip(names, norms))
            st.sq.update(sq if self._landed else {})
            st.scale = scale
            st.found_inf |= bool(found.item())
            st.pending -= 1
            last = st.pending == 0  # this call completes the iteration's statistics
            if last and self.on_totals is None:
                self._finish(u, st)
                self._cond.notify_all()
        if last and self.on_totals is not None:  # sharded state: every rank's part of the statistics
            total, bad = self.on_totals(u)  # (waits for the reducer's exchange, without holding _cond)
            with self._cond:
                st.found_inf = bad
                self._finish(u, st, total)
                self._cond.notify_all()

    def _finish(self, u: int, st: _IterStats, total: float | None = None) -> None:
        """Global norm, clip coefficient and loss-scale update of iteration u (holding _cond); `total`: the scaled
        sum of squares over every rank (sharded state), else taken from `st`."""
        if self.config.max_grad_norm is not None:
            order = [st.norms[n] for n in self.master if n in st.norms]  # the order of `params`, as eager
            st.norm = torch.linalg.vector_norm(torch.stack(order), 2.0) if order else torch.tensor(0.0)
            if self._landed:  # fp64 sum of the scaled squares (in a fixed order), then unscaled
                if total is None:
                    total = math.fsum(st.sq[n] for n in self.master if n in st.sq)
                st.norm = torch.tensor(math.sqrt(total) / (st.scale or 1.0), dtype=torch.float32)
            st.coef = torch.clamp(self.config.max_grad_norm / (st.norm + 1e-6), max=1.0)
            st.coef_value = float(st.coef)
            self.norms[u] = float(st.norm)
            for old in [k for k in self.norms if k <= u - NORMS_KEPT]:
                del self.norms[old]
        if self.scaler is not None:  # the checks run in iteration order (u + 1's steps wait for u's)
            used = self._scale_of.get(u, self.loss_scale)
            if st.found_inf:  # several in-flight iterations at one scale back off only once
                self.loss_scale = min(self.loss_scale, used * self.scaler.backoff_factor)
                self._good, self.skipped = 0, [*self.skipped, u]
            else:
                self._good += 1
                if self._good >= self.scaler.growth_interval:
                    self.loss_scale, self._good = self.loss_scale * self.scaler.growth_factor, 0
            self.verdicts[u] = ScaleVerdict(used, st.found_inf, self.loss_scale)
            for old in [k for k in self.verdicts if k <= u - NORMS_KEPT]:
                del self.verdicts[old]
        st.done = True

    def global_norm(self, iteration: int | None = None, timeout_s: float | None = None) -> Tensor:
        """The unscaled global L2 gradient norm of `iteration` (default: the oldest not stepped).

        Blocks until every trainable group called `grads_complete` for it (needs `max_grad_norm`).
        """
        if self.config.max_grad_norm is None:
            raise RuntimeError("global_norm() needs the optimizer's max_grad_norm")
        u = min(self._stepped[l] for l, g in enumerate(self.groups) if g) if iteration is None else iteration
        return self._wait(u, timeout_s).norm

    def _wait(self, u: int, timeout_s: float | None = None) -> _IterStats:
        """Wait for the global statistics of iteration u."""
        with self._cond:
            ok = self._cond.wait_for(lambda: u in self._stats and self._stats[u].done,
                                     timeout=self.timeout_s if timeout_s is None else timeout_s)
            if not ok:
                missing = [l for l, g in enumerate(self.groups) if g and self._done[l] <= u]
                raise RuntimeError(f"waited {self.timeout_s}s for the global gradient statistics of "
                                   f"iteration {u}: groups {missing} have not called grads_complete()")
            return self._stats[u]
