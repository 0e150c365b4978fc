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

import ctypes
import hashlib
import os
from typing import Any

import torch

from rpcompile.ir.clib import CLibrary
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
        if st.kind == "F":  # a str enum equals its value
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
    iterations) c's readers before b's writer of iteration 1 (the module docstring says why that is enough).

    Every reader is an upload, on a lane the clocks track, and a lane runs its instructions in order: so all
    of b's readers happen before c's writer exactly when, lane by lane, the latest of them there is at or
    before the position c's writer's clock holds for that lane.
    """
    owner = torch.tensor([k for k, b in enumerate(buffers) for _ in b.readers], dtype=torch.long)
    reads = torch.tensor([hb.pos[r] for b in buffers for r in b.readers], dtype=torch.long)
    writes = torch.tensor([hb.pos[b.writer] for b in buffers], dtype=torch.long)
    k = hb.clock.shape[1]

    # [b, lane]: the latest position on each lane of b's readers in window iteration 0 (-1: none)
    lane = hb.lane[reads]
    if bool((lane < 0).any()):
        raise ValueError("a buffer's reader runs on a lane the happens-before does not track")
    readers = torch.full((len(buffers) * k,), -1, dtype=torch.int32)
    readers = readers.scatter_reduce_(0, owner * k + lane, hb.step[reads], "amax").view(len(buffers), k)
    clocks = hb.clock.view(hb.iterations, hb.size, k)  # [window iteration, instruction, lane]
    ok = _dominated(readers, clocks[0, writes])
    if hb.iterations > 1:  # and c(0)'s readers before b(1)'s writer
        _and_dominated_t(ok, readers, clocks[1, writes])
    return ok


def _dominated(rows: torch.Tensor, cols: torch.Tensor, native: bool = True) -> torch.Tensor:
    """[b, c] bool: every entry of rows[b] is <= the same entry of cols[c] (int32 rows, in C where it builds)."""
    lib = _library() if native else None
    rows, cols = rows.contiguous(), cols.contiguous()
    out = torch.zeros(len(rows), len(cols), dtype=torch.bool)
    if lib is not None and out.numel():
        lib.rp_dominated(len(rows), len(cols), rows.shape[1], rows.data_ptr(), cols.data_ptr(), out.data_ptr())
        return out
    for lo in range(0, len(rows), 256):  # [256, c, lanes] at a time
        out[lo:lo + 256] = (rows[lo:lo + 256, None, :] <= cols[None, :, :]).all(-1)
    return out


def _and_dominated_t(ok: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> None:
    """ok &= `_dominated(rows, cols)`.T, in place (square; in C where it builds, testing only the entries still
    True)."""
    lib = _library()
    rows, cols = rows.contiguous(), cols.contiguous()
    if lib is not None and ok.numel():
        assert ok.is_contiguous() and ok.shape == (len(rows), len(cols)) == (len(cols), len(rows))
        lib.rp_and_dominated_t(len(rows), rows.shape[1], rows.data_ptr(), cols.data_ptr(), ok.data_ptr())
        return
    ok &= _dominated(rows, cols, native=False).T


def assign_buffers(graph: Any, program: Program, dtype: torch.dtype | None = None,
                   unplaced: BufferAssignment | None = None) -> BufferAssignment:
    """Place every per-microbatch host buffer of `program` in one arena (best-fit by size, largest first).

    Args:
        graph: the traced LayerGraph the program's plan covers.
        program: the Program (`rpcompile.passes.emit`).
        dtype: training dtype (None: each value's own), as for `runtime.host.buffers.transfer_bytes`.
        unplaced: `unshared(graph, program, dtype)` if the caller has it: its buffers and fingerprint are
            this program's (not computed again), its offsets are ignored.
    Returns:
        A BufferAssignment whose arena is what the runtime allocates.
    """
    if unplaced is None:
        bufs, digest = live_buffers(graph, program, dtype), fingerprint(program)
    else:
        bufs, digest = list(unplaced.buffers), unplaced.program  # their offsets are not read: placed anew below
    ok = apart(bufs, program) if bufs else torch.zeros(0, 0, dtype=torch.bool)
    size = [_up(b.bytes) for b in bufs]
    pos = {i.name: k for k, i in enumerate(program.instrs)}
    order = sorted(range(len(bufs)), key=lambda k: (-size[k], pos[bufs[k].writer], k))
    offset = _pack(order, size, ok)
    at = offset.tolist()
    out = tuple(HostBuffer(b.key, b.shape, b.dtype, at[k], b.writer, b.readers) for k, b in enumerate(bufs))
    arena = max((at[k] + size[k] for k in range(len(bufs))), default=0)
    return BufferAssignment(digest, out, arena, _peak(bufs, size, ok, pos))


def unshared(graph: Any, program: Program, dtype: torch.dtype | None = None) -> BufferAssignment:
    """The assignment that shares nothing: every buffer on its own bytes, one after another (one buffer per
    value and microbatch, as before the pass). Valid for any program; its arena bounds every other's. Its
    `peak` is 0: no live ranges are compared (that is what makes it cheap)."""
    bufs, top = [], 0
    for b in live_buffers(graph, program, dtype):
        bufs.append(HostBuffer(b.key, b.shape, b.dtype, top, b.writer, b.readers))
        top += _up(b.bytes)
    return BufferAssignment(fingerprint(program), tuple(bufs), top, 0)  # peak 0: not computed


def _pack(order: list[int], size: list[int], ok: torch.Tensor) -> torch.Tensor:
    """[n] offsets: best-fit placement in `order` (in C where it builds): each buffer goes into the smallest
    gap between the placed buffers it may not share with (`ok` False), the first such gap in (start, end)
    order, or on top of them."""
    n = len(size)
    offset = torch.zeros(n, dtype=torch.long)
    sizes = torch.tensor(size, dtype=torch.long)
    lib = _library()
    if lib is not None and n:
        at, ok = torch.tensor(order, dtype=torch.int32), ok.contiguous()  # held while C reads them
        rc = lib.rp_pack(n, at.data_ptr(), sizes.data_ptr(), ok.data_ptr(), offset.data_ptr())
        if rc != 0:
            raise MemoryError(f"the buffer packing kernel could not allocate its work space for {n} buffers")
        return offset
    placed = torch.zeros(n, dtype=torch.bool)
    for k in order:
        clash = (placed & ~ok[k]).nonzero().flatten()
        lo, hi = offset[clash], offset[clash] + sizes[clash]
        by = torch.argsort(hi, stable=True)
        by = by[torch.argsort(lo[by], stable=True)]  # by start, then end
        offset[k] = _best_fit(lo[by], hi[by], size[k])
        placed[k] = True
    return offset


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
          starts: int = 8, every: int = 512) -> int:
    """The heaviest set of buffers found that can all be live at once: a greedy clique of the `apart`
    complement grown from the buffers live together at the worst point of the program in its own order (a
    legal interleaving), or from any one buffer (up to `every` buffers; beyond, from one of the `starts`
    largest, the lowest index on a tie). They need distinct bytes, so no assignment of these live ranges
    needs less."""
    if not size:
        return 0
    events = sorted([(pos[b.writer], 0, k) for k, b in enumerate(buffers)]
                    + [(max(pos[r] for r in b.readers), 1, k) for k, b in enumerate(buffers)])
    live, top, at = 0, 0, -1
    for x, (_, end, k) in enumerate(events):  # at one instruction the write comes before a read ends
        live += -size[k] if end else size[k]
        if live > top:
            top, at = live, x
    now: set[int] = set()  # the buffers live just after event `at`
    for _, end, k in events[:at + 1]:
        (now.discard if end else now.add)(k)
    worst = (top, sorted(now))
    firsts = range(len(size)) if len(size) <= every else sorted(range(len(size)), key=lambda k: -size[k])[:starts]
    return _clique([worst[1]] + [[k] for k in firsts], size, ok)


def _clique(seeds: list[list[int]], size: list[int], ok: torch.Tensor) -> int:
    """The heaviest greedy clique of buffers that can be live together (`ok` False), grown from each seed (buffers
    that can all be live at once) by the heaviest one left (the lowest index on a tie); in C where it builds."""
    lib = _library()
    if lib is not None:
        ptr = torch.tensor([0] + [len(s) for s in seeds], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        held = (ptr, torch.tensor([k for s in seeds for k in s] or [0], dtype=torch.int32),
                torch.tensor(size, dtype=torch.long), ok.contiguous())  # held while C reads them
        got = lib.rp_clique(len(size), len(seeds), *(h.data_ptr() for h in held))
        if got == -1:
            raise MemoryError(f"the clique kernel could not allocate its work space for {len(size)} buffers")
        return got
    weight = torch.tensor(size, dtype=torch.float64)
    together = ~ok
    together.fill_diagonal_(False)
    best = 0
    for seed in seeds:
        mask, total = torch.ones(len(size), dtype=torch.bool), 0
        for k in seed:
            mask &= together[k]
            total += size[k]
        while bool(mask.any()):
            j = int(torch.argmax(torch.where(mask, weight, -1.0)))  # the heaviest left (empty ones too)
            total += size[j]
            mask &= together[j]
        best = max(best, total)
    return best


LIBRARY = CLibrary("rpcompile_assign", sources=(os.path.join(os.path.dirname(os.path.abspath(__file__)), "assign.c"),),
                   switch="RPCOMPILE_ASSIGN_KERNEL")


def _library() -> ctypes.CDLL | None:
    """assign.c, built once per machine (None without a C compiler or with RPCOMPILE_ASSIGN_KERNEL=0)."""
    lib = LIBRARY.load()
    if lib is not None:
        p, i32 = ctypes.c_void_p, ctypes.c_int
        lib.rp_dominated.restype = None
        lib.rp_dominated.argtypes = [i32, i32, i32, p, p, p]
        lib.rp_pack.restype = i32
        lib.rp_pack.argtypes = [i32, p, p, p, p]
        lib.rp_clique.restype = ctypes.c_longlong
        lib.rp_clique.argtypes = [i32, i32, p, p, p, p]
        lib.rp_and_dominated_t.restype = None
        lib.rp_and_dominated_t.argtypes = [i32, i32, p, p, p]
    return lib


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
