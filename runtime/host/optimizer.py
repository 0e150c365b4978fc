"""Host-side model state and the CPU optimizer worker (DESIGN.md ideas 1, 6, 7).

Host memory is the home of all model state. Per parameter `HostState` keeps a
compute copy in the training dtype (what uploads read), and for a trainable
parameter a master (fp32, or bf16 with `master_dtype=torch.bfloat16`: a buffer of its own, the compute
copy stays separate), optimizer state and a gradient buffer (fp32, or bf16 with
`grad_dtype=torch.bfloat16`: summed in fp32, stored with stochastic rounding): views into
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
    `accumulate_grad` writes the gradient (fp32, or bf16) and, in the same pass, its sum of
    squares and non-finite flag; `step(l)` is one pass per group run over the flat
    buffers (unscale and clip as one factor, AdamW or SGD); `copy(l)` one cast pass
    (or none: `step(l, copy=True)` writes the compute copies in the update's pass).
    The values are torch's eager single-tensor ones except that sqrt is correctly
    rounded (torch's CPU sqrt is not always) and the global norm is summed in fp64:
    within a few float32 ulps. `impl="foreach"/"single"` run torch's optimizers on
    the same views and give eager's bits.

Note:
    Global statistics. Clipping by global norm and dynamic loss scaling make
    `step(l)` wait until every trainable group has called `grads_complete` for
    the iteration; that side (gradients landing, the per-iteration reductions,
    the barrier, the loss scale) is the `GradStats` mixin of runtime/host/grad_stats.py,
    the snapshots are the `StateIO` mixin of runtime/host/state_io.py, and the
    staleness-1 copies that alternate between two buffers are the `AlternatingCopies`
    mixin of runtime/host/layout.py. This module holds the update: the state's
    construction, `step`, `copy`, `set_lr`.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from rpcompile.ir.host_layout import host_layout
from rpcompile.ir.optim import SGD, AdamW, DynamicLossScale, decay_names, make_torch_optimizer, split_masters
from rpcompile.runtime.host.flat import FlatGroups, grad_dtype, master_dtype, moment_names, state_dtype
from rpcompile.runtime.host.grad_stats import GradStats, ScaleVerdict, _IterStats, step_factor
from rpcompile.runtime.host.kernels import load_kernels
from rpcompile.runtime.host.layout import AlternatingCopies, Alternation, host_blocks, view
from rpcompile.runtime.host.lean import TorchLean, split as split_master
from rpcompile.runtime.host.pinned import pinning
from rpcompile.runtime.stage.runner import tracked_buffers
from rpcompile.runtime.host.state_io import StateIO

__all__ = ["HostState", "make_torch_optimizer"]


def _no_hook(layer: int) -> None:
    """The default data-parallel hook: nothing to do."""


def _settled() -> None:
    """The default `on_settle` hook: nothing in flight outside the runtime's lanes."""


def _copied_now(layer: int, done: Any) -> None:
    """The default `on_copied` hook: the compute copies are complete when `copy(layer)` returns."""
    done()


