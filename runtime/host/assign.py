"""Host buffer assignment: live ranges from the program's happens-before order, packed into one byte arena.

The runtime downloads each value that crosses a cut (an F stage's outputs and the saved inputs of
backward stages; a backward stage's input gradients) into a host buffer per microbatch, which the
uploads of later stages read (`runtime.host.buffers`). Such a buffer is live from its download (the
writer) until every upload that reads it has run. This pass gives each one a byte offset in one
arena, as XLA's buffer assignment and TVM's static memory planner do:

- live ranges come from `passes.order.HappensBefore`, never from one simulated timeline. Two
  buffers b and c may share bytes only when, in every iteration t, b's readers all happen before
  c's writer and c's readers before b's writer of iteration t + 1 (or the same with b and c
  swapped): then their lives alternate on every interleaving of the workers and lanes. It is
  checked on logical iterations 0 and 1, where the fewest dependencies apply (a `Ref` reaching
  before iteration 0, or with `since` > t, is vacuous): every edge there has its copy in any later
  pair of iterations, so what holds at t = 0 holds at every t. An evaluation runs the forward half
  alone between flushes (`runtime.program_info.forward_only`); a pair must also be apart there.
- packing is best-fit by size, largest first (TVM's planner): each buffer goes into the smallest
  gap between the buffers it may not share with, or on top. Offsets are multiples of
  `ARENA_ALIGN`.
- the result is a `BufferAssignment` (plain data, printable); `check_assignment` is its verifier:
  it recomputes the live ranges from the program and rejects an assignment in which two buffers
  that can be live at once share a byte, or one built for another program.

The runtime allocates the arena once (pinned at its exact size with CUDA workers) and binds each
buffer as a view at its offset. The batch inputs an upload reads and the losses are not in the
arena: they are two buffers per input (by iteration parity) and one scalar per microbatch that
live for the whole run (`runtime.host.buffers.pool_buffers`).

    >>> import torch                                                         # doctest: +SKIP
    >>> a = assign_buffers(graph, program, torch.bfloat16)                   # doctest: +SKIP
    >>> a.arena <= a.total, check_assignment(a, graph, program, torch.bfloat16) is a   # doctest: +SKIP
    (True, True)
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from rpcompile.ir.host_layout import ARENA_ALIGN, BufferAssignment, HostBuffer, per_mb
from rpcompile.ir.program import Lane, Op, Program, ProgramError
from rpcompile.passes.order import HappensBefore
from rpcompile.runtime.program_info import forward_only
from rpcompile.runtime.stage.cuts import stage_io, up_keys

__all__ = ["assign_buffers", "unshared", "check_assignment", "fingerprint", "live_buffers", "apart"]



def fingerprint(program: Program) -> str:
    """A short hash of everything in `program` that decides live ranges (plan, shape, instructions)."""
    h = hashlib.sha1(f"{program.plan.to_str()}|{program.gpus}|{program.microbatches}|{program.round_size}|"
                     f"{program.staleness}|{program.worker_offset}|{program.next_offset}".encode())
    for i in program.instrs:
        h.update(str(i).encode())
        h.update(b"\n")
    return h.hexdigest()[:12]


def live_buffers(graph: Any, program: Program, dtype: torch.dtype | None = None) -> list[HostBuffer]:
    """Every per-microbatch host buffer of `program` with its writer and readers, unplaced (offset 0).

    Shapes and dtypes are those the runtime binds (`rpcompile.ir.host_layout.per_mb`: the traced shape per
    microbatch, a floating value at the wider of its own dtype and the training `dtype`).
    """
    io = stage_io(graph, program.plan)
    readers: dict[tuple, list[str]] = {}
    for i in program.instrs:
        if i.op is Op.ACT_UP:
            for k in up_keys(io, i):
                readers.setdefault(k, []).append(i.name)
    out = []
    for i in program.instrs:
        if i.op is not Op.ACT_DOWN:
            continue
        st = io[i.stage]
        if st.kind.value == "F":
            keys = [(("a", i.mb, n), n) for n in st.down]
        else:
            keys = [(("g", i.mb, st.layers.start - 1, n), n) for n in st.grad_out]
        for k, n in keys:
            if k in readers:
                shape, dt = per_mb(graph.values[n], program.microbatches, dtype)
                out.append(HostBuffer(k, shape, dt, 0, i.name, tuple(readers[k])))
    return out


def _order(program: Program, iterations: int = 2) -> HappensBefore:
    """The happens-before the live ranges are read from: logical iterations from 0, clocks of the uploads' lanes."""
    return HappensBefore(program, first=0, iterations=iterations, track=frozenset({Lane.ACT_UP}))


