"""Where a run's parameters live in host memory: element offsets in flat buffers (plain numbers).

The host state (`rpcompile.runtime.host.optimizer.HostState`) allocates what this layout says and the
host-memory pass (`passes/cost/host_bytes.py`) counts it, so the admission check counts exactly
what is allocated.

- Per layer group, the trainable parameters' fp32 masters, gradients and optimizer moments (fp32, or
  bf16 with `AdamW(state_dtype=torch.bfloat16)`) are each one flat buffer of `HostLayout.flat[group]`
  elements, parameters at the same offsets in all of them, so one kernel call covers a group.
- A group's parameters are ordered by compute dtype (the model's order within one): each run of
  one dtype is a `Segment`, starting at a multiple of `SEGMENT` elements.
- Compute copies (every parameter, in the training dtype) are one block per (lowest owner layer,
  dtype). A group's trainable parameters come first in their block, at the same offsets as in the
  segment, so the update can write the compute copy from the same index; frozen ones follow.
- Every offset is a multiple of `ALIGN` bytes for its dtype (vectorised kernels and copies want
  aligned operands); the gaps are never read as parameters and hold zeros.

    >>> import torch
    >>> lay = host_layout([("w", 6, torch.bfloat16, 0, True), ("b", 3, torch.bfloat16, 0, True),
    ...                    ("f", 2, torch.bfloat16, 0, False)], groups=1)
    >>> lay.master, lay.flat, lay.blocks
    ({'w': 0, 'b': 8}, (11,), {(0, torch.bfloat16): 18})

The per-microbatch host buffers of the values that cross cuts live in one byte arena, placed by
the buffer assignment (`runtime.host.assign`): a `BufferAssignment` holds one `HostBuffer` per
(value, microbatch) with its byte offset and live range; buffers whose lives never overlap share
bytes. It prints as a table:

    >>> b = HostBuffer(("a", 0, "h1"), (2, 8), torch.bfloat16, 0, "w0 D0.m0", ("w1 U1.m0",))
    >>> print(BufferAssignment("p1", (b,), arena=64, peak=32))
    host arena 64 B for 1 buffers of 32 B (at least 32 B live at once), program p1
    value    mb    offset    bytes    live range
    -------  ----  --------  -------  --------------------
    h1       0     0         32       w0 D0.m0 -> w1 U1.m0
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from tabulate import tabulate

__all__ = ["ALIGN", "SEGMENT", "aligned", "block_offsets", "Segment", "HostLayout", "host_layout", "ARENA_ALIGN",
           "HostBuffer", "BufferAssignment", "per_mb", "nbytes", "shard_slices"]

ALIGN = 16  # bytes: every view's offset in its flat buffer is a multiple of this
SEGMENT = 16  # elements: a segment of a group's fp32 buffers starts at a multiple of this (64 bytes)


def aligned(offset: int, dtype: torch.dtype) -> int:
    """`offset` (elements of `dtype`) rounded up so that it lies on an ALIGN-byte boundary.

    >>> aligned(3, torch.float32), aligned(3, torch.bfloat16), aligned(0, torch.float64)
    (4, 8, 0)
    """
    step = max(1, ALIGN // dtype.itemsize)
    return -(-offset // step) * step


def block_offsets(entries: Iterable[tuple[str, tuple, int]]) -> tuple[dict[str, tuple[tuple, int]], dict[tuple, int]]:
    """Pack (name, (layer, dtype), elements) in order, one block per key, each aligned for its dtype.

    Returns:
        (where, sizes): name -> (key, element offset); key -> elements of the block.

    >>> block_offsets([("a", (0, torch.float32), 3), ("b", (0, torch.float32), 4)])
    ({'a': ((0, torch.float32), 0), 'b': ((0, torch.float32), 4)}, {(0, torch.float32): 8})
    """
    where: dict[str, tuple[tuple, int]] = {}
    sizes: dict[tuple, int] = {}
    for name, key, numel in entries:
        where[name] = (key, aligned(sizes.get(key, 0), key[1]))
        sizes[key] = where[name][1] + numel
    return where, sizes


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of one group's trainable parameters that share a compute dtype."""

    dtype: torch.dtype  # their compute dtype; their copies sit at [0, stop - start) of block (group, dtype)
    start: int  # element range in the group's flat fp32 buffers
    stop: int