class HostState(GradStats, StateIO, AlternatingCopies):
    """Compute copies, masters (fp32 or bf16), optimizer state and gradient buffers on the host.

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
        seed: the seed of the stochastic rounding of bf16 moments and masters (`AdamW(state_dtype=torch.bfloat16)`,
            `master_dtype=torch.bfloat16`, runtime/host/lean.py); saved in `state_dict()` with the step counts
            that, with it, fix the bits. A bf16 master is a buffer of its own beside the compute copy (R1 at
            staleness 1: `copy(l)` writes the compute copy, `step(l)` the master), and the trainable
            parameters' compute copies start as the master's value (rounded to nearest once).
        shard: (rank, world): keep only this rank's slice of each group's masters and optimizer moments
            (sharded state across data-parallel servers, `runtime.sharded`; `FlatGroups`). Steps and copies then
            cover the owned slice only; the gradients and compute copies stay whole, and a data-parallel
            `runtime.sharded.ShardedReducer` reduce-scatters the one and all-gathers the other.
        staleness: the runtime's, 0 or 1. At 1, fp32 masters beside bf16 moments are kept split (unsharded;
            `rpcompile.ir.optim.split_masters`): their bf16 halves are the second buffer the compute copies
            alternate with, 2 bytes a parameter less. At 0 there is no second buffer to save and the split
            would only add work to the update (about 7% on this machine's EPYC), so they stay whole.

    Note:
        The per-layer order that gives DESIGN.md idea 7's semantics (what
        tests/runtime/host/test_optimizer.py `drive` checks against tests/oracle.py): in
        iteration t, after all gradient writes of group l (R3), staleness 0 runs
        `step(l)` then `copy(l)`; staleness 1 runs `copy(l)` (once iteration t's
        uploads of `group_readers(l)` are done, R1) then `step(l)` with t's
        gradient, so iteration t+1 reads the weights made from t-1's gradient.
        With staleness 1 the compute copies end one step behind the masters;
        `parameters_fp32()` returns the masters.
        With a dynamic loss scale, call `begin_iteration(lag=staleness)` at each iteration's start.

    Example:
        >>> import rpcompile, torch
        >>> m = torch.nn.Linear(2, 2)
        >>> s = HostState(dict(m.named_parameters()), {"weight": (0,), "bias": (0,)}, 1,
        ...               optimizer=rpcompile.SGD(lr=0.1))
        >>> s.accumulate_grad("weight", torch.ones(2, 2)), s.accumulate_grad("bias", torch.ones(2))  # finite
        (True, True)
        >>> s.step(0); s.copy(0); s.groups
        (('weight', 'bias'),)
    """

    def __init__(self, params: Mapping[str, Tensor], owners: Mapping[str, Sequence[int]], num_layers: int, *,
                 optimizer: AdamW | SGD, dtype: torch.dtype | None = None, tied: Mapping[str, str] | None = None,
                 loss_scale: float | DynamicLossScale | None = None, pin_memory: bool = False,
                 timeout_s: float = 600.0, buffers: Mapping[str, Tensor] | None = None, seed: int = 0,
                 shard: tuple[int, int] | None = None, staleness: int = 1) -> None:
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
        split = split_masters(optimizer, shard, staleness)  # fp32 masters in two halves, one the bf16 copy (lean.py)
        self.flat = FlatGroups(self.layout, trainable, moment_names(optimizer), state_dtype(optimizer),
                               seed, master_dtype(optimizer), grad_dtype(optimizer), shard, pin, split)  # masters,
        # grads, moments (bf16 masters, or halves, pinned as the blocks: at staleness 1 uploads read them in turn)
        self.shard = shard  # (rank, world) of sharded masters and moments; None: whole
        # trainable canonical -> master (fp32 or bf16; a view; split fp32 masters: their values, read from the halves
        # and written with `flat.set_master`)
        self.master: Mapping[str, Tensor] = self.flat.master
        self.grad: dict[str, Tensor] = self.flat.grad  # trainable canonical -> fp32/bf16 buffer (valid if written
        # this iteration; a view)
        # compute copies: views into one block per (lowest owner layer, dtype), pinned with CUDA (uploads read them);
        # a group's trainable parameters first, at their offsets in the group's flat buffers
        order, lean = self.layout.where, master_dtype(optimizer) != torch.float32  # lean: copies start as masters
        first = {n: params[n].detach().to(master_dtype(optimizer)) if lean and n in self.master else params[n].detach()
                 for n in order}
        if split:  # a bf16 copy of a split master is its bf16 half (rounded with ties away from zero)
            first.update({n: split_master(self.master[n])[0] for n in trainable
                          if (dtype or params[n].dtype) == torch.bfloat16})
        self.blocks, self.where = host_blocks({n: first[n].to(dtype or params[n].dtype) for n in order},
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
        # bf16 moments, masters or gradients without the kernels: the same update in torch operations over the flat
        # buffers
        self._lean = TorchLean() if self.kernels is None and (shard is not None or torch.bfloat16 in (
            state_dtype(optimizer), master_dtype(optimizer), grad_dtype(optimizer))) else None  # (or sharded slices)
        # the landing pass takes each gradient's statistics and the step unscales (the kernels, bf16 gradients, or
        # the sharded state's reduce-scatter)
        self._landed = self.kernels is not None or grad_dtype(optimizer) == torch.bfloat16 or shard is not None
        self._optims = [None if self.kernels is not None or self._lean is not None or not g
                        else self._torch_optimizer(g) for g in self.groups]
        self._copied = [False] * num_layers  # the compute copies hold the masters (a step wrote them)
        self._unscale: list[float | None] = [None] * num_layers  # kernels: loss scale of the grads to step
        self._locks = [threading.Lock() for _ in range(num_layers)]  # one per group
        self._cond = threading.Condition()  # guards _stats and the loss scale
        self._done = [0] * num_layers  # iterations whose grads are complete, per group
        self._stepped = [0] * num_layers  # steps taken (incl. skipped), per group
        self._stats: dict[int, _IterStats] = {}  # iteration -> its global reductions
        self.norms: dict[int, float] = {}  # iteration -> its unscaled global gradient norm (max_grad_norm set;
        # the last grad_stats.NORMS_KEPT iterations), read by metrics after the step without waiting for it
        self._n_trainable = sum(1 for g in self.groups if g)
        self.scaler = loss_scale if isinstance(loss_scale, DynamicLossScale) else None
        self.loss_scale: float | None = (self.scaler.init_scale if self.scaler else  # current loss scale
                                         None if loss_scale is None else float(loss_scale))
        self._good = 0  # consecutive good iterations (dynamic scaling)
        self._begun = 0  # iterations started with begin_iteration()
        self._fresh: list[set[str]] = [set() for _ in range(num_layers)]  # grads written this iteration
        self._scale_of: dict[int, float] = {}  # iteration -> scale its loss was multiplied by
        self.verdicts: dict[int, ScaleVerdict] = {}  # iteration -> its dynamic loss scale check (the last
        # grad_stats.NORMS_KEPT), read by metrics after the step without waiting for it
        self._base, self._base_scale = 0, self.loss_scale  # the scale before the checks of iterations >= _base
        self.skipped: list[int] = []  # iterations skipped for inf/nan gradients
        self._skips: set[int] = set()  # iterations whose steps apply nothing (`skip_iteration`)
        self._sq: dict[str, float] = {}  # kernels: sum of squares of each gradient written this iteration
        self._bad: dict[str, bool] = {}  # kernels: whether it has an inf/nan
        self._writes: dict[str, int] = {}  # bf16 gradients: each one's last write index this iteration (0-based)
        self.on_grad = self.on_complete = _no_hook  # data-parallel hooks (runtime/distributed.py)
        self.on_copied = _copied_now  # sharded state: (layer, done) -> calls done() once the copies are gathered
        self.on_totals: Any = None  # sharded state: iteration -> (sum of squares, non-finite) over every rank
        self.gather: Any = None  # sharded state: (group, owned slice as float32) -> the group's whole flat buffer
        self.on_settle: Any = _settled  # sharded state: wait until every compute copy made is gathered
        self.alt: Alternation | None = None  # staleness 1: the compute copies alternate between two buffers
        self._pin = pin  # what the alternating copies' own buffers are pinned with

    def _torch_optimizer(self, group: Sequence[str]) -> torch.optim.Optimizer:
        """torch's optimizer over the group's master views, its state already the views of the flat moments."""
        opt = make_torch_optimizer(self.config, [self.master[n] for n in group], [n in self.decay for n in group])
        for n in group:
            self.master[n].grad = self.grad[n]
            if self.flat.moment[n]:  # SGD without momentum keeps no state
                opt.state[self.master[n]] = {**self._step_entry(n), **self.flat.moment[n]}
        return opt

    def _step_entry(self, name: str) -> dict[str, Tensor]:
        """AdamW's `step` entry of torch's optimizer state; SGD has one only with a bf16 master, whose rounding
        keys count the steps (else {}: torch's SGD state has none)."""
        counted = isinstance(self.config, AdamW) or master_dtype(self.config) != torch.float32
        return {"step": torch.tensor(float(self.counts[name]))} if counted else {}

    @classmethod
    def from_graph(cls, graph: Any, **kwargs: Any) -> HostState:
        """A HostState for a traced `LayerGraph` (`parameters()`, `param_owners()`, `layers`, `tied`; the
        layers' modules for the running statistics to keep, see `tracked_buffers`).

        Example:
            >>> import rpcompile, torch; from transformers import LlamaConfig, LlamaForCausalLM
            >>> llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
            >>> ids = torch.zeros(2, 16, dtype=torch.long)
            >>> g = rpcompile.passes.trace(llama, {"input_ids": ids, "labels": ids})
            >>> HostState.from_graph(g, optimizer=rpcompile.AdamW(), dtype=torch.bfloat16).groups[0]
            ('model.embed_tokens.weight',)
        """
        kwargs.setdefault("buffers", {n: b for _, bufs in tracked_buffers(graph).items() for n, b in bufs.items()})
        return cls(graph.parameters(), graph.param_owners(), len(graph.layers), tied=graph.tied, **kwargs)

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

        With alternating copies (`alternate`) the new compute copies go to the buffer this iteration uploaded
        from, in the update's pass (the caller guarantees R1 for it, as for `copy(layer)`); a skipped step
        writes the unchanged ones.
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
            shared = self.alt is not None and self.alt.shared[layer]  # a bf16 master is one of the two buffers
            alt = self.alt.sources(layer) if shared else None  # (read, write): the master out of place
            if shared and not (apply and len(fresh) == len(group)):
                self.alt.carry(layer)  # the masters not updated now keep their value in the new buffer
            own = self.alt is not None and not shared  # a buffer of its own takes the new copies
            written = False  # whether the update's pass wrote them
            if apply and self._landed:
                factor = step_factor(self._unscale[layer], None if st is None else st.coef_value)  # unscale, clip
                out = self.alt.out(layer) if own else {d: self.blocks[(layer, d)]
                                                       for d in {s.dtype for s in self.layout.segments[layer]}}
                copy_now = (copy or own) and self.kernels is not None  # TorchLean's steps leave the copies to `copy`
                self.flat.step(self.kernels or self._lean, self.config, layer, [n for n in group if n in fresh],
                               self.counts, self.decay, factor=factor, lr=self.lr,
                               out=out if copy_now else None, alt=alt)
                written = copy_now and len(fresh) == len(group)
                self._copied[layer] = written and self.alt is None  # else `copy` casts the group's others
            elif apply and self._lean is not None:  # unscaled in grads_complete; the clip coefficient here
                factor = 1.0 if st is None or st.coef_value is None else st.coef_value
                self.flat.step(self._lean, self.config, layer, [n for n in group if n in fresh], self.counts,
                               self.decay, factor=factor, lr=self.lr, out=None, alt=alt)  # `copy` casts (no kernels)
            elif apply:
                for n in group:
                    self.master[n].grad = self.grad[n] if n in fresh else None
                if st is not None and st.coef is not None:
                    torch._foreach_mul_([self.grad[n] for n in group if n in fresh], st.coef)
                self._optims[layer].step()
                for n in fresh:
                    self.counts[n] += 1
            if own and not written:  # the copies the update's pass did not write (a skip, the torch path)
                self.flat.cast(self.kernels, layer, self.alt.out(layer))
            fresh.clear()  # zeroes the buffers logically (the next write overwrites)
            self._stepped[layer] += 1
            if self.alt is not None:
                self.alt.flip(layer)
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

        With the kernels one pass per segment of the group (none after `step(layer, copy=True)`). The runtime
        does not call it while the copies alternate (the steps write them); a caller may between runs, settled
        (after a flush), to make the copies the next iteration reads the masters (e.g. at the end of a run).
        """
        with self._locks[layer]:
            if self.alt is not None and self.alt.flips.get(layer, 0):
                raise RuntimeError(f"copy({layer}): the alternating copies are not settled (flush first)")
            if (self.kernels is not None or self.shard is not None or self.flat.split) and not self._copied[layer]:
                self.flat.cast(self.kernels, layer, {s.dtype: self.blocks[(layer, s.dtype)]
                                                     for s in self.layout.segments[layer]})
            elif self.kernels is None and self.shard is None and not self.flat.split:
                for n in self.groups[layer]:
                    self.compute[n].copy_(self.master[n])
            self._copied[layer] = False
