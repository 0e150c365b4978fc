"""Happens-before of a Program: which instruction instances every legal interleaving runs one after the other.

An instance is (window iteration, instruction name). Instance a happens before b when a chain of
completion dependencies (`Ref`s, resolved per the Program Note) and lane order (a physical lane
runs its instructions one at a time, iteration t's before t+1's, workers rotating by
`Program.shift`) leads from a to b. Then b starts after a has finished on every interleaving of
the workers and lanes; any other pair may run in either order or at once. The verifier
(`passes.verify`, its path rules over every lane) and the host buffer assignment
(`runtime.host.assign`, the uploads' lanes) read it.

The window's edges are built with tensor operations and the clocks in C (order.c, built once per
machine like the planner's kernel; `RPCOMPILE_ORDER_KERNEL=0` or no compiler: the same integers in
Python): for a paper model's two iterations (28,632 instances) about 0.05 s.

    >>> from rpcompile.passes import emit
    >>> from rpcompile.ir.plan import StagePlan
    >>> hb = HappensBefore(emit(StagePlan.from_str("1|1|1"), gpus=2, microbatches=2))
    >>> hb.before((0, "w0 F0.m0"), (0, "w0 D0.m0")), hb.before((0, "w0 D0.m0"), (0, "w0 F0.m0"))
    (True, False)
"""
from __future__ import annotations

import array
import ctypes
import os
from functools import cached_property

import torch

from rpcompile.ir.clib import CLibrary
from rpcompile.ir.program import HOST_OPS, LANE_OF, Lane, Op, Program

__all__ = ["HappensBefore"]


class HappensBefore:
    """Vector clocks of `iterations` consecutive instances of a Program's iteration.

    Every physical lane runs its instructions in a chain, so happens-before is exact with one number
    per (node, lane): `clock[node, lane]` is the position in `lane` of the last instruction there
    that happens before `node` (or `node` itself, on its own lane); -1 if none. Then a on lane L
    happens before b on another lane exactly when position(a) <= clock[b, L]. A node's clock is the
    elementwise max of its predecessors' (window order is topological).

    Args:
        program: the Program.
        first: the logical iteration of the window's first instance (a `Ref` applies in logical
            iteration t only when t - back >= 0 and t >= since: a window from 0 has the fewest edges).
        iterations: how many consecutive iterations the window holds.
        track: the kinds of lane whose instructions `before` may be asked about as its first argument
            (None: all); the clocks keep a column for those lanes only, which is as exact and cheaper.
    """

    def __init__(self, program: Program, first: int = 0, iterations: int = 2,
                 track: frozenset[Lane] | None = None) -> None:
        self.program, self.first, self.iterations = program, first, iterations
        self.size = n = len(program.instrs)
        self.pos = {i.name: k for k, i in enumerate(program.instrs)}
        self.tracked = frozenset(LANE_OF.values()) if track is None else frozenset(track)
        kinds = {kind: c for c, kind in enumerate(dict.fromkeys(LANE_OF.values()))}
        of = {id(op): (op in HOST_OPS, kinds[LANE_OF[op]]) for op in Op}  # Op's hash is Python code: look up once
        # per template instruction, once: its worker (-1: the host), its lane kind, its Refs (dep position, back, since)
        ops = [of[id(i.op)] for i in program.instrs]
        worker = torch.tensor([-1 if host else i.worker for (host, _), i in zip(ops, program.instrs)], dtype=torch.long)
        kind = torch.tensor([c for _, c in ops], dtype=torch.long)
        refs = [(k, self.pos[d.name], d.back, d.since) for k, i in enumerate(program.instrs) for d in i.deps]
        dst, src, back, since = torch.tensor(refs, dtype=torch.long).reshape(-1, 4).T
        # the window's nodes: t * n + position; node order is topological
        t = torch.arange(iterations).repeat_interleave(n)
        w = worker.repeat(iterations)
        on = (w + t * program.shift) % program.gpus  # the physical worker (lanes rotate with `shift`)
        key = torch.where(w < 0, program.gpus, on) * len(kinds) + kind.repeat(iterations)  # the physical lane
        # lane order: each lane a chain, in node order
        by = torch.argsort(key, stable=True)
        same = torch.zeros_like(by, dtype=torch.bool)
        same[1:] = key[by[1:]] == key[by[:-1]]
        start = torch.cummax(torch.where(same, 0, torch.arange(len(by))), 0).values  # where each lane's run begins
        step = torch.empty_like(by)
        step[by] = torch.arange(len(by)) - start
        edges_to, edges_from = [by[1:][same[1:]]], [by[:-1][same[1:]]]  # each node after its lane's previous one
        for it in range(iterations):  # Refs that apply in logical iteration first + it
            live = (back <= it) & (since <= first + it)
            edges_to.append(dst[live] + it * n)
            edges_from.append(src[live] + (it - back[live]) * n)
        to, frm = torch.cat(edges_to), torch.cat(edges_from)
        order = torch.argsort(to, stable=True)
        ptr = torch.zeros(iterations * n + 1, dtype=torch.long)
        ptr[1:] = torch.cumsum(torch.bincount(to, minlength=iterations * n), 0)
        # tracked lanes get a column each, in the order of their first node
        lanes, first_node = torch.unique(key, return_inverse=False), None
        heads = by[~same]  # each lane's first node, lanes in key order
        keep = [int(h) for h in heads.sort().values if list(kinds)[int(key[h]) % len(kinds)] in self.tracked]
        column = torch.full((int(key.max()) + 1 if len(key) else 1,), -1, dtype=torch.long)
        for c, h in enumerate(keep):
            column[key[h]] = c
        self._k = k = max(len(keep), 1)
        self._col = _ints(column[key] if len(key) else key)  # the node's own column, -1 for an untracked lane
        self._step = _ints(step)
        self._rows = _clocks(iterations * n, k, _ints(ptr), _ints(frm[order]), self._col, self._step)

    @cached_property
    def clock(self) -> torch.Tensor:
        """[node, column] int32: position of the latest node of that lane at or before the node (-1: none)."""
        return _tensor(self._rows, torch.int32).reshape(-1, self._k)

    @cached_property
    def lane(self) -> torch.Tensor:
        """[node] long: the column of the node's own lane (-1: a lane not tracked)."""
        return _tensor(self._col, torch.int32).long()

    @cached_property
    def step(self) -> torch.Tensor:
        """[node] int32: the node's position in its lane."""
        return _tensor(self._step, torch.int32)

    def node(self, t: int, name: str) -> int:
        """Node id of the instance of `name` in window iteration t."""
        return t * self.size + self.pos[name]

    def before(self, a: tuple[int, str], b: tuple[int, str]) -> bool:
        """Whether instance a = (window iteration, name) happens before instance b."""
        x, y = a[0] * self.size + self.pos[a[1]], b[0] * self.size + self.pos[b[1]]  # `node`, inline (hot)
        c = self._col[x]
        if c < 0:
            raise ValueError(f"{a[1]} runs on a lane this HappensBefore does not track")
        return x != y and self._step[x] <= self._rows[y * self._k + c]


