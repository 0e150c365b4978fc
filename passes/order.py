"""Happens-before of a Program: which instruction instances every legal interleaving runs one after the other.

An instance is (window iteration, instruction name). Instance a happens before b when a chain of
completion dependencies (`Ref`s, resolved per the Program Note) and lane order (a physical lane
runs its instructions one at a time, iteration t's before t+1's, workers rotating by
`Program.shift`) leads from a to b. Then b starts after a has finished on every interleaving of
the workers and lanes; any other pair may run in either order or at once. The host buffer
assignment (`runtime.host.assign`) reads it. (The verifier keeps its own ancestor bitsets over
every lane: for its many single queries that is faster.)

    >>> from rpcompile.passes import emit
    >>> from rpcompile.ir.plan import StagePlan
    >>> hb = HappensBefore(emit(StagePlan.from_str("1|1|1"), gpus=2, microbatches=2))
    >>> hb.before((0, "w0 F0.m0"), (0, "w0 D0.m0")), hb.before((0, "w0 D0.m0"), (0, "w0 F0.m0"))
    (True, False)
"""
from __future__ import annotations

from functools import cached_property

import torch

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
        self.size = len(program.instrs)
        self.pos = {i.name: k for k, i in enumerate(program.instrs)}
        lanes: dict[tuple, int] = {}
        kind = {id(op): (op in HOST_OPS, LANE_OF[op]) for op in Op}  # Op's hash is Python code: look up once
        # per template instruction, once: (its lane's worker or -1, lane, [(dep position, back, since)])
        shape = []
        for i in program.instrs:
            host, ln = kind[id(i.op)]
            shape.append((-1 if host else i.worker, ln, [(self.pos[d.name], d.back, d.since) for d in i.deps]))
        self.tracked = frozenset(LANE_OF.values()) if track is None else frozenset(track)
        lane, step, preds = [], [], []
        last: dict[int, int] = {}  # lane -> its latest node
        for t in range(iterations):
            shift = t * program.shift
            for w, kind, deps in shape:
                ln = lanes.setdefault((w if w < 0 else (w + shift) % program.gpus, kind), len(lanes))
                mine = [(t - back) * self.size + at for at, back, since in deps if back <= t and first + t >= since]
                if ln in last:
                    v = last[ln]
                    mine.append(v)
                    step.append(step[v] + 1)
                else:
                    step.append(0)
                last[ln] = len(lane)
                lane.append(ln)
                preds.append(mine)
        kept = [ln for key, ln in lanes.items() if key[1] in self.tracked]
        column = {ln: c for c, ln in enumerate(kept)}  # lane -> its column in the clocks
        k = max(len(column), 1)
        col = [column.get(ln, -1) for ln in lane]  # the node's own column, -1 for an untracked lane
        rows: list[list[int]] = []
        blank = [-1] * k
        for v, mine in enumerate(preds):  # node order is topological: its predecessors' rows are made
            row = list(rows[mine[0]]) if mine else list(blank)
            for u in mine[1:]:
                row = list(map(max, row, rows[u]))
            if col[v] >= 0:
                row[col[v]] = step[v]
            rows.append(row)
        self._col, self._step, self._rows, self._k = col, step, rows, k

    @cached_property
    def clock(self) -> torch.Tensor:
        """[node, column] int32: position of the latest node of that lane at or before the node (-1: none)."""
        return torch.tensor(self._rows, dtype=torch.int32).reshape(len(self._rows), self._k)

    @cached_property
    def lane(self) -> torch.Tensor:
        """[node] long: the column of the node's own lane (-1: a lane not tracked)."""
        return torch.tensor(self._col, dtype=torch.long)

    @cached_property
    def step(self) -> torch.Tensor:
        """[node] int32: the node's position in its lane."""
        return torch.tensor(self._step, dtype=torch.int32)

    def node(self, t: int, name: str) -> int:
        """Node id of the instance of `name` in window iteration t."""
        return t * self.size + self.pos[name]

    def before(self, a: tuple[int, str], b: tuple[int, str]) -> bool:
        """Whether instance a = (window iteration, name) happens before instance b."""
        x, y = self.node(*a), self.node(*b)
        c = self._col[x]
        if c < 0:
            raise ValueError(f"{a[1]} runs on a lane this HappensBefore does not track")
        return x != y and self._step[x] <= self._rows[y][c]
