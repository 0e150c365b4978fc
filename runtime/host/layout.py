"""Flat memory layouts: host blocks per layer group, device slots per stage, chunk copy plans, and the
alternating second home of the blocks' trainable part at staleness 1 (`Alternation`).

Host: the compute copies of one layer group (per dtype) are views into one
block, so pinning costs one allocation per group (`pin_memory` rounds every
allocation up). Device: a stage's parameters are views into one flat buffer
per dtype, and its trainable parameters' gradients into another; a P or G
chunk is then a few contiguous range copies instead of one per tensor.

Every view starts at a multiple of `ALIGN` (16) bytes from its buffer's start
(the buffers themselves are allocated aligned): vectorised kernels (128-bit
loads, the fused optimizers, cuBLAS) and copies want aligned operands, and a
view after, say, a bias of 3 fp16 values would not be. The gaps are a few
bytes per tensor and are never read.

    >>> blocks, where = host_blocks({"a": torch.ones(3), "b": torch.ones(2, 2)}, {"a": 0, "b": 0})
    >>> [tuple(t.shape) for t in blocks.values()], where["b"]
    ([(8,)], ((0, torch.float32), 4))
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rpcompile.runtime.host.pinned import pinned_buffers
from rpcompile.runtime.program_info import EVAL_BASE
from rpcompile.ir.host_layout import ALIGN, aligned, block_offsets

__all__ = ["Slot", "StageLayout", "host_blocks", "stage_layouts", "slot_capacities", "ALIGN", "aligned", "Alternation",
           "AlternatingCopies", "upload_sources"]


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one parameter lives in a flat layout."""

    dtype: torch.dtype
    offset: int  # element offset in the flat buffer of its dtype
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Copy:
    """One contiguous host -> device range of a P chunk."""

    dtype: torch.dtype
    dst: int  # element offset in the stage's flat parameter buffer of `dtype`
    src_block: tuple  # key of the host block it reads
    src: int  # element offset in that block
    numel: int


@dataclass(frozen=True)
class StageLayout:
    """A stage's device layout and the copies of each of its chunks."""

    params: dict[str, Slot]  # every parameter the stage reads
    sizes: dict[torch.dtype, int]  # flat parameter elements per dtype
    grads: dict[str, Slot]  # trainable parameters: where their gradient accumulates
    grad_sizes: dict[torch.dtype, int]
    uploads: dict[int, tuple[Copy, ...]]  # chunk -> its host -> device ranges
    downloads: dict[int, tuple[tuple[torch.dtype, int, int], ...]]  # chunk -> (dtype, lo, hi) gradient ranges


def host_blocks(tensors: Mapping[str, torch.Tensor], layer_of: Mapping[str, int], *, pin: bool = False
                ) -> tuple[dict[tuple, torch.Tensor], dict[str, tuple[tuple, int]]]:
    """One flat block per (layer, dtype) holding copies of `tensors`.

    Args:
        tensors: name -> tensor (copied in; the blocks do not alias them), packed in this order
            (`rpcompile.ir.host_layout.block_offsets`).
        layer_of: name -> the layer group whose block holds it.
        pin: allocate pinned memory: True, or the `pinned.PinnedAllocator` to register it with (exact size).
    Returns:
        (blocks, where): (layer, dtype) -> flat block; name -> ((layer, dtype), element offset).
    """
    where, sizes = block_offsets((n, (layer_of[n], t.dtype), t.numel()) for n, t in tensors.items())
    blocks = dict(zip(sizes, pinned_buffers([(n, k[1]) for k, n in sizes.items()], pin)))  # gaps: zeros;
    # pinned at exact size, or pageable in one block per dtype (on huge pages)
    for n, t in tensors.items():
        key, off = where[n]
        blocks[key][off:off + t.numel()].copy_(t.detach().reshape(-1))
    return blocks, where


def view(blocks: Mapping[tuple, torch.Tensor], where: tuple[tuple, int], shape: tuple) -> torch.Tensor:
    """The tensor of `shape` at `where` inside `blocks`."""
    key, off = where
    n = 1
    for s in shape:
        n *= s
    return blocks[key][off:off + n].view(shape)


