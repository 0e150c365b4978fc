"""Bound-stage pipeline baselines as Programs the simulator runs: GPipe, 1F1B, interleaved 1F1B, looped BFS.

Each GPU owns fixed stages for the whole run (decoder layers split evenly, the
LM head -- the last layer -- on the last stage), keeps their parameters,
gradients and optimizer state resident (an optimizer step `O` on the GPU
worker says so; no parameter uploads), and trains with full activation
checkpointing: F per stage and microbatch (keeping its input), then R + B.
On consumer GPUs without NVLink an activation or gradient moving between
GPUs goes through host memory: a D on the sender, then a U on the receiver.

    >>> from rpcompile import CostTable
    >>> c = CostTable.from_lists(fwd=[1.0] * 5, bwd=[2.0] * 5)
    >>> p = one_f_one_b(c, gpus=2, microbatches=4)
    >>> p.plan.to_str(), [i.name for i in p.instrs[:3]]
    ('2|3|2', ['w0 F0.m0', 'w0 D0.m0', 'w0 F0.m1'])

Note: stage numbering. With G bound stages (groups of layers), the Program's
plan is the StagePlan "g1,..,g(G-1) | gG | g(G-1),..,g1": forward of group g
is plan stage g, the last group is the fused stage (run as F then R + B, not
X, as checkpointed pipelines do), and the backward of group g < G-1 is plan
stage 2G-2-g. Group g lives on GPU g mod N (looped placement). The programs
are synchronous (staleness 0) and every iteration uses the same GPUs
(worker_offset = next_offset = 0): iteration t's forwards of a group wait for
its optimizer steps of iteration t-1.
"""
from __future__ import annotations

from rpcompile.ir.costs import CostTable
from rpcompile.ir.plan import StagePlan
from rpcompile.ir.program import Instr, Op, Program, Ref

_Item = tuple[str, int, int]  # ("F" | "B", group, microbatch) in a GPU's compute order