@dataclass(frozen=True)
class HostLayout:
    """The host layout of a run's parameters (see the module docstring)."""

    master: dict[str, int]  # trainable name -> element offset in its group's flat fp32 buffers
    members: tuple[tuple[str, ...], ...]  # group -> its trainable names, in offset order
    flat: tuple[int, ...]  # group -> elements of each of its flat fp32 buffers (0: no trainable parameter)
    segments: tuple[tuple[Segment, ...], ...]  # group -> its runs of one compute dtype, in offset order
    where: dict[str, tuple[tuple, int]]  # every name -> ((layer, dtype), element offset) of its compute copy
    blocks: dict[tuple, int]  # (layer, dtype) -> elements of that compute block

    def bytes(self, moments: int, state_itemsize: int = 4) -> dict[str, int]:
        """Bytes of the buffers: compute blocks, fp32 masters, fp32 gradients, `moments` moment buffers of
        `state_itemsize` bytes an element (4: fp32, 2: bf16), and the compute copies of the trainable
        parameters (`trainable_weights`, within `weights`: each segment's elements, gaps included)."""
        fp32 = 4 * sum(self.flat)
        return {"weights": sum(n * key[1].itemsize for key, n in self.blocks.items()), "masters": fp32,
                "grads": fp32, "optimizer": moments * state_itemsize * sum(self.flat),
                "trainable_weights": sum((s.stop - s.start) * s.dtype.itemsize for g in self.segments for s in g)}


