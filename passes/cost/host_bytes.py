"""Host memory of a training run: what `runtime.host.optimizer.HostState` and the activation store hold.

All model state lives in host memory (DESIGN.md idea 1); this pass counts it by
category, and the driver's admission check (`rpcompile.hostmem`) refuses a run
that does not fit the host before it starts:

    >>> import torch
    >>> need = host_bytes(torch.nn.Linear(1024, 1024), microbatches=4, staleness=1, dtype=torch.bfloat16)
    >>> need.weights, need.masters, need.grads, need.optimizer, need.activations
    (2099200, 4198400, 4198400, 8396800, 0)

Note: what counts. Every parameter has a compute copy in the training dtype
(its own dtype when the run keeps the model's), frozen ones included and
nothing else for them; for a traced graph the copies count as the blocks
that hold them are allocated (`compute_blocks`: 16-byte aligned views, pinned
at exactly that size with CUDA, `runtime.host.pinned`). A trainable parameter (requires_grad, used by some
layer) adds a master of the optimizer's `master_dtype` (fp32: 4 bytes, bf16: 2; a bf16
master is a buffer of its own beside the compute copy, which staleness 1 still uploads while the
master is updated), a gradient buffer of the optimizer's `grad_dtype` (fp32: 4 bytes, bf16: 2) and the
optimizer state:
AdamW two moments of its `state_dtype` (fp32: 8 bytes a parameter, bf16: 4), SGD
one fp32 momentum buffer when momentum > 0. For a
traced LayerGraph the count is the host layout's (`rpcompile.ir.host_layout`): the
flat per-group buffers and compute blocks as HostState allocates them, alignment
gaps included; for an nn.Module (no layer groups yet) the elements alone. With the
masters and moments sharded over W data-parallel servers (`shard=(rank, W)`), they count that
rank's slice of each group's flat buffers (`rpcompile.ir.host_layout.shard_slices`; of all the trainable
elements for an nn.Module); the compute copies and gradient buffers stay whole on every server. The
activations are the saved stage inputs the host keeps for the backward stages
to recompute from (`round_saved_bytes`, the rule `max_seq_len`
uses too): iterations run in rounds of R microbatches and a round's inputs live
from its forward to its backward, so R microbatches hold every backward stage's
input; the rotation has no drain (the next round, with staleness 1 also the
next iteration's first, starts on a worker as soon as it is free), so the last
N - 1 backward stages of the previous round still hold theirs and count once
more. With staleness 1 the runtime also keeps one more copy of the trainable parameters' compute copies
(`undo`: the second buffer they alternate with, runtime/host/layout.py `Alternation`; sharded, what an
iteration's COPYs overwrote before it committed, restored if it fails), except where a bf16 master with
bf16 compute copies is that second buffer, or the bf16 half of a split fp32 master (bf16 moments, unsharded:
`rpcompile.runtime.host.lean`; the master still counts 4 bytes, its two halves). An estimate for
admission, not an allocator trace: Python overheads are left out, and the runtime's transfer buffers
(gradient staging, the host pool) are added by `rpcompile.hostmem` when it has the program.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rpcompile.ir.host_layout import host_layout, shard_slices
from rpcompile.ir.optim import SGD, grad_dtype, master_dtype, split_masters
from rpcompile.ir.plan import StagePlan
from rpcompile.passes.partition.timing import default_round_size

__all__ = ["HostBytes", "host_bytes", "round_saved_bytes", "compute_blocks"]

_ADAM_MOMENTS = 2  # moments per trainable element (exp_avg, exp_avg_sq), of AdamW's state_dtype


@dataclass(frozen=True, slots=True)
class HostBytes:
    """Host bytes of a run, by category (see the module Note)."""

    weights: int       # compute copies of every parameter (training dtype)
    masters: int       # masters of the trainable parameters (fp32, or bf16: `master_size`)
    grads: int         # gradient buffers of the trainable parameters (fp32, or bf16: `grad_dtype`)
    optimizer: int     # optimizer state of the trainable parameters
    activations: int   # saved inputs of the backward stages for the microbatches in flight (0 before a plan)
    in_flight: int     # microbatches per round R whose saved inputs are on the host (0 before a plan)
    buffers: int = 0   # the runtime's transfer buffers: gradient staging, host pool (`rpcompile.hostmem`, with a program)
    trainable: int = 0  # trainable parameters (elements; 0: none)
    trainable_weights: int = 0  # bytes of the trainable parameters' compute copies (part of `weights`)
    arena: int = 0     # of `buffers`: the host arena holding the values that cross cuts, the saved stage inputs
                       # among them (`runtime.host.assign`); with it, `activations` is 0 (they are in the arena)
    master_size: int = 4  # bytes of one master element: 4 (fp32), 2 (bf16, `master_dtype=torch.bfloat16`)
    split: bool = False  # fp32 masters kept in two halves, the bf16 one the copies' second buffer (`split_masters`)
    servers: int = 1   # W: with W > 1 `masters` and `optimizer` are one server's share of the state sharded over W
                       # data-parallel servers (`host_bytes(shard=)`); the rest is whole on every server
    undo: int = 0      # staleness 1: one more copy of the trainable parameters' compute copies (`trainable_weights`):
                       # the second buffer they alternate with (runtime/host/layout.py `Alternation`; none where a
                       # bf16 master is that buffer), or, sharded, the version an iteration's COPYs overwrote
                       # before it committed, to undo them if it fails

    @property
    def state_per_param(self) -> float:
        """Parameter state in bytes per trainable parameter: its compute copy, master, gradient and optimizer
        state (alignment gaps included; 0.0 with nothing trainable); sharded, what one server holds (its
        share of the masters and moments) per trainable parameter of the whole model.

        >>> HostBytes(0, 40, 40, 80, 0, 0, trainable=10, trainable_weights=20).state_per_param
        18.0
        """
        own = self.trainable_weights + self.masters + self.grads + self.optimizer
        return own / self.trainable if self.trainable else 0.0

    def per_param_line(self) -> str:
        """`state_per_param` and its parts, in words (what `plan` prints beside the host memory line).

        >>> HostBytes(0, 40, 40, 40, 0, 0, trainable=10, trainable_weights=20).per_param_line()
        'parameter state: 14.0 B per trainable parameter (compute copy 2.0, master 4.0, gradient 4.0, optimizer state 4.0)'
        >>> HostBytes(0, 40, 40, 40, 0, 0, trainable=10, trainable_weights=20, undo=20).per_param_line()[-55:]
        ' 4.0; staleness 1 adds 2.0 for the second compute copy)'
        """
        t = self.trainable or 1
        where = f" on one server of {self.servers} (its share of the masters and moments)" if self.servers > 1 else ""
        undo = f"; staleness 1 adds {self.undo / t:.1f} for the {'undo copy' if self.servers > 1 else 'second compute copy'}" if self.undo else ""
        return (f"parameter state{where}: {self.state_per_param:.1f} B per trainable parameter (compute copy "
                f"{self.trainable_weights / t:.1f}, master {self.masters / t:.1f}, gradient {self.grads / t:.1f}, "
                f"optimizer state {self.optimizer / t:.1f}{undo})")

    @property
    def undo_name(self) -> str:
        """What `undo` holds: "second compute copies", or, sharded, "undo copies"."""
        return "undo copies" if self.servers > 1 else "second compute copies"

    @property
    def total(self) -> int:
        """All of it, in bytes.

        >>> HostBytes(2, 4, 4, 8, 0, 0).total, HostBytes(2, 4, 4, 8, 0, 0, trainable_weights=2, undo=2).total
        (18, 20)
        """
        return self.weights + self.masters + self.grads + self.optimizer + self.activations + self.buffers + self.undo

    def __str__(self) -> str:
        kind = "fp32" if self.master_size == 4 else "bf16"
        share = f" (1 of {self.servers} shares)" if self.servers > 1 else ""
        split = " (split: bf16 halves and low halves)" if self.split else ""
        parts = [f"weights {_gib(self.weights)}", f"{kind} masters {_gib(self.masters)}{share}{split}",
                 f"gradients {_gib(self.grads)}", f"optimizer state {_gib(self.optimizer)}{share}"]
        if self.undo:
            why = ("the trainable weights' copies an unfinished iteration overwrote" if self.servers > 1 else
                   "the trainable weights' copies alternate between two buffers")
            parts.append(f"{self.undo_name} {_gib(self.undo)} (staleness 1: {why})")
        if self.in_flight and not self.arena:
            parts.append(f"saved activations {_gib(self.activations)} for {self.in_flight} microbatches per round "
                         f"(+ the previous round's last stages)")
        if self.arena:
            parts.append(f"transfer buffers {_gib(self.buffers)} (the saved inputs and values crossing cuts in an "
                         f"arena of {_gib(self.arena)}, packed by live range; gradient staging, batch inputs, losses)")
        elif self.buffers:
            parts.append(f"transfer buffers {_gib(self.buffers)}")
        return f"{_gib(self.total)} ({self.total} bytes: {', '.join(parts)})"


def host_bytes(model: Any, costs: Any = None, plan: Any = None, *, microbatches: int, staleness: int = 1,
               optimizer: Any = None, dtype: Any = None, gpus: int | None = None,
               round_size: int | None = None, shard: tuple[int, int] | None = None) -> HostBytes:
    """Host bytes a run needs, by category (on one server of a sharded run: `shard`).

    Args:
        model: a traced `LayerGraph` (its canonical parameters; one no layer uses counts as frozen, as in
            HostState) or an `nn.Module` (every parameter, e.g. on the meta device before tracing).
        costs, plan: the CostTable and StagePlan; without them the activations count 0.
        microbatches: M per iteration.
        staleness: 0 or 1; with 1 the runtime keeps one more copy of the trainable parameters' compute copies
            (`undo`: the second buffer they alternate with; sharded, the undo copy of what an iteration's COPYs
            overwrote before it committed), except where a bf16 master with bf16 compute copies (unsharded)
            is that second buffer, or a split float32 master's bf16 half (`split_masters`: bf16 moments).
        optimizer: `rpcompile.AdamW` (default; its `state_dtype` sets the moments' bytes, `master_dtype` the
            masters', `grad_dtype` the gradients') or `rpcompile.SGD` (its `master_dtype` and `grad_dtype`).
        dtype: training dtype of the compute copies; None keeps each parameter's own.
        gpus: workers N; needed with a plan.
        round_size: microbatches per round R (default `default_round_size(N, M)`).
        shard: (rank, world) when the masters and optimizer moments are sharded over `world` data-parallel
            servers: they count only rank `rank`'s slice of each layer group's flat buffer
            (`rpcompile.ir.host_layout.shard_slices`, what the runtime allocates; for an nn.Module, its
            slice of all trainable elements); compute copies and gradient buffers stay whole. Rank 0
            owns the largest slices. None (or world 1): the whole state.
    Returns:
        A HostBytes; `str()` of it lists the categories.

    >>> import torch
    >>> frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    >>> host_bytes(frozen, microbatches=1).total   # compute copies only: 20 fp32 elements
    80
    >>> [host_bytes(torch.nn.Linear(4, 8), microbatches=1, shard=(r, 2)).masters for r in (0, 1)]  # 40: 32 + 8
    [128, 32]
    """
    rank, world = _shard(shard)
    state = 0 if isinstance(optimizer, SGD) and optimizer.momentum == 0 else 1 if isinstance(optimizer, SGD) \
        else _ADAM_MOMENTS
    state_size = getattr(optimizer, "state_dtype", torch.float32).itemsize  # SGD's momentum: fp32
    master_size, grad_size = master_dtype(optimizer).itemsize, grad_dtype(optimizer).itemsize
    # a bf16 master, or a split one's bf16 half, is the second buffer bf16 compute copies alternate with
    split = split_masters(optimizer, shard, staleness)
    bf16_master = (master_dtype(optimizer) == torch.bfloat16 and world == 1) or split
    weights = trainable = params = own_weights = 0
    bf16_copies = True  # every trainable compute copy is bf16
    for numel, own, train in _parameters(model):
        bf16_copies = bf16_copies and (not train or (dtype or own) == torch.bfloat16)
        weights += numel * (dtype or own).itemsize
        trainable += numel if train else 0
        own_weights += numel * (dtype or own).itemsize if train else 0
    params, fp32, flat = trainable, torch.float32.itemsize, (trainable,)  # an nn.Module: one flat buffer
    if hasattr(model, "param_owners"):  # the exact layout HostState allocates
        layout = _layout(model, dtype)
        exact = layout.bytes(state, state_size)
        weights, trainable, own_weights = exact["weights"], exact["grads"] // fp32, exact["trainable_weights"]
        flat = layout.flat  # one per layer group
        second = sum((s.stop - s.start) * s.dtype.itemsize for segs in layout.segments  # groups whose copies
                     if not (bf16_master and all(s.dtype == torch.bfloat16 for s in segs)) for s in segs)  # get a B
    else:
        second = 0 if bf16_master and bf16_copies else own_weights
    own = sum(hi - lo for lo, hi in (shard_slices(n, world)[rank] for n in flat))  # this rank's slices
    saved = in_flight = 0
    if plan is not None:
        if gpus is None:
            raise ValueError("host_bytes: gpus is needed with a plan (the rounds' saved inputs depend on it)")
        saved, in_flight = round_saved_bytes(list(costs.saved_bytes), plan, gpus, microbatches, round_size)
    # a bf16 master with bf16 compute copies is the second buffer they alternate with (runtime/host/layout.py)
    return HostBytes(weights, own * master_size, trainable * grad_size, own * state_size * state, saved,
                     in_flight, trainable=params, trainable_weights=own_weights, master_size=master_size,
                     split=split, servers=world, undo=(second if world == 1 else own_weights) if staleness == 1 else 0)


def _shard(shard: Any) -> tuple[int, int]:
    """(rank, world) of `host_bytes`'s `shard` (None: (0, 1)), checked."""
    if shard is None:
        return 0, 1
    ok = isinstance(shard, tuple) and len(shard) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                               for v in shard)
    if not ok or not 0 <= shard[0] < shard[1]:
        raise ValueError(f"host_bytes: shard must be (rank, world) with 0 <= rank < world, got {shard!r}")
    return shard


