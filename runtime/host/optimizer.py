"""Host-side model state and the CPU optimizer worker (DESIGN.md ideas 1, 6, 7).

Host memory is the home of all model state. Per parameter `HostState` keeps a
compute copy in the training dtype (what uploads read), and for a trainable
parameter an fp32 master, optimizer state and an fp32 gradient buffer: views into
one flat buffer each per layer group (`rpcompile.ir.host_layout`, runtime/host/flat.py).
The optimizer works per layer group: `groups[l]` holds the parameters that
STEP "O.l" updates and COPY "C.l" refreshes. A tied parameter has one entry and
belongs to the group of its LOWEST owner layer: backward runs layers in
descending order, so that layer's gradient download completes the gradient last.

Note:
    The executor enforces R1-R5 (`copy(l)` after the uploads that read the old
    version; `step(l)` after all gradient downloads of group l, also those of
    other owners of a tied parameter). `HostState` checks R4 (a write to a group
    between `grads_complete` and `step` raises) and makes each call atomic with
    one lock per group: worker threads and the optimizer thread may call it.

Note:
    Determinism. Bit-identical results need a fixed `accumulate_grad` order (the
    program's). `step` then equals eager torch (the same torch optimizer per
    group); buffers are zeroed logically (the next first write overwrites).

Note:
    Memory speed (`impl="fused"`, the default, with the C++ kernels of runtime/host/kernels.py):
    `accumulate_grad` writes the fp32 gradient and, in the same pass, its sum of
    squares and non-finite flag; `step(l)` is one pass per group run over the flat
    buffers (unscale and clip as one factor, AdamW or SGD); `copy(l)` one cast pass
    (or none: `step(l, copy=True)` writes the compute copies in the update's pass).
    The values are torch's eager single-tensor ones except that sqrt is correctly
    rounded (torch's CPU sqrt is not always) and the global norm is summed in fp64:
    within a few float32 ulps. `impl="foreach"/"single"` run torch's optimizers on
    the same views and give eager's bits.

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
"""
from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rpcompile.ir.host_layout import host_layout
from rpcompile.ir.optim import SGD, AdamW, DynamicLossScale, decay_names, make_torch_optimizer
from rpcompile.runtime.host.flat import FlatGroups, moment_names
from rpcompile.runtime.host.kernels import KINDS, load_kernels
from rpcompile.runtime.host.layout import host_blocks, view
from rpcompile.runtime.host.pinned import pinning
from rpcompile.runtime.stage.runner import tracked_buffers
from rpcompile.runtime.host.state_io import StateIO

__all__ = ["HostState", "make_torch_optimizer"]


@dataclass(slots=True)
class _IterStats:
    """Reductions of one iteration's gradients, filled group by group."""

    pending: int  # trainable groups that have not called grads_complete yet
    norms: dict[str, Tensor] = field(default_factory=dict)  # per-parameter L2 norm of the unscaled grad (torch)
    sq: dict[str, float] = field(default_factory=dict)  # per-parameter sum of squares of the scaled grad (kernels)
    scale: float | None = None  # the loss scale of the iteration's gradients
    found_inf: bool = False  # an inf/nan gradient anywhere (dynamic loss scaling only)
    coef: Tensor | None = None  # clip coefficient min(1, max_norm / (norm + 1e-6)); None = no clipping
    norm: Tensor | None = None  # global L2 norm, set once pending == 0
    stepped: int = 0  # groups that have stepped this iteration


NORMS_KEPT = 16  # HostState.norms holds the global gradient norms of this many recent iterations


def _no_hook(layer: int) -> None:
    """The default data-parallel hook: nothing to do."""


