"""An independent happens-before for the tests of `passes.order` and `runtime.host.assign`: a plain
transitive closure over the instances of a few iterations, by graph search."""
from __future__ import annotations


def closure(program, iterations: int, first: int = 0) -> dict[tuple, set]:
    """(window iteration, name) -> every instance that happens before it: the Refs that apply in logical
    iteration first + t and lane order (each physical lane runs one instruction at a time, in order)."""
    preds: dict[tuple, set] = {}
    last: dict[tuple, tuple] = {}
    for t in range(iterations):
        for i in program.instrs:
            me = (t, i.name)
            direct = {(t - d.back, d.name) for d in i.deps if t - d.back >= 0 and first + t >= d.since}
            lane = (-1 if i.is_host else (i.worker + t * program.shift) % program.gpus, i.lane)
            if lane in last:
                direct.add(last[lane])
            last[lane] = me
            preds[me] = set().union(direct, *(preds[p] for p in direct))
    return preds