def _ints(values: torch.Tensor) -> array.array:
    """An int array copy of an integer tensor."""
    return array.array("i", values.to(torch.int32).numpy().tobytes())


def _tensor(values: array.array, dtype: torch.dtype) -> torch.Tensor:
    """A tensor copy of an int array."""
    return torch.frombuffer(values, dtype=dtype).clone() if len(values) else torch.zeros(0, dtype=dtype)


LIBRARY = CLibrary("rpcompile_order", sources=(os.path.join(os.path.dirname(os.path.abspath(__file__)), "order.c"),),
                   switch="RPCOMPILE_ORDER_KERNEL")


def _clocks(n: int, k: int, ptr: array.array, idx: array.array, col: array.array, step: array.array) -> array.array:
    """The clock rows, flat ([node * k + column]): each node's the elementwise max of its predecessors', its own
    column set to its step. In C (order.c) where it builds; else the same integer operations in Python."""
    rows = array.array("i", bytes(4 * n * k))
    lib = LIBRARY.load()
    if lib is not None and n:
        p = ctypes.c_void_p
        lib.rp_clocks.restype = None
        lib.rp_clocks.argtypes = [ctypes.c_int, ctypes.c_int, p, p, p, p, p]
        lib.rp_clocks(n, k, *(a.buffer_info()[0] for a in (ptr, idx or array.array("i", [0]), col, step, rows)))
        return rows
    blank = [-1] * k
    for v in range(n):  # node order is topological: its predecessors' rows are made
        a, b = ptr[v], ptr[v + 1]
        row = rows[idx[a] * k:idx[a] * k + k].tolist() if a < b else list(blank)
        for e in range(a + 1, b):
            u = idx[e] * k
            row = list(map(max, row, rows[u:u + k]))
        if col[v] >= 0:
            row[col[v]] = step[v]
        rows[v * k:v * k + k] = array.array("i", row)
    return rows