class HostState(StateIO):
    """Compute copies, fp32 masters, optimizer state and gradient buffers on the host.

    Args:
        params: canonical name -> tensor (e.g. dict(model.named_parameters()) without
            aliases); `requires_grad=False` marks a frozen parameter (compute copy only).
        owners: canonical name -> indices of the layers that use it (several if tied).
            A parameter no layer uses is treated as frozen.
        num_layers: number of layers (groups).
        optimizer: `rpcompile.AdamW` or `rpcompile.SGD`; its `decay` names canonical parameters
            (or tied aliases of them) and is resolved here: `self.config.decay` is the set of names.
        dtype: training dtype of the compute copies; None keeps each parameter's dtype.
        tied: alias -> canonical name; aliases are accepted by `read`/`accumulate_grad`.
        loss_scale: None, a constant float, or a `DynamicLossScale` (fp16).
        pin_memory: pin the compute-copy blocks at their exact size (only if CUDA is available), or a
            `runtime.host.pinned.PinnedAllocator` to pin them with.
        timeout_s: how long `step` waits for the global statistics before raising.
        buffers: name -> tensor of the buffers the forward updates (BatchNorm running statistics);
            the runtime applies each microbatch's update to these host copies, in microbatch order.

    Note:
        The per-layer order that gives DESIGN.md idea 7's semantics (what
        tests/runtime/host/test_optimizer.py `drive` checks against tests/oracle.py): in
        iteration t, after all gradient writes of group l (R3), staleness 0 runs
        `step(l)` then `copy(l)`; staleness 1 runs `copy(l)` (once iteration t's
        uploads of `group_readers(l)` are done, R1) then `step(l)` with t's
        gradient, so iteration t+1 reads the weights made from t-1's gradient.
        With staleness 1 the compute copies end one step behind the masters;
        `parameters_fp32()` returns the masters.
        With a dynamic loss scale, call `begin_iteration()` at each iteration's start.

    Example:
        >>> m = torch.nn.Linear(2, 2)
        >>> s = HostState(dict(m.named_parameters()), {"weight": (0,), "bias": (0,)}, 1,
        ...               optimizer=rpcompile.SGD(lr=0.1))
        >>> s.accumulate_grad("weight", torch.ones(2, 2)); s.accumulate_grad("bias", torch.ones(2))
        >>> s.step(0); s.copy(0); s.groups
        (('weight', 'bias'),)
    """

    def __init__(self, params: Mapping[str, Tensor], owners: Mapping[str, Sequence[int]], num_layers: int, *,
                 optimizer: AdamW | SGD, dtype: torch.dtype | None = None, tied: Mapping[str, str] | None = None,
                 loss_scale: float | DynamicLossScale | None = None, pin_memory: bool = False,
                 timeout_s: float = 600.0, buffers: Mapping[str, Tensor] | None = None) -> None:
        self.config = optimizer  # the optimizer config
        pin_b = pin_memory and torch.cuda.is_available()
        # buffers the forward updates (running statistics): the canonical host copies, changed once per microbatch
        self.buffers: dict[str, Tensor] = {n: (b.detach().clone().pin_memory() if pin_b else b.detach().clone())
                                           for n, b in (buffers or {}).items()}
        self.dtype = dtype  # training dtype of the compute copies (None = per-parameter dtype)
        self.tied = dict(tied or {})  # alias -> canonical
        self.owners = {n: tuple(sorted(set(owners.get(n, ())))) for n in params}  # canonical -> layers
        self.timeout_s = timeout_s
        pin = pinning(pin_memory)  # exact-size pinned blocks (runtime/host/pinned.py), with CUDA or a given allocator
        for name in params:
            bad = [l for l in self.owners[name] if not 0 <= l < num_layers]
            if bad:
                raise ValueError(f"parameter {name!r}: owner layers {bad} outside [0, {num_layers})")
        trainable = {n: p for n, p in params.items() if p.requires_grad and self.owners[n]}
        layer_of = {n: self.owners[n][0] if self.owners[n] else 0 for n in params}  # group of its compute copy
        self.layout = host_layout([(n, p.numel(), dtype or p.dtype, layer_of[n], n in trainable)
                                   for n, p in params.items()], num_layers)  # offsets of every host buffer
        self.flat = FlatGroups(self.layout, trainable, moment_names(optimizer))  # masters, grads, moments per group
        self.master: dict[str, Tensor] = self.flat.master  # trainable canonical -> fp32 master (a view)
        self.grad: dict[str, Tensor] = self.flat.grad  # trainable canonical -> fp32 buffer (valid if written
        # this iteration; a view)
        # compute copies: views into one block per (lowest owner layer, dtype), pinned with CUDA (uploads read them);
        # a group's trainable parameters first, at their offsets in the group's flat buffers
        order = self.layout.where
        self.blocks, self.where = host_blocks({n: params[n].detach().to(dtype or params[n].dtype) for n in order},
                                              layer_of, pin=pin)
        self.compute: dict[str, Tensor] = {n: view(self.blocks, self.where[n], tuple(p.shape))  # training dtype
                                           for n, p in params.items()}
        self.groups: tuple[tuple[str, ...], ...] = tuple(  # layer -> names stepped there, in the model's order
            tuple(n for n in trainable if layer_of[n] == l) for l in range(num_layers))
        self.group_of = {n: l for l, g in enumerate(self.groups) for n in g}  # trainable canonical -> group
        self.decay = decay_names(optimizer, self.master, self.tied)  # trainable names weight decay applies to
        if optimizer.decay is not None:  # a callable becomes the names it selects (a checkpoint saves no code)
            self.config = dataclasses.replace(optimizer, decay=self.decay)
        self.lr = optimizer.lr  # the learning rate of the next steps (`set_lr`)
        self.counts = {n: 0 for n in self.master}  # updates applied to each parameter (AdamW's step)
        # the C++ kernels (built here, at compile time, never in a step); None: torch's optimizers on the views
        self.kernels = load_kernels() if optimizer.impl == "fused" else None
        self._optims = [None if self.kernels is not None or not g else self._torch_optimizer(g)
                        for g in self.groups]
        self._copied = [False] * num_layers  # the compute copies hold the masters (a step wrote them)
        self._unscale: list[float | None] = [None] * num_layers  # kernels: loss scale of the grads to step
        self._locks = [threading.Lock() for _ in range(num_layers)]  # one per group
        self._cond = threading.Condition()  # guards _stats and the loss scale
        self._done = [0] * num_layers  # iterations whose grads are complete, per group
        self._stepped = [0] * num_layers  # steps taken (incl. skipped), per group
        self._stats: dict[int, _IterStats] = {}  # iteration -> its global reductions
        self.norms: dict[int, float] = {}  # iteration -> its unscaled global gradient norm (max_grad_norm set;
        # the last NORMS_KEPT iterations), read by metrics after the step without waiting for it
        self._n_trainable = sum(1 for g in self.groups if g)
        self.scaler = loss_scale if isinstance(loss_scale, DynamicLossScale) else None
        self.loss_scale: float | None = (self.scaler.init_scale if self.scaler else  # current loss scale
                                         None if loss_scale is None else float(loss_scale))
        self._good = 0  # consecutive good iterations (dynamic scaling)
        self._begun = 0  # iterations started with begin_iteration()
        self._fresh: list[set[str]] = [set() for _ in range(num_layers)]  # grads written this iteration
        self._scale_of: dict[int, float] = {}  # iteration -> scale its loss was multiplied by
        self.skipped: list[int] = []  # iterations skipped for inf/nan gradients
        self._skips: set[int] = set()  # iterations whose steps apply nothing (`skip_iteration`)
        self._sq: dict[str, float] = {}  # kernels: sum of squares of each gradient written this iteration
        self._bad: dict[str, bool] = {}  # kernels: whether it has an inf/nan
        self.on_grad = self.on_complete = _no_hook  # data-parallel hooks (runtime/distributed.py)

    def _torch_optimizer(self, group: Sequence[str]) -> torch.optim.Optimizer:
        """torch's optimizer over the group's master views, its state already the views of the flat moments."""
        opt = make_torch_optimizer(self.config, [self.master[n] for n in group], [n in self.decay for n in group])
        for n in group:
            self.master[n].grad = self.grad[n]
            if self.flat.moment[n]:  # SGD without momentum keeps no state
                opt.state[self.master[n]] = {**self._step_entry(n), **self.flat.moment[n]}
        return opt

    def _step_entry(self, name: str) -> dict[str, Tensor]:
        """AdamW's `step` entry of torch's optimizer state ({} for SGD)."""
        return {"step": torch.tensor(float(self.counts[name]))} if isinstance(self.config, AdamW) else {}

    @classmethod
    def from_graph(cls, graph: Any, **kwargs: Any) -> HostState:
        """A HostState for a traced `LayerGraph` (`parameters()`, `param_owners()`, `layers`, `tied`; the
        layers' modules for the running statistics to keep, see `tracked_buffers`).

        Example:
            >>> HostState.from_graph(g, optimizer=rpcompile.AdamW(), dtype=torch.bfloat16).groups[0]
            ('model.embed_tokens.weight',)
        """
        kwargs.setdefault("buffers", {n: b for _, bufs in tracked_buffers(graph).items() for n, b in bufs.items()})
        return cls(graph.parameters(), graph.param_owners(), len(graph.layers), tied=graph.tied, **kwargs)

    @property
    def needs_global(self) -> bool:
        """True if `step` waits for every group's gradient (clipping or dynamic loss scaling)."""
        return self.config.max_grad_norm is not None or self.scaler is not None

    def canonical(self, name: str) -> str:
        """The canonical name of `name` (itself unless it is a tied alias)."""
        return self.tied.get(name, name)

    def group_readers(self, layer: int) -> tuple[int, ...]:
        """Layers whose parameter uploads read a compute copy that `copy(layer)` overwrites (for R1/R2)."""
        return tuple(sorted({l for n in self.groups[layer] for l in self.owners[n]}))

    # -- the executor's calls -----------------------------------------------------------------
    def read(self, name: str) -> Tensor:
        """The compute copy of `name` (what a parameter upload reads; not a copy, do not modify)."""
        return self.compute[self.canonical(name)]

    def grad_of(self, name: str) -> Tensor | None:
        """The gradient accumulated for `name` this iteration (the buffer itself), None if none yet."""
        l = self.group_of.get(name := self.canonical(name))
        return self.grad[name] if l is not None and name in self._fresh[l] else None

    def begin_iteration(self) -> float:
        """Record the start of the next iteration; returns the factor its loss must be multiplied by."""
        with self._cond:
            if self.scaler is not None:  # iteration u + 1 may start before u's scale update
                self._scale_of[self._begun] = self.loss_scale
            self._begun += 1
            return 1.0 if self.loss_scale is None else self.loss_scale

    def accumulate_grad(self, name: str, grad: Tensor) -> bool:
        """Add `grad` (one device's accumulated gradient of one round, any dtype) into the fp32 buffer.

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
            if self.kernels is not None:
                src = grad.to("cpu").contiguous()
                src = src if src.dtype in KINDS else src.float()
                self._sq[name], bad = self.kernels.land(buf, src.view(-1), add=not first)
                self._bad[name] = bad
            else:
                if first:  # the first write of the iteration overwrites: the buffer is logically zero
                    buf.copy_(grad.to(buf.device))
                else:
                    buf.add_(grad.to(buf.device))
                bad = not bool(torch.isfinite(buf).all())
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

        `all_reduce(flat)` sums the group's flat fp32 gradient buffer over the processes in place; one
        pass then divides it by `world` and (with the kernels) takes the statistics of the average that
        `grads_complete` uses: no copy in or out, no second statistics pass. Call it after the group's
        last gradient write of the iteration and before `grads_complete(layer)` returns (its `on_complete`
        hook waits for this call, holding the group's lock: nothing else touches the group meanwhile).

        Example:
            >>> s.average_grads(0, 2, lambda flat: dist.all_reduce(flat))   # doctest: +SKIP
        """
        all_reduce(self.flat.grads[layer])
        if self.kernels is None:
            self.flat.grads[layer].div_(world)
            return
        for n in self.groups[layer]:
            g = self.grad[n].view(-1)
            self._sq[n], self._bad[n] = self.kernels.land(g, g, add=False, divisor=world)

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
            if self.kernels is not None:  # the landing pass (or `average_grads`) took the statistics; the step
                self._unscale[layer] = scale  # unscales
                sq = {n: self._sq[n] for n in names}
                found += any(self._bad[n] for n in names)
            elif grads and scale is not None and self.scaler is not None:
                inv = torch.tensor([scale], dtype=torch.float64).reciprocal().float()
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
            elif grads and scale is not None and scale != 1.0:
                torch._foreach_mul_(grads, 1.0 / scale)
            norms = (torch._foreach_norm(grads, 2.0) if grads and self.config.max_grad_norm is not None
                     and self.kernels is None else [])
        if not self.needs_global:
            return
        with self._cond:
            st = self._stats.setdefault(u, _IterStats(pending=self._n_trainable))
            st.norms.update(zip(names, norms))
            st.sq.update(sq if self.kernels is not None else {})
            st.scale = scale
            st.found_inf |= bool(found.item())
            st.pending -= 1
            if st.pending == 0:
                self._finish(u, st)
                self._cond.notify_all()

    def _finish(self, u: int, st: _IterStats) -> None:
        """Global norm, clip coefficient and loss-scale update of iteration u (holding _cond)."""
        if self.config.max_grad_norm is not None:
            order = [st.norms[n] for n in self.master if n in st.norms]  # the order of `params`, as eager
            st.norm = torch.linalg.vector_norm(torch.stack(order), 2.0) if order else torch.tensor(0.0)
            if self.kernels is not None:  # fp64 sum of the scaled squares (in a fixed order), then unscaled
                total = math.fsum(st.sq[n] for n in self.master if n in st.sq)
                st.norm = torch.tensor(math.sqrt(total) / (st.scale or 1.0), dtype=torch.float32)
            st.coef = torch.clamp(self.config.max_grad_norm / (st.norm + 1e-6), max=1.0)
            self.norms[u] = float(st.norm)
            for old in [k for k in self.norms if k <= u - NORMS_KEPT]:
                del self.norms[old]
        if self.scaler is not None:
            used = self._scale_of.get(u, self.loss_scale)
            if st.found_inf:  # several in-flight iterations at one scale back off only once
                self.loss_scale = min(self.loss_scale, used * self.scaler.backoff_factor)
                self._good, self.skipped = 0, [*self.skipped, u]
            else:
                self._good += 1
                if self._good >= self.scaler.growth_interval:
                    self.loss_scale, self._good = self.loss_scale * self.scaler.growth_factor, 0

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
            ok = self._cond.wait_for(lambda: u in self._stats and self._stats[u].pending == 0,
                                     timeout=self.timeout_s if timeout_s is None else timeout_s)
            if not ok:
                missing = [l for l, g in enumerate(self.groups) if g and self._done[l] <= u]
                raise RuntimeError(f"waited {self.timeout_s}s for the global gradient statistics of "
                                   f"iteration {u}: groups {missing} have not called grads_complete()")
            return self._stats[u]

    def step(self, layer: int, copy: bool = False) -> None:
        """Apply this iteration's gradient of group `layer` to its masters, then zero the buffers.

        The caller guarantees R3 (all gradient downloads of the group are done)
        and R5 (steps sequential, copies between them). A no-op for a group with
        no trainable parameters; skipped on inf/nan with dynamic loss scaling.
        A parameter without any `accumulate_grad` this iteration is left out of
        the update (as eager torch with `zero_grad(set_to_none=True)`).

        Args:
            layer: the group.
            copy: also write the new masters into the compute copies, in the update's pass with the
                kernels (staleness 0: `step(l, copy=True)` then `copy(l)`, which has nothing left to do
                unless some parameter of the group had no gradient). The caller then guarantees R1 for
                this call as for `copy(layer)`.
        """
        group = self.groups[layer]
        self._complete(layer, strict=False)
        if not group:
            with self._locks[layer]:
                self._stepped[layer] += 1
            return
        u = self._stepped[layer]
        st = self._wait(u) if self.needs_global else None
        with self._locks[layer]:
            fresh = self._fresh[layer]
            apply = fresh and (st is None or not st.found_inf) and u not in self._skips
            if apply and self.kernels is not None:
                factor = torch.ones((), dtype=torch.float32)  # unscale and clip: one float32 factor, as eager's
                if self._unscale[layer] is not None and self._unscale[layer] != 1.0:  # two multiplications
                    factor = factor * (1.0 / self._unscale[layer])
                if st is not None and st.coef is not None:
                    factor = factor * st.coef
                out = {d: self.blocks[(layer, d)] for d in {s.dtype for s in self.layout.segments[layer]}}
                self.flat.step(self.kernels, self.config, layer, [n for n in group if n in fresh], self.counts,
                               self.decay, factor=float(factor), lr=self.lr, out=out if copy else None)
                self._copied[layer] = copy and len(fresh) == len(group)  # else `copy` casts the group's others
            elif apply:
                for n in group:
                    self.master[n].grad = self.grad[n] if n in fresh else None
                if st is not None and st.coef is not None:
                    torch._foreach_mul_([self.grad[n] for n in group if n in fresh], st.coef)
                self._optims[layer].step()
                for n in fresh:
                    self.counts[n] += 1
            fresh.clear()  # zeroes the buffers logically (the next write overwrites)
            self._stepped[layer] += 1
        if st is not None:
            with self._cond:
                st.stepped += 1
                if st.stepped == self._n_trainable:
                    del self._stats[u]
                    self._scale_of.pop(u, None)

    def skip_iteration(self) -> int:
        """Make the oldest iteration not yet stepped a no-op for every group (a non-finite step); returns it.

        Its gradients are discarded as each group steps; masters and optimizer state do not change.
        """
        with self._cond:
            u = min((s for s, g in zip(self._stepped, self.groups) if g), default=0)
            self._skips.add(u)
            return u

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every group's torch optimizer; each group's next `step` uses it.

        Each group changes under its own lock, so a step never sees half a change;
        which iteration's steps come next is the caller's to order (`Compiled.set_lr`
        queues the call on the runtime's optimizer lane, between two iterations' steps).
        The lr is not part of `state_dict()`: a resumed run sets it again.

        Example:
            >>> s.set_lr(0.05); s._optims[0].param_groups[0]["lr"]   # doctest: +SKIP
            0.05
        """
        self.lr = lr  # the kernels' steps read it
        for layer, opt in enumerate(self._optims):
            if opt is not None:
                with self._locks[layer]:
                    for pg in opt.param_groups:
                        pg["lr"] = lr

    def copy(self, layer: int) -> None:
        """Master -> compute copy (cast to the training dtype, in place) for group `layer` (R1/R2: caller).

        With the kernels one pass per segment of the group (none after `step(layer, copy=True)`).
        """
        with self._locks[layer]:
            if self.kernels is not None and not self._copied[layer]:
                self.flat.cast(self.kernels, layer, {s.dtype: self.blocks[(layer, s.dtype)]
                                                     for s in self.layout.segments[layer]})
            elif self.kernels is None:
                for n in self.groups[layer]:
                    self.compute[n].copy_(self.master[n])
            self._copied[layer] = False
