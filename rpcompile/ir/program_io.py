"""Text, CSV and Chrome-trace views of a Program (helpers behind Program's methods).

They read a program's fields (`plan`, `gpus`, `instrs`, ...) and import only
the instruction records, so that `program.py` can call them.

    >>> from rpcompile.passes import emit
    >>> from rpcompile.ir.plan import StagePlan
    >>> print(grid(emit(StagePlan.from_str("|1|"), gpus=1, microbatches=1)))
    Program(|1|, gpus=1, microbatches=1, round_size=1, staleness=1, g0=0)
      step  w0        host
    ------  --------  ------
         0  P0.r0.c0  C.l0
         1  U0.m0     O.l0
         2  X0.m0
         3  D0.m0
         4  G0.r0.c0
         5  E0.r0
"""
from __future__ import annotations

import csv
import json
from typing import Any  # a program is read by its fields: program.py imports this module

from tabulate import tabulate

from rpcompile.ir.plan import StagePlan
from rpcompile.ir.instr import Chunk, Instr


def grid(program: Any, mark: str | None = None, context: int | None = None) -> str:
    """Per-worker instruction columns (program order, all lanes), host column last.

    Args:
        program: the program.
        mark: an instruction name to show as >>cell<<.
        context: with `mark`, only rows within this distance of the marked row.
    Returns:
        A tabulate table; row j holds each worker's j-th instruction.
    """
    cols: dict[int, list[str]] = {w: [] for w in list(range(program.gpus)) + [-1]}
    mark_row = None
    for i in program.instrs:
        col = cols.setdefault(i.worker, [])
        cell = i.short
        if i.name == mark:
            cell, mark_row = f">>{cell}<<", len(col)
        col.append(cell)
    height = max((len(c) for c in cols.values()), default=0)
    lo, hi = 0, height
    if mark_row is not None and context is not None:
        lo, hi = max(0, mark_row - context), min(height, mark_row + context + 1)
    keys = sorted(w for w in cols if w >= 0) + [-1]
    rows = [[j] + [cols[w][j] if j < len(cols[w]) else "" for w in keys] for j in range(lo, hi)]
    headers = ["step"] + [f"w{w}" if w >= 0 else "host" for w in keys]
    head = f"Program({program.plan.to_str()}, gpus={program.gpus}, microbatches={program.microbatches}, " \
           f"round_size={program.round_size}, staleness={program.staleness}, g0={program.worker_offset})\n"
    table = tabulate(rows, headers=headers)
    return table if mark is not None or context is not None else head + table


_META = ("plan", "gpus", "microbatches", "round_size", "staleness", "worker_offset", "next_offset")


def to_csv(program: Any, path) -> None:
    """Rows: ('meta', key, value), ('chunk', stage, index, bytes, pieces), ('instr', text)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        for k in _META:
            v = getattr(program, k)
            w.writerow(["meta", k, v.to_str() if k == "plan" else v])
        w.writerow(["meta", "readers", ";".join(f"{l}:" + ",".join(map(str, rs)) for l, rs in program.readers)])
        for c in program.chunks:
            w.writerow(["chunk", c.stage, c.index, c.bytes, ";".join(f"{l}:{a}:{b}" for l, a, b in c.pieces)])
        for i in program.instrs:
            w.writerow(["instr", str(i)])


def read_csv(path) -> dict:
    """The fields of a program written by `to_csv` (`Program(**read_csv(path))` rebuilds it)."""
    meta: dict = {}
    chunks, instrs = [], []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "meta" and row[1] == "readers":
                meta["readers"] = tuple((int(a), tuple(int(x) for x in b.split(","))) for a, b in
                                        (g.split(":") for g in row[2].split(";") if g))
            elif row[0] == "meta":
                meta[row[1]] = StagePlan.from_str(row[2]) if row[1] == "plan" else int(row[2])
            elif row[0] == "chunk":
                pieces = tuple(tuple(int(x) for x in p.split(":")) for p in row[4].split(";") if p)
                chunks.append(Chunk(int(row[1]), int(row[2]), pieces, int(row[3])))
            elif row[0] == "instr":
                instrs.append(Instr.from_str(row[1]))
            else:
                raise ValueError(f"{path}: unknown row kind {row[0]!r}")
    missing = [k for k in _META if k not in meta]
    if missing:
        raise ValueError(f"{path}: missing program fields {missing}")
    return dict(instrs=tuple(instrs), chunks=tuple(chunks), **meta)


def unit_times(program: Any) -> dict[str, tuple[float, float]]:
    """Placeholder timeline of one iteration: each instruction takes 1 after its deps and lane predecessor."""
    end: dict[str, float] = {}
    lane_end: dict = {}
    out = {}
    for i in program.instrs:
        s = max([end[d.name] for d in i.deps if d.back == 0 and d.since == 0 and d.name in end]
                + [lane_end.get((i.worker, i.lane), 0.0)])
        out[i.name] = (s, s + 1.0)
        end[i.name] = lane_end[(i.worker, i.lane)] = s + 1.0
    return out


def to_chrome_trace(program: Any, path, timeline=None) -> None:
    """Write chrome://tracing JSON: one complete ('X') event per instruction, pid = worker, tid = lane."""
    if timeline is None:
        times, scale = unit_times(program), 1.0
    else:
        if hasattr(timeline, "start") and hasattr(timeline, "end"):
            times = {n: (timeline.start[n], timeline.end[n]) for n in timeline.start}
        else:
            times = dict(timeline)
        scale = 1e6
    events = []
    for i in program.instrs:
        s, e = times.get(i.name, (0.0, 0.0))
        events.append({"name": i.short, "cat": i.lane.value, "ph": "X", "ts": s * scale,
                       "dur": (e - s) * scale, "pid": "host" if i.is_host else f"w{i.worker}",
                       "tid": i.lane.value, "args": {"deps": [str(d) for d in i.deps]}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": {"plan": program.plan.to_str(), "gpus": program.gpus}}, f)


__all__ = ["grid", "to_csv", "read_csv", "to_chrome_trace", "unit_times"]
