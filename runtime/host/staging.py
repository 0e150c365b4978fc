"""Gradient staging: a ring of K host buffers shared by every stage, filled one accumulation unit at a time.

A G chunk downloads part of a slot's gradients into host staging; the accumulate lane adds them
into the fp32 gradients once per parameter (`HostState.accumulate_grad` takes a whole
parameter). So the staging is cut into **accumulation units**: the chunks of one (stage, round)
slot, in program order, grouped so that every trainable parameter lies in one unit (a
parameter split across chunks, an embedding say, keeps those chunks together). A unit holds
exactly its parameters' gradients, packed in the stage's layout order (16-byte aligned, as
`layout.stage_layouts`).

Units are numbered in program order, over an iteration (`units`) and on across iterations:
unit i = t * U + j (iteration t, ordinal j, U units per iteration). Unit i lands in ring buffer
i mod K; its first chunk waits (a stream wait on a host event) for unit i - K to be accumulated,
and the accumulate lane takes the units in that order, each after its own downloads. Every
buffer is sized for the largest unit, per dtype, pinned at its exact size, allocated once.

Note: why this cannot deadlock. Unit i waits only for unit i - K, which is earlier in program
order. Its accumulation waits for its own chunks, the units before it (the lane is in order) and
the optimizer steps its gradients' layers need first (R4, of the iteration before): all earlier
in program order than unit i's first chunk, and none waits for anything at or behind that chunk
(each worker's streams and issuer follow program order). So for every K >= 1 each wait ends.

Note: K. The more buffers, the more units download while earlier ones are accumulated: N + 1
lets every one of N workers download one unit while the lane adds another. But K buffers of the
largest unit cost K times it, and one big unit (an embedding, a whole MoE layer) sets that size.
So K = S // (2 B), at least 2 (one unit downloads while one is added), at most N + 1, where S is
what one buffer per stage held before (the gradient bytes of each stage's first slot) and B one
ring buffer's bytes: the ring holds at most half of that, and never more than all of it (K <=
S // B, which may make K = 1). K does not depend on the round size, and K <= S // B <= U (S is
the bytes of some units of one iteration, each at most B), so the unit i - K that unit i waits
for is in its iteration or the one before, whose events the runtime still holds.

    >>> plan = StagingPlan.of(program, chunk_elems, grads)                      # doctest: +SKIP
    >>> plan.k, plan.sizes, plan.bytes                                          # doctest: +SKIP
    (2, {torch.float32: 4736}, 37888)
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from tabulate import tabulate

from rpcompile.ir.host_layout import aligned
from rpcompile.runtime.stage.cuts import chunk_elements

__all__ = ["Unit", "StagingPlan", "graph_staging"]


@dataclass(frozen=True)
class Unit:
    """One accumulation unit: chunks of one slot whose parameters lie in no other unit."""

    stage: int
    round: int
    chunks: tuple[str, ...]  # its G instructions' names, program order
    indices: tuple[int, ...]  # their chunk indices (`Program.stage_chunks`)
    grads: dict[str, tuple[torch.dtype, int, int]]  # param -> (dtype, element offset in the buffer, numel)

    def elements(self) -> dict[torch.dtype, int]:
        """Elements the unit occupies per dtype (alignment gaps included)."""
        out: dict[torch.dtype, int] = {}
        for d, off, n in self.grads.values():
            out[d] = max(out.get(d, 0), off + n)
        return out


@dataclass(frozen=True)
class StagingPlan:
    """The gradient staging of a program: its units and the ring they land in (module docstring)."""

    units: tuple[Unit, ...]  # one iteration's, in program order (the accumulate lane's order)
    unit_of: dict[str, int]  # G name -> ordinal of its unit
    sizes: dict[torch.dtype, int]  # elements of each ring buffer, per dtype
    k: int  # ring buffers

    @classmethod
    def of(cls, program: Any, chunk_elems: dict, grads: dict[int, dict[str, tuple[torch.dtype, int]]],
           k: int | None = None) -> "StagingPlan":
        """The staging of `program`.

        Args:
            program: the Program (its G instructions, program order).
            chunk_elems: (stage, chunk) -> [(param, start, stop)] element ranges (`cuts.chunk_elements`).
            grads: stage -> {param: (dtype, numel)} of its trainable parameters, in the stage's layout order.
            k: ring buffers (None: the rule of the module docstring).
        """
        slots: list[tuple[tuple[int, int], list]] = []
        for i in program.instrs:
            if i.op == "G":  # a str enum equals its value
                if not slots or slots[-1][0] != (i.stage, i.round):
                    slots.append(((i.stage, i.round), []))
                slots[-1][1].append(i)
        units: list[Unit] = []
        for (stage, rnd), gs in slots:
            units += _units(stage, rnd, gs, chunk_elems, grads.get(stage, {}))
        sizes: dict[torch.dtype, int] = {}
        for u in units:
            for d, n in u.elements().items():
                sizes[d] = max(sizes.get(d, 0), n)
        if k is None:
            one = sum(n * d.itemsize for d, n in sizes.items())
            first: dict[int, int] = {}
            held = 0  # what one buffer per stage held: the units of each stage's first slot
            for u in units:
                if first.setdefault(u.stage, u.round) == u.round:
                    held += sum(n * d.itemsize for d, n in u.elements().items())
            k = max(1, min(program.gpus + 1, max(2, held // (2 * one)), held // one)) if one else 1
        if not 1 <= k <= max(1, len(units)):
            raise ValueError(f"k={k}: a staging ring holds 1 to {len(units)} (the units of an iteration) buffers")
        return cls(tuple(units), {g: j for j, u in enumerate(units) for g in u.chunks}, sizes, k)

    @property
    def bytes(self) -> int:
        """Host bytes of the ring: K buffers of `sizes`."""
        return self.k * sum(n * d.itemsize for d, n in self.sizes.items())

    def buffer(self, t: int, j: int) -> int:
        """The ring buffer unit j of iteration t lands in."""
        return (t * len(self.units) + j) % self.k

    def waits_for(self, t: int, j: int) -> tuple[int, int]:
        """(iteration, ordinal) of the unit whose accumulation frees unit j of iteration t's buffer."""
        back, j2 = divmod(j - self.k, len(self.units))
        return t + back, j2

    def __str__(self) -> str:
        head = (f"gradient staging: {self.k} ring buffers of {_fmt(self.sizes)} "
                f"({self.bytes:,} B) for {len(self.units)} units per iteration")
        rows = [(j, u.stage, u.round, ",".join(c.split(" ")[1] for c in u.chunks), len(u.grads), _fmt(u.elements()))
                for j, u in enumerate(self.units)]
        return head + "\n" + tabulate(rows, headers=["unit", "stage", "round", "chunks", "params", "elements"])


