"""The runtime's host transfer buffers, counted before it runs: gradient staging and the host pool's buffers.

Besides the HostState (`passes.cost.host_bytes`), a training run holds host buffers for the
transfers, pinned at their exact size with CUDA workers (`runtime.host.pinned`):

- gradient staging (`HostLanes.staging_for`, `runtime.host.staging`): a ring of K buffers shared by
  every stage, each holding the largest accumulation unit (chunks of a slot that share no
  parameter with the rest of it) per training dtype, its gradients 16-byte aligned;
- the host arena (`runtime.host.assign`): one buffer per downloaded value and microbatch (an F
  stage's outputs that later stages read, the saved inputs of backward stages among them, a
  backward stage's input gradients), placed by the buffer assignment so that buffers never live at
  once share bytes; the runtime allocates the arena once and binds each buffer as a view of it;
- the host pool (`IssueHandlers`): the losses, one scalar per microbatch, and two buffers per batch
  input and microbatch that an upload reads (by iteration parity), for the whole run.

`pool_buffers` lists every keyed host buffer with its shape and dtype, and the runtime binds
exactly those, each to its key from the first iteration on (evaluations reuse them);
`transfer_bytes` counts the staging, the arena and the pool's own buffers. So what admission
counts is what is allocated, in every plan and however the threads interleave. Shapes are the traced ones per microbatch; a computed floating
value is planned at the wider of its traced dtype and the training dtype, which is what it is
at run time or holds it (a model kept in fp32 for a bf16 run: its activations run in bf16 inside
fp32-sized buffers, which admission counts).

    >>> need = transfer_bytes(graph, program)                        # doctest: +SKIP
    >>> need.staging, need.arena, need.pool                          # doctest: +SKIP
    (107136, 16384, 1168)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rpcompile.ir.host_layout import nbytes, per_mb
from rpcompile.runtime.host.assign import assign_buffers
from rpcompile.runtime.host.staging import graph_staging
from rpcompile.runtime.stage.cuts import count_readers, stage_io

__all__ = ["TransferBytes", "transfer_bytes", "pool_buffers", "arena_key", "arena_views", "per_mb", "nbytes"]


@dataclass(frozen=True, slots=True)
class TransferBytes:
    """Host bytes of the runtime's transfer buffers (see the module docstring)."""

    staging: int  # gradient staging: the ring of K buffers (`runtime.host.staging`)
    pool: int  # the host pool's own buffers: batch inputs and losses
    arena: int = 0  # the host arena of the values crossing cuts (`runtime.host.assign`)
    unshared: int = 0  # what the arena's buffers would hold one each (before the assignment: all of them)

    @property
    def total(self) -> int:
        """All of them, in bytes."""
        return self.staging + self.pool + self.arena


def transfer_bytes(graph: Any, program: Any, dtype: torch.dtype | None = None,
                   assignment: Any = None) -> TransferBytes:
    """Host bytes of a training run's transfer buffers, as the runtime allocates them.

    Args:
        graph: the traced LayerGraph the program's plan covers.
        program: the Program (`rpcompile.passes.emit`).
        dtype: training dtype of the compute copies (None: each parameter's own).
        assignment: the program's `BufferAssignment` (None: `runtime.host.assign.assign_buffers` makes it).
    Returns:
        A TransferBytes.
    """
    io = stage_io(graph, program.plan)
    readers = count_readers(program, io)
    staging = graph_staging(graph, program, io, dtype).bytes
    pool = _pool_buffers(graph, program, dtype, io, readers)  # the stages' values and readers counted once
    own = sum(nbytes(*b) for k, b in pool.items() if arena_key(k) is None)
    if assignment is None:
        assignment = assign_buffers(graph, program, dtype)
    return TransferBytes(staging, own, assignment.arena, assignment.total)


def arena_key(key: tuple) -> tuple | None:
    """The assignment's key (`HostBuffer.key`) of a host pool key that lives in the arena, else None."""
    return key[1:] if key[0] == "t" and key[1] != "loss" else None


def arena_views(assignment: Any, arena: torch.Tensor, keys: Any) -> dict[tuple, torch.Tensor]:
    """Host pool key -> its buffer as a view of the byte `arena`, for every key of `keys` that `assignment`
    places there (the others are the pool's own)."""
    placed = assignment.by_key()
    out = {}
    for k in keys:
        b = placed.get(arena_key(k))
        if b is not None:
            out[k] = arena[b.offset:b.end].view(b.dtype).view(b.shape)
    return out



def pool_buffers(graph: Any, program: Any, dtype: torch.dtype | None = None) -> dict[tuple, tuple[tuple, torch.dtype]]:
    """The host pool's buffers in a training run, by the pool key the runtime gives each: -> (shape, dtype).

    A downloaded value has one buffer per microbatch, ("t", "a", mb, name) for an F stage's output
    and ("t", "g", mb, layer, name) for the gradient a backward stage sends across the cut after
    `layer`, if an upload reads it; the fused stage's loss ("t", "loss", mb); a batch input that an
    upload reads two per microbatch, ("in", parity, mb, name, shape, dtype). Shapes are the traced
    ones per microbatch (`per_mb`); a downloaded floating value is planned at the wider of its traced
    dtype and `dtype` (the module docstring), a batch input at its traced dtype. The runtime
    allocates exactly these (`IssueHandlers`); an evaluation reuses them.

    Args:
        graph: the traced LayerGraph the program's plan covers.
        program: the Program (`rpcompile.passes.emit`).
        dtype: training dtype of the compute copies (None: each parameter's own).
    Returns:
        pool key -> (shape, dtype); `nbytes(shape, dtype)` is what a buffer holds.
    """
    io = stage_io(graph, program.plan)
    return _pool_buffers(graph, program, dtype, io, count_readers(program, io))


def _pool_buffers(graph: Any, program: Any, dtype: torch.dtype | None, io: list, readers: dict) -> dict:
    """`pool_buffers`, given the program's `stage_io` and `count_readers`."""
    m = program.microbatches
    out: dict[tuple, tuple[tuple, torch.dtype]] = {}
    for i in program.instrs:
        if i.op != "D":  # str enums equal their values
            continue
        st = io[i.stage]
        if st.kind == "F":
            down = {("a", i.mb, n): n for n in st.down}
        else:
            down = {("g", i.mb, st.layers.start - 1, n): n for n in st.grad_out}
        out.update({("t",) + k: per_mb(graph.values[n], m, dtype) for k, n in down.items() if readers.get(k, 0)})
        if st.kind == "FB":
            out[("t", "loss", i.mb)] = per_mb(graph.values[graph.loss], m, dtype)
    for j in range(m):
        for n in graph.inputs:
            if readers.get(("a", j, n), 0):
                shape, dtype = per_mb(graph.values[n], m)
                out.update({("in", parity, j, n, shape, dtype): (shape, dtype) for parity in (0, 1)})
    return out