def bound_plan(costs: CostTable, stages: int) -> StagePlan:
    """The layer groups of `stages` bound stages as a StagePlan (see the module Note).

    >>> bound_plan(CostTable.from_lists([1.0] * 9, [2.0] * 9), 4).to_str()
    '2,2,2|3|2,2,2'
    """
    dec = costs.num_layers - 1
    if stages < 1 or (stages > 1 and dec < stages):
        raise ValueError(f"cannot split {dec} decoder layers (+ the LM head) into {stages} bound stages")
    if stages == 1:
        return StagePlan((), range(0, costs.num_layers), ())
    sizes = [dec // stages + (1 if g < dec % stages else 0) for g in range(stages)]
    sizes[-1] += 1  # the LM head
    return StagePlan.from_sizes(sizes[:-1], sizes[-1], list(reversed(sizes[:-1])))


def gpipe(costs: CostTable, *, gpus: int, microbatches: int) -> Program:
    """GPipe with checkpointing: every GPU runs all its forwards, then all its backwards.

    Args:
        costs: per-layer costs (the last layer is the LM head).
        gpus: N GPUs, one stage each.
        microbatches: M per iteration.
    Returns:
        A Program for `runtime.simulate`.

    >>> from rpcompile import CostTable
    >>> gpipe(CostTable.from_lists([1.0] * 3, [2.0] * 3), gpus=2, microbatches=2).plan.to_str()
    '1|2|1'
    """
    return looped_bfs(costs, gpus=gpus, microbatches=microbatches, chunks=1)


def one_f_one_b(costs: CostTable, *, gpus: int, microbatches: int) -> Program:
    """1F1B (PipeDream-flush) with checkpointing: N - rank - 1 warm-up forwards, then alternate.

    Args/Returns: as `gpipe`.

    >>> from rpcompile import CostTable
    >>> len(one_f_one_b(CostTable.from_lists([1.0] * 3, [2.0] * 3), gpus=1, microbatches=2).instrs)
    9
    """
    n, m = gpus, microbatches
    orders = []
    for r in range(n):
        warm = min(n - r - 1, m)
        seq: list[_Item] = [("F", r, k) for k in range(warm)]
        for k in range(m - warm):
            seq += [("F", r, warm + k), ("B", r, k)]
        seq += [("B", r, k) for k in range(m - warm, m)]
        orders.append(seq)
    return _program(costs, n, m, 1, orders)


def interleaved_1f1b(costs: CostTable, *, gpus: int, microbatches: int, chunks: int = 2) -> Program:
    """Megatron's interleaved 1F1B: `chunks` stages per GPU, microbatches in groups of N.

    Args:
        chunks: model chunks (virtual stages) per GPU, V; needs microbatches % gpus == 0.
        Others as `gpipe`.
    Returns:
        A Program for `runtime.simulate`.

    >>> from rpcompile import CostTable
    >>> interleaved_1f1b(CostTable.from_lists([1.0] * 5, [2.0] * 5), gpus=2, microbatches=2).plan.to_str()
    '1,1,1|2|1,1,1'
    """
    n, m, v = gpus, microbatches, chunks
    if m % n:
        raise ValueError(f"interleaved 1F1B needs microbatches ({m}) divisible by gpus ({n})")
    total = m * v

    def item(kind: str, k: int, r: int) -> _Item:
        c = (k % (n * v)) // n
        return kind, (c if kind == "F" else v - 1 - c) * n + r, (k // (n * v)) * n + k % n

    orders = []
    for r in range(n):
        warm = total if m == n else min((n - r - 1) * 2 + (v - 1) * n, total)
        seq = [item("F", k, r) for k in range(warm)]
        for k in range(total - warm):
            seq += [item("F", warm + k, r), item("B", k, r)]
        seq += [item("B", k, r) for k in range(total - warm, total)]
        orders.append(seq)
    return _program(costs, n, m, v, orders)


def looped_bfs(costs: CostTable, *, gpus: int, microbatches: int, chunks: int = 2) -> Program:
    """Breadth-first looped pipeline: each GPU runs all microbatches of chunk 0, then chunk 1, ...

    Args:
        chunks: stages per GPU, V (stage v*N + r on GPU r); 1 gives GPipe.
        Others as `gpipe`.
    Returns:
        A Program for `runtime.simulate`.

    >>> from rpcompile import CostTable
    >>> looped_bfs(CostTable.from_lists([1.0] * 5, [2.0] * 5), gpus=2, microbatches=2).plan.num_stages
    7
    """
    n, m, v = gpus, microbatches, chunks
    orders = []
    for r in range(n):
        seq: list[_Item] = [("F", c * n + r, k) for c in range(v) for k in range(m)]
        seq += [("B", c * n + r, k) for c in reversed(range(v)) for k in range(m)]
        orders.append(seq)
    return _program(costs, n, m, v, orders)


def baselines(costs: CostTable, *, gpus: int, microbatches: int, chunks: int = 2) -> dict[str, Program]:
    """All four baselines by display name (interleaved only when microbatches % gpus == 0)."""
    out = {"GPipe": gpipe(costs, gpus=gpus, microbatches=microbatches),
           "1F1B": one_f_one_b(costs, gpus=gpus, microbatches=microbatches)}
    if microbatches % gpus == 0:
        out[f"interleaved 1F1B (V={chunks})"] = interleaved_1f1b(costs, gpus=gpus, microbatches=microbatches,
                                                                  chunks=chunks)
    out[f"looped BFS (V={chunks})"] = looped_bfs(costs, gpus=gpus, microbatches=microbatches, chunks=chunks)
    return out


def _program(costs: CostTable, n: int, m: int, v: int, orders: list[list[_Item]]) -> Program:
    """Turn per-GPU compute orders into a Program with transfers and GPU optimizer steps."""
    g_all = n * v
    plan = bound_plan(costs, g_all)
    groups = [plan.stages[g].layers for g in range(g_all)]
    last = g_all - 1

    def bwd(g: int) -> int:
        return last if g == last else 2 * last - g

    def on(g: int) -> int:
        return g % n

    def name(op: Op, g: int, k: int, grad: bool = False) -> str:  # F of group g, or its backward-side instrs
        return Instr(op, on(g), g if op is Op.FORWARD else bwd(g), k, grad=grad).name

    def fwd_down(g: int, k: int) -> str:
        return Instr(Op.ACT_DOWN, on(g), g, k).name

    def act_in(g: int, k: int) -> str:  # the name of what holds group g's input on its GPU
        return name(Op.FORWARD, g - 1, k) if on(g - 1) == on(g) else Instr(Op.ACT_UP, on(g), g, k).name

    streams: list[list[Instr]] = []
    for r, seq in enumerate(orders):
        out: list[Instr] = []
        for kind, g, k in seq:
            if kind == "F":
                deps = []
                if g > 0:
                    if on(g - 1) != r:
                        out.append(Instr(Op.ACT_UP, r, g, k, deps=(Ref(fwd_down(g - 1, k)),)))
                    deps.append(Ref(act_in(g, k)))
                deps += [Ref(Instr(Op.STEP, r, layer=l).name, back=1) for l in groups[g]]
                out.append(Instr(Op.FORWARD, r, g, k, deps=tuple(deps)))
                if g < last and on(g + 1) != r:
                    out.append(Instr(Op.ACT_DOWN, r, g, k, deps=(Ref(name(Op.FORWARD, g, k)),)))
                continue
            deps = [Ref(name(Op.FORWARD, g, k))] + ([Ref(act_in(g, k))] if g > 0 else [])
            out.append(Instr(Op.RECOMPUTE, r, bwd(g), k, deps=tuple(deps)))
            deps = [Ref(name(Op.RECOMPUTE, g, k))]
            if g < last:
                if on(g + 1) != r:
                    out.append(Instr(Op.ACT_UP, r, bwd(g), k, grad=True,
                                     deps=(Ref(name(Op.ACT_DOWN, g + 1, k)),)))
                    deps.append(Ref(name(Op.ACT_UP, g, k, grad=True)))
                else:
                    deps.append(Ref(name(Op.BACKWARD, g + 1, k)))
            out.append(Instr(Op.BACKWARD, r, bwd(g), k, deps=tuple(deps)))
            if g > 0 and on(g - 1) != r:
                out.append(Instr(Op.ACT_DOWN, r, bwd(g), k, deps=(Ref(name(Op.BACKWARD, g, k)),)))
        for g in sorted({g for _, g, _ in seq}, reverse=True):  # GPU optimizer, layers descending
            final = max(i for i, (kind, gg, _) in enumerate(seq) if kind == "B" and gg == g)
            dep = Ref(name(Op.BACKWARD, g, seq[final][2]))
            out += [Instr(Op.STEP, r, layer=l, deps=(dep,)) for l in reversed(groups[g])]
        streams.append(out)
    return Program(plan, n, m, m, 0, 0, 0, _merge(streams), ())


def _merge(streams: list[list[Instr]]) -> tuple[Instr, ...]:
    """Interleave per-GPU streams into one topological order (each stream keeps its order)."""
    placed: set[str] = set()
    heads = [0] * len(streams)
    out: list[Instr] = []
    while len(out) < sum(map(len, streams)):
        moved = False
        for w, s in enumerate(streams):
            while heads[w] < len(s) and all(d.back or d.name in placed for d in s[heads[w]].deps):
                out.append(s[heads[w]])
                placed.add(s[heads[w]].name)
                heads[w] += 1
                moved = True
        if not moved:
            stuck = [s[heads[w]].name for w, s in enumerate(streams) if heads[w] < len(s)]
            raise RuntimeError(f"baseline schedule deadlocks at {stuck}")
    return tuple(out)