def graph_staging(graph: Any, program: Any, io: list, dtype: torch.dtype | None = None) -> StagingPlan:
    """The StagingPlan a runtime of `program` builds, from the traced graph (for counting before a run).

    The trainable parameters are those with a gradient that a stage owns, each at `dtype` (None: its own),
    as the HostState keeps their gradients.
    """
    owners = graph.param_owners()
    sizes = SimpleNamespace(read=lambda n: torch.Size(graph.params[n].shape))  # .numel(), as a tensor's
    elems, _ = chunk_elements(program, io, sizes)
    grads: dict[int, dict] = {}
    for st in io:
        for n in st.params:  # the stage's parameters, in its layout's order
            v = graph.params[graph.tied.get(n, n)]
            if v.requires_grad and owners.get(graph.tied.get(n, n)):
                grads.setdefault(st.index, {})[n] = (dtype or v.dtype, v.bytes // v.dtype.itemsize)
    return StagingPlan.of(program, elems, grads)


def _units(stage: int, rnd: int, gs: list, chunk_elems: dict, grads: dict) -> list[Unit]:
    """The units of one slot: its chunks `gs` (program order) cut where no trainable parameter spans the cut."""
    touched = [[n for n, _, _ in chunk_elems.get((stage, g.chunk), ()) if n in grads] for g in gs]
    last = {n: k for k, names in enumerate(touched) for n in names}
    out, start, reach, names = [], 0, -1, set()
    for k, here in enumerate(touched):
        names.update(here)
        reach = max([reach] + [last[n] for n in here])
        if reach <= k:
            ends: dict[torch.dtype, int] = {}
            where = {}
            for n in grads:  # layout order
                if n in names:
                    d, numel = grads[n]
                    where[n] = (d, aligned(ends.get(d, 0), d), numel)
                    ends[d] = where[n][1] + numel
            out.append(Unit(stage, rnd, tuple(g.name for g in gs[start:k + 1]),
                            tuple(g.chunk for g in gs[start:k + 1]), where))
            start, names = k + 1, set()
    return out


def _fmt(sizes: dict) -> str:
    return " + ".join(f"{n:,} {str(d).removeprefix('torch.')}" for d, n in sizes.items()) or "0"