def _flat(names, shape_of, dtype_of) -> tuple[dict[str, Slot], dict[torch.dtype, int]]:
    """Aligned slots of `names` in one flat buffer per dtype, and each buffer's elements."""
    slots, sizes = {}, {}
    for n in names:
        d, shape = dtype_of(n), tuple(shape_of(n))
        numel = 1
        for s in shape:
            numel *= s
        slots[n] = Slot(d, aligned(sizes.get(d, 0), d), numel, shape)
        sizes[d] = slots[n].offset + numel
    return slots, sizes


def stage_layouts(program, io, state, chunk_elems) -> dict[int, StageLayout]:
    """The StageLayout of every stage of `program`.

    Args:
        program: the Program (its chunks).
        io: `stage_io` of the program's plan.
        state: the HostState (`read(name)` gives shape and dtype, `where` the host block, `master` trainables).
        chunk_elems: (stage, chunk) -> [(param, start, stop)] element ranges (`chunk_elements`).
    """
    out = {}
    for st in io:
        names = st.params
        params, sizes = _flat(names, lambda n: state.read(n).shape, lambda n: state.read(n).dtype)
        trainable = [n for n in names if state.canonical(n) in state.master]
        grads, grad_sizes = _flat(trainable, lambda n: state.read(n).shape, lambda n: state.read(n).dtype)
        uploads, downloads = {}, {}
        for c in program.stage_chunks(st.index):
            ups: list[Copy] = []
            downs: list[tuple[torch.dtype, int, int]] = []
            for n, a, b in chunk_elems[(st.index, c.index)]:
                p = params[n]
                key, off = state.where[state.canonical(n)]
                _append(ups, Copy(p.dtype, p.offset + a, key, off + a, b - a))
                if n in grads:
                    g = grads[n]
                    lo, hi = g.offset + a, g.offset + b
                    if downs and downs[-1][0] == g.dtype and downs[-1][2] == lo:
                        downs[-1] = (g.dtype, downs[-1][1], hi)
                    else:
                        downs.append((g.dtype, lo, hi))
            uploads[c.index], downloads[c.index] = tuple(ups), tuple(downs)
        out[st.index] = StageLayout(params, sizes, grads, grad_sizes, uploads, downloads)
    return out


def _append(copies: list[Copy], c: Copy) -> None:
    """Add `c`, merged into the previous copy when both ranges continue it."""
    if copies:
        p = copies[-1]
        if p.dtype == c.dtype and p.src_block == c.src_block and p.dst + p.numel == c.dst and p.src + p.numel == c.src:
            copies[-1] = Copy(p.dtype, p.dst, p.src_block, p.src, p.numel + c.numel)
            return
    copies.append(c)


def slot_capacities(program, layouts: dict[int, StageLayout]) -> tuple[dict, dict]:
    """The sizes a worker's buffers need over every iteration, so they are allocated once.

    Each worker alternates two parameter buffers (parity of its slot count: the running and the
    prefetched stage) and keeps one gradient buffer. Iteration t runs template worker w's slots on
    worker (w + t * shift) mod N, so which stage meets which (worker, parity) depends on t mod N and
    on each worker's slot-count parity at the iteration's start: when a worker takes an odd number
    of slots per rotation, the pattern repeats only after several rotations (with 7 stages on 4
    workers, 2N iterations). The iterations are walked from each start t mod N (a resumed run starts
    anywhere) until that state repeats, so the largest stage of each (worker, parity) and (worker)
    is known before the first step.

    Returns:
        ({(worker, parity, dtype): elements}, {(worker, dtype): elements}).
    """
    params: dict = {}
    grads: dict = {}
    n = program.gpus
    slots = [(i.worker, i.stage) for i in program.instrs if i.op.value == "E"]  # one release per slot, in order
    for start in range(n):
        made, seen, t = [0] * n, set(), start
        while (t % n, tuple(m % 2 for m in made)) not in seen:
            seen.add((t % n, tuple(m % 2 for m in made)))
            for w, stage in slots:
                phys = (w + t * program.shift) % n
                parity, lay = made[phys] % 2, layouts[stage]
                made[phys] += 1
                for d, k in lay.sizes.items():
                    params[(phys, parity, d)] = max(params.get((phys, parity, d), 0), k)
                for d, k in lay.grad_sizes.items():
                    grads[(phys, d)] = max(grads.get((phys, d), 0), k)
            t += 1
    return params, grads


