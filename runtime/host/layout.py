"""Flat memory layouts: host blocks per layer group, device slots per stage, chunk copy plans.

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

import torch

from rpcompile.runtime.host.pinned import pinned_zeros
from rpcompile.ir.host_layout import ALIGN, aligned, block_offsets

__all__ = ["Slot", "StageLayout", "host_blocks", "stage_layouts", "slot_capacities", "ALIGN", "aligned"]


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
    blocks = {k: pinned_zeros(n, k[1], pin) for k, n in sizes.items()}  # gaps: zeros; pinned at exact size
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
