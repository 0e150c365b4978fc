"""What crosses a stage's cuts: per stage of a plan, the values it reads and downloads, the gradients it
receives and sends (DESIGN.md idea 3), and how they map onto flat chunked buffers.

`stage_io(graph, plan)` gives one `StageIO` per stage; the executor derives from them which uploads each
stage waits for (`up_keys`), how many readers a value has (`count_readers`) and how large each chunk of a
transfer is (`chunk_elements`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rpcompile.ir.graph import LayerGraph
from rpcompile.ir.plan import StageKind, StagePlan

__all__ = ["StageIO", "stage_io", "flat_ranges", "up_keys", "count_readers", "chunk_elements", "grads_of"]


@dataclass(frozen=True)
class StageIO:
    """The values at a stage's cuts (names; see `stage_io`)."""

    index: int
    kind: StageKind
    layers: range
    params: tuple[str, ...]  # canonical parameter names used by the stage, first-use order
    own: dict  # layer -> the params it brings to the stage's flat layout (dedup'ed within the stage)
    reads: tuple[str, ...]  # values produced before the stage (or batch inputs) that its layers read
    down: tuple[str, ...]  # F: values produced here that later stages read (outputs + saved inputs)
    grad_in: tuple[str, ...]  # B: gradients received at the cut after the stage (requires_grad only)
    grad_out: tuple[str, ...]  # X/B: gradients sent at the cut before the stage (requires_grad only)


def stage_io(graph: LayerGraph, plan: StagePlan) -> list[StageIO]:
    """Per stage, the values it reads, downloads, receives and sends gradients for.

    Args:
        graph: the traced model.
        plan: stage plan covering the graph's layers.
    Returns:
        One StageIO per stage, in slot order.
    """
    if plan.num_layers != len(graph.layers):
        raise ValueError(f"plan covers {plan.num_layers} layers but the graph has {len(graph.layers)}")
    cuts = {r.start - 1 for r in plan.bwd if r.start > 0}
    out = []
    for s in plan.stages:
        lo, hi = s.layers.start, s.layers.stop - 1
        layers = [graph.layers[i] for i in s.layers]
        produced = {n for lay in layers for n in lay.outputs}
        read = {n for lay in layers for n in lay.inputs}
        reads = tuple(v.name for v in graph.live_at(lo - 1) if v.name in read)
        down: tuple[str, ...] = ()
        if s.kind is StageKind.F:
            need = {v.name for v in graph.live_at(hi)}
            need |= {v.name for c in cuts if lo <= c <= hi for v in graph.live_at(c)}
            down = tuple(n for lay in layers for n in lay.outputs if n in need and n in produced)
        grad_in = tuple(v.name for v in graph.live_at(hi) if v.requires_grad) if s.kind is StageKind.B else ()
        grad_out = () if s.kind is StageKind.F else tuple(v.name for v in graph.live_at(lo - 1) if v.requires_grad)
        params, own = [], {}
        for lay in layers:
            own[lay.index] = tuple(p for p in lay.params if p not in params)
            params += own[lay.index]
        out.append(StageIO(s.index, s.kind, s.layers, tuple(params), own, reads, down, grad_in, grad_out))
    return out


def flat_ranges(sizes: list[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Split the flat element range [lo, hi) over consecutive tensors of `sizes` elements.

    Returns:
        (tensor index, start, stop) within each tensor that the range touches.

    >>> flat_ranges([4, 4], 2, 6)
    [(0, 2, 4), (1, 0, 2)]
    """
    out, off = [], 0
    for k, n in enumerate(sizes):
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            out.append((k, a - off, b - off))
        off += n
    return out


def up_keys(io: list[StageIO], i) -> list[tuple]:
    """Host keys (without the iteration) that an upload instruction reads."""
    st = io[i.stage]
    if i.grad:
        return [("g", i.mb, st.layers.stop - 1, n) for n in st.grad_in]
    return [("a", i.mb, n) for n in st.reads]


def count_readers(program, io: list[StageIO]) -> dict[tuple, int]:
    """Host key (without the iteration) -> number of uploads of one iteration that read it."""
    out: dict[tuple, int] = {}
    for i in program.instrs:
        if i.op == "U":  # a str enum equals its value
            for k in up_keys(io, i):
                out[k] = out.get(k, 0) + 1
    return out


def chunk_elements(program, io: list[StageIO], state) -> tuple[dict, dict]:
    """(stage, chunk) -> [(param, start, stop)] flat element ranges; (stage, param) -> piece count.

    A piece (layer, a, z) of a chunk is the byte range [a, z) of the layer's parameter bytes as
    the cost table counted them; it maps to the same fraction of the layer's actual flat
    elements (its parameters in `StageIO.own` order). A layer counted as 0 bytes goes whole.
    """
    total: dict[tuple[int, int], int] = {}
    for c in program.chunks:
        for l, _, z in c.pieces:
            total[(c.stage, l)] = max(total.get((c.stage, l), 0), z)
    elems, count = {}, {}
    for c in program.chunks:
        out = []
        for l, a, z in c.pieces:
            names = io[c.stage].own.get(l, ())
            sizes = [state.read(n).numel() for n in names]
            e, tb = sum(sizes), total[(c.stage, l)]
            lo, hi = (0, e) if tb == 0 else (a * e // tb, z * e // tb)
            out += [(names[k], s, f) for k, s, f in flat_ranges(sizes, lo, hi)]
        elems[(c.stage, c.index)] = out
        for n, _, _ in out:
            count[(c.stage, n)] = count.get((c.stage, n), 0) + 1
    return elems, count


def grads_of(env: dict, names: tuple[str, ...], passthrough: dict) -> dict[str, torch.Tensor]:
    """Gradients of `names`: a leaf's .grad (zeros if none), or the received one for unused pass-throughs."""
    out = {}
    for n in names:
        v = env.get(n)
        if v is None or not isinstance(v, torch.Tensor) or not v.requires_grad:
            out[n] = passthrough[n]
        else:
            out[n] = v.grad if v.grad is not None else torch.zeros_like(v)
    return out