# -- alternating copies ---------------------------------------------------------------------------------------
class Alternation:
    """Two buffers for each trainable group's compute copies, trading places every step (staleness 1).

    At staleness 1 iteration t uploads the weights W(t-1) while its step makes W(t+1) from W(t), so the host
    keeps the version the next iteration reads beside the one being made. Two buffers per trainable segment of
    a group do it without a copy pass: A, the block's trainable part (what `HostState.compute` views), and B.
    Step t writes the new compute copies into the buffer iteration t uploaded from (after those uploads, R1),
    and iteration t + 1 uploads from the other, which step t - 1 wrote. Nothing is written before the commit
    (the iteration's first step), so a failed iteration leaves nothing to undo: where the copy pass needed an
    undo copy of what it overwrote, B takes its place, at the same bytes.

    B is the bf16 master itself where the group's masters and every one of its compute copies are bf16 (they
    are interchangeable: the step reads the master from one buffer and writes the new one into the other, out
    of place, so the pair costs 4 bytes a parameter instead of 6); else a buffer of its own, written by the
    update's pass (`out`, the cast the copy pass made) while the master is updated in place.

    Which buffer iteration t uploads from follows from the iteration number: every iteration flips each group
    once (a skipped step copies across what it would have written), so iteration t reads A when t - base is
    even. `settle()`, where nothing is in flight, swaps a group's buffers after an odd number of flips, so that
    A holds the compute copies the next iteration reads and B the master (or its cast): what
    `HostState.compute`, `HostState.master`, `state_dict` and an evaluation read.

    Args:
        state: the HostState (layout, blocks, flat masters, kernels), unsharded (`HostState.alternate`).
        first: the first iteration the runtime runs: it uploads from A.
        pin: `pinned_buffers`'s `pin` for the buffers of their own (uploads read them).

    Attributes:
        pairs: group -> [(A, B)], one per segment (segment-relative views of equal length).
        shared: group -> whether B is the group's bf16 master.
        flips: group -> steps since the last settle; base: group -> an iteration that uploads from A (mod 2).
    """

    def __init__(self, state: Any, first: int, pin: Any) -> None:
        self.state = state
        self.pairs: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.shared: dict[int, bool] = {}
        own = []  # (group, segment index) of each B that is a buffer of its own
        for g, segs in enumerate(state.layout.segments):
            if not state.groups[g]:
                continue
            master = state.flat.masters[g]
            self.shared[g] = master.dtype == torch.bfloat16 and all(s.dtype == torch.bfloat16 for s in segs)
            own += [] if self.shared[g] else [(g, i) for i in range(len(segs))]
        segments = state.layout.segments
        made = dict(zip(own, pinned_buffers([(segments[g][i].stop - segments[g][i].start, segments[g][i].dtype)
                                             for g, i in own], pin)))
        for g in self.shared:
            master = state.flat.masters[g]
            self.pairs[g] = [(state.blocks[(g, s.dtype)][:s.stop - s.start],
                              master[s.start:s.stop] if self.shared[g] else made[(g, i)])
                             for i, s in enumerate(segments[g])]
        self.flips = {g: 0 for g in self.pairs}
        self.restart(first)

    def restart(self, first: int) -> None:
        """Settled: a new runtime's first iteration `first` uploads from A; the masters may have changed."""
        self.base = {g: first for g in self.pairs}
        self.refresh()

    def refresh(self) -> None:
        """Cast the masters into the buffers of their own (settled: at the start, after the masters changed)."""
        for g, shared in self.shared.items():
            if not shared:
                self.state.flat.cast(self.state.kernels, g, self._by_dtype(g, [b for _, b in self.pairs[g]]))

    def _by_dtype(self, group: int, bufs: list[torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
        """Segment buffers as `FlatGroups.step`'s `out` / `cast`'s blocks: dtype -> buffer (one segment each)."""
        return {s.dtype: b for s, b in zip(self.state.layout.segments[group], bufs)}

    def sources(self, group: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(read, write) per segment: the buffer a shared master is read from, and the buffer the new copies
        (a shared master: the new master) go to, the one this iteration uploaded from."""
        a = [x for x, _ in self.pairs[group]]
        b = [y for _, y in self.pairs[group]]
        return (a, b) if self.flips[group] % 2 else (b, a)

    def out(self, group: int) -> dict[torch.dtype, torch.Tensor]:
        """dtype -> the buffer this step writes the group's compute copies into (a B of its own)."""
        return self._by_dtype(group, self.sources(group)[1])

    def carry(self, group: int) -> None:
        """A shared master not updated now keeps its value: copy it into the buffer the step writes."""
        read, write = self.sources(group)
        for src, dst in zip(read, write):
            dst.copy_(src)

    def flip(self, group: int) -> None:
        """The group's step is done: its new copies are in the buffer it wrote."""
        self.flips[group] += 1

    def uploads(self, t: int, evaluation: bool) -> dict[tuple, torch.Tensor]:
        """(layer, dtype) -> B for each block whose trainable part iteration t uploads from B (the block's first
        `len(B)` elements); an evaluation (after a flush: settled) reads A."""
        if evaluation:
            return {}
        return {(g, b.dtype): b for g, pairs in self.pairs.items() if (t - self.base[g]) % 2 for _, b in pairs}

    def settle(self) -> None:
        """Nothing in flight: the compute copies the next iteration reads back into A, the master (or its cast)
        into B."""
        for g, pairs in self.pairs.items():
            if self.flips[g] % 2:
                for a, b in pairs:
                    tmp = a.clone()
                    a.copy_(b)
                    b.copy_(tmp)
            self.base[g] += self.flips[g]
            self.flips[g] = 0

    def buffers(self) -> list[torch.Tensor]:
        """Every B (what uploads read every other iteration)."""
        return [b for pairs in self.pairs.values() for _, b in pairs]


class AlternatingCopies:
    """`HostState`'s side of the alternating copies (a mixin; see runtime/host/optimizer.py): turning them on for a
    runtime, settling them, and which buffers an iteration's uploads read. Uses `alt`, `_pin` and `shard`."""

    def alternate(self, first: int | None) -> bool:
        """Settle, then let the compute copies alternate between two buffers from iteration `first` on (None:
        stop; `Alternation`).

        The runtime calls this at staleness 1 (`HostLanes`): each `step` then writes the new compute copies (a
        bf16 master with bf16 copies: the new master) into the buffer its iteration uploaded from, and `copy`
        has nothing to do. Returns whether they alternate (not where the masters are sharded: the copies are
        gathered from the other ranks, `runtime.sharded`).
        """
        self.settle()
        if first is None or not eligible(self):
            self.alt = None
        elif self.alt is not None:  # a later runtime on this state: the same buffers (pinned once), recast
            self.alt.restart(first)
        else:
            self.alt = Alternation(self, first, self._pin)
        return self.alt is not None

    def masters_changed(self) -> None:
        """The masters were written outside `step` (settled; e.g. a data-parallel broadcast): recast the
        alternating copies' own buffers from them."""
        self.settle()
        if self.alt is not None:
            self.alt.refresh()

    def settle(self) -> None:
        """Nothing in flight: put the masters back where `master` points and the copies where `compute` does."""
        if self.alt is not None:
            self.alt.settle()

    def upload_alternates(self, t: int) -> dict[tuple, torch.Tensor]:
        """(layer, dtype) -> the buffer iteration t's uploads read the block's trainable part from, where it is
        not the block's own (`Alternation.uploads`); {} without alternation."""
        return {} if self.alt is None else self.alt.uploads(t, t >= EVAL_BASE)


def eligible(state: Any) -> bool:
    """Whether `state`'s compute copies can alternate between two buffers (`HostState.alternate`): unsharded."""
    return state.shard is None


def upload_sources(block: torch.Tensor, alt: torch.Tensor | None, lo: int, hi: int) -> list[tuple]:
    """[(tensor, lo, hi)]: where elements [lo, hi) of a compute-copy block are read from; `alt` (None, or the
    buffer holding the block's first `len(alt)` elements this iteration, `Alternation.uploads`) before the rest.

    >>> [(t.numel(), a, b) for t, a, b in upload_sources(torch.zeros(10), torch.ones(4), 2, 7)]
    [(4, 2, 4), (10, 4, 7)]
    """
    if alt is None or lo >= alt.numel():
        return [(block, lo, hi)]
    cut = min(hi, alt.numel())
    return [(alt, lo, cut)] + ([(block, cut, hi)] if cut < hi else [])