def apart(buffers: list[HostBuffer], program: Program) -> torch.Tensor:
    """[n, n] bool: whether buffers i and j are never live at once (may share bytes); see the module docstring."""
    n = len(buffers)
    ok = _alternate(buffers, _order(program))
    ok = ok | ok.T  # b then c, or c then b
    ev = forward_only(program)
    names = {i.name for i in ev.instrs}
    kept = [k for k, b in enumerate(buffers) if b.writer in names and any(r in names for r in b.readers)]
    if kept:  # an evaluation downloads these: they must be apart in its one iteration too
        sub = [HostBuffer(b.key, b.shape, b.dtype, 0, b.writer, tuple(r for r in b.readers if r in names))
               for b in (buffers[k] for k in kept)]
        once = _alternate(sub, _order(ev, 1))
        once = once | once.T
        idx = torch.tensor(kept)
        block = ok[idx][:, idx] & once
        ok[idx.unsqueeze(1), idx.unsqueeze(0)] = block
    ok.fill_diagonal_(False)
    assert ok.shape == (n, n)
    return ok


def _alternate(buffers: list[HostBuffer], hb: HappensBefore) -> torch.Tensor:
    """[n, n] bool: b's readers happen before c's writer in logical iteration 0 and (with a window of two
    iterations) c's readers before b's writer of iteration 1 (the module docstring says why that is enough)."""
    n = len(buffers)
    readers = sorted({r for b in buffers for r in b.readers})  # distinct uploads (one reads several values)
    at = {r: k for k, r in enumerate(readers)}
    few = 4  # the first readers of every buffer go row-wise, the rest of a widely read one buffer by buffer
    slots = [(torch.tensor([len(b.readers) > j for b in buffers]),
              torch.tensor([at[b.readers[j]] for b in buffers if len(b.readers) > j], dtype=torch.long))
             for j in range(min(few, max((len(b.readers) for b in buffers), default=0)))]
    many = [(k, torch.tensor([at[r] for r in b.readers[few:]], dtype=torch.long))
            for k, b in enumerate(buffers) if len(b.readers) > few]

    def first(tr: int, tw: int) -> torch.Tensor:
        """[b, c]: every reader of b in window iteration tr happens before c's writer in iteration tw."""
        r = torch.tensor([hb.node(tr, x) for x in readers], dtype=torch.long)
        w = torch.tensor([hb.node(tw, b.writer) for b in buffers], dtype=torch.long)
        lanes = hb.clock[w].T.contiguous()  # [lane, c]: the latest node of each lane before c's writer
        before = lanes[hb.lane[r]] >= hb.step[r].unsqueeze(1)  # [reader, c]
        ok = torch.ones(n, n, dtype=torch.bool)
        for mask, rows in slots:  # the j-th reader of every buffer that has one
            if len(rows) == n:
                ok &= before[rows]
            else:
                ok[mask] &= before[rows]
        for k, rows in many:
            ok[k] &= before[rows].all(0)
        return ok

    ok = first(0, 0)
    if hb.iterations > 1:  # and c(0)'s readers before b(1)'s writer
        ok &= first(0, 1).T
    return ok


def assign_buffers(graph: Any, program: Program, dtype: torch.dtype | None = None) -> BufferAssignment:
    """Place every per-microbatch host buffer of `program` in one arena (best-fit by size, largest first).

    Args:
        graph: the traced LayerGraph the program's plan covers.
        program: the Program (`rpcompile.passes.emit`).
        dtype: training dtype (None: each value's own), as for `runtime.host.buffers.transfer_bytes`.
    Returns:
        A BufferAssignment whose arena is what the runtime allocates.
    """
    bufs = live_buffers(graph, program, dtype)
    ok = apart(bufs, program) if bufs else torch.zeros(0, 0, dtype=torch.bool)
    size = [_up(b.bytes) for b in bufs]
    pos = {i.name: k for k, i in enumerate(program.instrs)}
    order = sorted(range(len(bufs)), key=lambda k: (-size[k], pos[bufs[k].writer], k))
    offset = torch.zeros(len(bufs), dtype=torch.long)
    sizes = torch.tensor(size, dtype=torch.long)
    placed = torch.zeros(len(bufs), dtype=torch.bool)
    for k in order:
        clash = (placed & ~ok[k]).nonzero().flatten()
        lo = offset[clash]
        by = torch.argsort(lo)
        offset[k] = _best_fit(lo[by], (lo + sizes[clash])[by], size[k])
        placed[k] = True
    at = offset.tolist()
    out = tuple(HostBuffer(b.key, b.shape, b.dtype, at[k], b.writer, b.readers) for k, b in enumerate(bufs))
    arena = max((at[k] + size[k] for k in range(len(bufs))), default=0)
    return BufferAssignment(fingerprint(program), out, arena, _peak(bufs, size, ok, pos))