def round_saved_bytes(saved: list[int], plan: StagePlan, gpus: int, microbatches: int,
                      round_size: int | None = None) -> tuple[int, int]:
    """Host bytes of saved stage inputs at once, and the round size R (see module Note).

    Args:
        saved: bytes of each layer's saved input (`CostTable.saved_bytes`) for one microbatch.
        plan: its backward stages keep one saved input each per microbatch.
        gpus, microbatches: N and M; rounds hold R microbatches.
        round_size: R (default `default_round_size(N, M)`).
    Returns:
        (R x all backward stages' inputs + R x those of the last N - 1 backward stages, R).

    >>> round_saved_bytes([10, 10, 10], StagePlan.from_str("1,1|1|1,1"), gpus=2, microbatches=4)
    (60, 2)
    """
    r = round_size or default_round_size(gpus, microbatches)
    per = [saved[b.start] for b in plan.bwd]  # execution order: the last ones hold the lowest layers
    tail = per[len(per) - min(len(per), gpus - 1):] if gpus > 1 else []
    return r * (sum(per) + sum(tail)), r


def compute_blocks(graph: Any, dtype: Any = None) -> dict[tuple, int]:
    """Bytes of each compute-copy block of a traced graph, as `HostState` allocates (and pins) them.

    One block per (lowest owner layer, training dtype): the group's trainable parameters first, at
    their offsets in its flat buffers, then the frozen ones, each view on a 16-byte boundary
    (`rpcompile.ir.host_layout`); a parameter no layer uses goes to layer 0.
    """
    return {key: n * key[1].itemsize for key, n in _layout(graph, dtype).blocks.items()}


def _parameters(model: Any):
    """(elements, dtype, trainable) per parameter of a LayerGraph or an nn.Module."""
    if hasattr(model, "param_owners"):
        owners = model.param_owners()
        for name, v in model.params.items():
            yield v.bytes // max(v.dtype.itemsize, 1), v.dtype, bool(v.requires_grad and owners.get(name))
    else:
        for p in model.parameters():
            yield p.numel(), p.dtype, p.requires_grad


def _layout(graph: Any, dtype: Any):
    """The HostLayout of a LayerGraph's parameters, as HostState builds it."""
    owners = graph.param_owners()
    return host_layout([(name, v.bytes // max(v.dtype.itemsize, 1), dtype or v.dtype, (owners.get(name) or (0,))[0],
                         bool(v.requires_grad and owners.get(name))) for name, v in graph.params.items()],
                       len(graph.layers))


def _gib(n: int) -> str:
    """Bytes in GiB (MiB below 1 GiB), one decimal."""
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"