def host_layout(params: Sequence[tuple[str, int, torch.dtype, int, bool]], groups: int) -> HostLayout:
    """The host layout of `params`.

    Args:
        params: (name, elements, compute dtype, layer group, trainable) per parameter, in the model's
            order; the group of a trainable parameter is its lowest owner layer, and a frozen one's
            compute copy goes into the block of its group too.
        groups: number of layer groups.
    Returns:
        A HostLayout.
    """
    members: list[list[tuple[str, int, torch.dtype]]] = [[] for _ in range(groups)]
    for name, numel, dtype, group, trainable in params:
        if trainable:
            members[group].append((name, numel, dtype))
    master: dict[str, int] = {}
    flat, segments, order, names = [], [], [], []
    for group in members:
        dtypes = list(dict.fromkeys(d for _, _, d in group))  # first appearance
        off, segs = 0, []
        for d in dtypes:
            start = -(-off // SEGMENT) * SEGMENT
            off = start
            for name, numel, dt in group:
                if dt == d:
                    master[name] = off = start + aligned(off - start, d)
                    off += numel
                    order.append(name)
            segs.append(Segment(d, start, off))
        flat.append(off)
        segments.append(tuple(segs))
        names.append(tuple(order[len(order) - len(group):]))
    info = {name: (numel, dtype, group) for name, numel, dtype, group, _ in params}
    order += [name for name, *_ in params if name not in master]  # trainable first: at their segment offsets
    where, blocks = block_offsets((n, (info[n][2], info[n][1]), info[n][0]) for n in order)
    return HostLayout(master, tuple(names), tuple(flat), tuple(segments), where, blocks)



def shard_slices(numel: int, world: int, align: int = SEGMENT) -> list[tuple[int, int]]:
    """The slice [lo, hi) of a flat buffer of `numel` elements that each of `world` ranks owns, in rank order.

    The buffer is cut into units of `align` elements (the last one may be shorter); rank r owns a
    contiguous run of them, the first `units % world` ranks one unit more than the others. So every
    element is owned exactly once, every non-empty slice starts at a multiple of `align` (16 elements, the
    host layout's SEGMENT: 64 bytes of fp32, 32 of bf16), slices differ by at most one unit (and the
    last unit's shortfall: under 2 * `align` elements),
    and the ranks past the last unit own empty slices (numel < world * align). It depends on the
    three numbers only (`runtime.host.shard_comm` sums and gathers these slices;
    `passes/cost/host_bytes.py` counts a rank's share with them).

    >>> shard_slices(40, 2), shard_slices(5, 3, align=1), shard_slices(3, 4, align=1)
    ([(0, 32), (32, 40)], [(0, 2), (2, 4), (4, 5)], [(0, 1), (1, 2), (2, 3), (3, 3)])
    """
    if world < 1 or align < 1 or numel < 0:
        raise ValueError(f"shard_slices: need numel >= 0, world >= 1, align >= 1 (got {numel}, {world}, {align})")
    units = -(-numel // align)
    per, extra = divmod(units, world)
    out, unit = [], 0
    for r in range(world):
        end = unit + per + (r < extra)
        out.append((min(numel, unit * align), min(numel, end * align)))
        unit = end
    return out


ARENA_ALIGN = 64  # bytes: every buffer starts on a cache line (and a DMA-friendly boundary) of the arena


@dataclass(frozen=True, slots=True)
class HostBuffer:
    """One per-microbatch host buffer: its runtime key, shape, dtype, place in the arena and live range."""

    key: tuple                 # the runtime's host key: ("a", mb, value) or ("g", mb, cut layer, value)
    shape: tuple[int, ...]     # as planned (per microbatch)
    dtype: torch.dtype
    offset: int                # byte offset in the arena, a multiple of ARENA_ALIGN
    writer: str                # the download (D) that fills it, e.g. "w0 D1.m3"
    readers: tuple[str, ...]   # the uploads (U) that read it; its life ends when all of them have run

    @property
    def bytes(self) -> int:
        """Bytes it holds (its extent in the arena)."""
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def end(self) -> int:
        """One past its last byte in the arena."""
        return self.offset + self.bytes

    @property
    def mb(self) -> int:
        """Its microbatch."""
        return self.key[1]

    @property
    def value(self) -> str:
        """The value's name (a gradient's is the value it is the gradient of)."""
        return self.key[-1]


@dataclass(frozen=True, slots=True)
class BufferAssignment:
    """Every per-microbatch host buffer of one program, placed in one byte arena (see module docstring)."""

    program: str                      # fingerprint of the program it was built for (`runtime.host.assign`)
    buffers: tuple[HostBuffer, ...]   # by writer in program order, then value
    arena: int                        # bytes of the arena: the end of the furthest buffer, aligned
    peak: int                         # bytes of the heaviest set of buffers found that can all be live at once,
                                      # pair by pair (`runtime.host.assign`): no assignment needs less (0: not
                                      # computed, `runtime.host.assign.unshared`)

    def by_key(self) -> dict[tuple, HostBuffer]:
        """{runtime key: HostBuffer}."""
        return {b.key: b for b in self.buffers}

    @property
    def total(self) -> int:
        """Bytes the buffers would hold unshared (one each)."""
        return sum(b.bytes for b in self.buffers)

    def table(self, limit: int | None = None) -> str:
        """The buffers as a table: value, microbatch, offset, bytes, live range (the first `limit` rows)."""
        rows = [(("grad " if b.key[0] == "g" else "") + b.value, b.mb, b.offset, b.bytes,
                 f"{b.writer} -> {','.join(b.readers)}") for b in self.buffers[:limit]]
        return tabulate(rows, headers=["value", "mb", "offset", "bytes", "live range"], disable_numparse=True)

    def __str__(self) -> str:
        head = (f"host arena {_size(self.arena)} for {len(self.buffers)} buffers of {_size(self.total)} "
                f"(at least {_size(self.peak)} live at once), program {self.program}")
        return head + "\n" + self.table()


def _size(n: int) -> str:
    """Bytes, human-sized."""
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:,.1f} {unit}"
    return f"{n} B"


def per_mb(v: Any, microbatches: int, dtype: torch.dtype | None = None) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of value `v` in one microbatch: its batch dimension split M ways, as `split_batch` cuts it;
    a floating `v` at `dtype` if that is wider than its own.

    >>> from rpcompile.ir.graph import Value
    >>> h1 = Value("h1", (8, 4, 32), torch.bfloat16, 2048, True, "activation", 0)
    >>> per_mb(h1, 4), per_mb(h1, 4, torch.float32)
    (((2, 4, 32), torch.bfloat16), ((2, 4, 32), torch.float32))
    """
    shape = list(v.shape)
    if v.batch_dim is not None and shape:
        shape[v.batch_dim] //= microbatches
    wide = dtype is not None and v.dtype.is_floating_point and dtype.itemsize > v.dtype.itemsize
    return tuple(shape), dtype if wide else v.dtype


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a contiguous tensor of `shape` and `dtype`.

    >>> nbytes((2, 3), torch.bfloat16)
    12
    """
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n