def unshared(graph: Any, program: Program, dtype: torch.dtype | None = None) -> BufferAssignment:
    """The assignment that shares nothing: every buffer on its own bytes, one after another (one buffer per
    value and microbatch, as before the pass). Valid for any program; its arena bounds every other's. Its
    `peak` is 0: no live ranges are compared (that is what makes it cheap)."""
    bufs, top = [], 0
    for b in live_buffers(graph, program, dtype):
        bufs.append(HostBuffer(b.key, b.shape, b.dtype, top, b.writer, b.readers))
        top += _up(b.bytes)
    return BufferAssignment(fingerprint(program), tuple(bufs), top, 0)  # peak 0: not computed


def _best_fit(starts: torch.Tensor, ends: torch.Tensor, n: int) -> int:
    """The start of the smallest gap of at least n bytes between the taken intervals [starts, ends) (sorted by
    start; the first such gap on a tie), or the top of them."""
    if not len(starts):
        return 0
    top = torch.cummax(ends, 0).values
    below = torch.cat([top.new_zeros(1), top[:-1]])  # the top of the intervals before each one
    gap = starts - below
    fits = gap >= n
    if not bool(fits.any()):
        return int(top[-1])
    return int(below[torch.argmin(torch.where(fits, gap, gap.new_full((), 2**62)))])


def _peak(buffers: list[HostBuffer], size: list[int], ok: torch.Tensor, pos: dict[str, int],
          starts: int = 8) -> int:
    """The heaviest set of buffers found that can all be live at once: those live together at the worst point
    of the program in its own order (a legal interleaving), or a greedy clique of the `apart` complement
    from one of the `starts` largest buffers, whichever is heavier. They need distinct bytes, so no
    assignment of these live ranges needs less."""
    if not size:
        return 0
    events = sorted([(pos[b.writer], 0, k) for k, b in enumerate(buffers)]
                    + [(max(pos[r] for r in b.readers), 1, k) for k, b in enumerate(buffers)])
    live = swept = 0
    for _, end, k in events:  # at one instruction the write comes before a read ends
        live += -size[k] if end else size[k]
        swept = max(swept, live)
    weight = torch.tensor(size, dtype=torch.float64)
    together = ~ok
    together.fill_diagonal_(False)
    best = 0
    for first in torch.argsort(weight, descending=True)[:starts].tolist():
        mask, total = together[first].clone(), size[first]
        while bool(mask.any()):
            j = int(torch.argmax(torch.where(mask, weight, -1.0)))  # the heaviest left (empty ones too)
            total += size[j]
            mask &= together[j]
        best = max(best, total)
    return max(best, swept)


def _up(n: int) -> int:
    """n rounded up to a multiple of ARENA_ALIGN."""
    return -(-n // ARENA_ALIGN) * ARENA_ALIGN


def check_assignment(assignment: BufferAssignment, graph: Any, program: Program,
                     dtype: torch.dtype | None = None) -> BufferAssignment:
    """The assignment's verifier: return it unchanged when it is valid for `program`.

    Raises:
        ProgramError: rule "BUFFERS", naming the buffer: built for another program; a buffer missing,
            extra, or with another shape, dtype or live range than the program gives it; an offset off
            the alignment or past the arena; two buffers that can be live at once sharing a byte.
    """
    if assignment.program != fingerprint(program):
        raise ProgramError("BUFFERS", None, f"the assignment was built for program {assignment.program}, "
                                            f"not this one ({fingerprint(program)})")
    want = {b.key: b for b in live_buffers(graph, program, dtype)}
    have = assignment.by_key()
    for k in sorted(set(want) ^ set(have), key=str)[:1]:
        raise ProgramError("BUFFERS", (want.get(k) or have[k]).writer,
                           f"buffer {k} is {'missing from' if k in want else 'not in'} the program's host buffers")
    for k, b in have.items():
        w = want[k]
        if (b.shape, b.dtype, b.writer, set(b.readers)) != (w.shape, w.dtype, w.writer, set(w.readers)):
            raise ProgramError("BUFFERS", b.writer, f"buffer {k} is {b.shape} {b.dtype} live {b.writer} -> "
                               f"{b.readers}; the program gives {w.shape} {w.dtype} live {w.writer} -> {w.readers}")
        if b.offset % ARENA_ALIGN or b.offset < 0 or b.end > assignment.arena:
            raise ProgramError("BUFFERS", b.writer, f"buffer {k} at bytes [{b.offset}, {b.end}) is not aligned to "
                                                    f"{ARENA_ALIGN} or not inside the arena of {assignment.arena}")
    bufs = list(assignment.buffers)
    ok = apart(bufs, program)
    by_start = sorted(range(len(bufs)), key=lambda k: bufs[k].offset)
    for x, k in enumerate(by_start):
        for j in by_start[x + 1:]:
            if bufs[j].offset >= bufs[k].end:
                break
            if bufs[j].bytes and bufs[k].bytes and not ok[k, j]:
                raise ProgramError("BUFFERS", bufs[j].writer,
                                   f"buffers {bufs[k].key} and {bufs[j].key} share bytes [{bufs[j].offset}, "
                                   f"{min(bufs[j].end, bufs[k].end)}) but can be live at once")
    return assignment
