"""The simulator's memory model: each worker's peak bytes over a simulated run (`simulate`'s `peak_memory`).

A worker holds the optimizer state of the layers whose step runs on it (the bound-stage baselines), the
parameter chunks its uploads bring until their release, each buffer an instruction makes until its last
same-worker consumer ends (`CONSUMERS`), the workspace of a compute while it runs, and a gradient slot's
gradients from their first write to their last use. The loop over the jobs runs in C (`memory.c`, through
`native.peaks_native`) where the simulator's kernel is available, in Python otherwise: the same integers.
"""
from __future__ import annotations

from typing import Any, Callable

from rpcompile.ir.costs import CostTable
from rpcompile.ir.program import COMPUTE_OPS, Instr, Op, Program
from rpcompile.runtime.sim.events import Jobs, peak_usage
from rpcompile.runtime.sim.native import load, peaks_native

STATE_PER_PARAM_BYTE = 6    # fp32 master + Adam m + v (12 B) per 2 B parameter
CONSUMERS = {  # which same-worker dependents use a buffer made by an op (they free it when done)
    Op.ACT_UP: COMPUTE_OPS, Op.FORWARD: COMPUTE_OPS | {Op.ACT_DOWN}, Op.FUSED: COMPUTE_OPS | {Op.ACT_DOWN},
    Op.BACKWARD: COMPUTE_OPS | {Op.ACT_DOWN}, Op.RECOMPUTE: frozenset({Op.BACKWARD}),
    Op.PARAM_UP: COMPUTE_OPS | {Op.RELEASE},
}


def peaks(program: Program, costs: CostTable, moved: Callable[[Instr], int], wk: list[int], jobs: Jobs,
          starts: list[float], ends: list[float]) -> tuple[int, ...]:
    """Per worker peak bytes: resident state, parameter chunks, gradients, activations, workspace (the loop over
    the jobs in C, `memory.c`, where the simulator's kernel is available: the same integers)."""
    nw = program.gpus
    resident: list[set[int]] = [set() for _ in range(nw)]
    for i in program.instrs:
        if i.op is Op.STEP and i.worker >= 0:
            resident[i.worker].add(i.layer)
    base = [sum(costs.param_bytes[l] * (1 + STATE_PER_PARAM_BYTE) + costs.grad_bytes[l] for l in ls)
            for ls in resident]
    lib = load()
    if lib is not None:
        got = peaks_native(lib, program, costs, resident, per_kind(buffer_size, program.instrs, program, costs, moved),
                           CONSUMERS, wk, jobs, starts, ends)
        return tuple(b + p for b, p in zip(base, got))
    return tuple(b + p for b, p in zip(base, _peaks_python(program, costs, moved, resident, wk, jobs, starts, ends)))


def _peaks_python(program: Program, costs: CostTable, moved: Callable[[Instr], int], resident: list[set[int]],
                  wk: list[int], jobs: Jobs, starts: list[float], ends: list[float]) -> list[int]:
    """`peaks`' loop over the jobs in Python, without the resident state."""
    nw, n = program.gpus, len(program.instrs)
    stages = program.plan.stages
    free_at = list(ends)  # a buffer lives until its last same-worker consumer ends
    ops = [i.op for i in program.instrs]
    # frees[k]: per template, the templates whose buffers instruction k uses (and frees when done), as flags
    frees_kind = {op: [op in CONSUMERS.get(made, ()) for made in ops] for op in set(ops)}
    frees_kind = {op: f if any(f) else None for op, f in frees_kind.items()}
    frees = [frees_kind[op] for op in ops]
    ptr, idx = jobs.dep_ptr, jobs.dep_idx
    for j in range(len(jobs)):
        f = frees[j % n]
        if f is not None:
            w, e = wk[j], ends[j]
            for d in idx[ptr[j]:ptr[j + 1]]:
                if wk[d] == w and f[d % n] and e > free_at[d]:
                    free_at[d] = e
    sizes = per_kind(buffer_size, program.instrs, program, costs, moved)
    # per template: whether it is on a GPU's books at all, and the gradient slot its FUSED / BACKWARD / G writes
    # or reads ((stage, round, its layers), None for other ops)
    counted = [i.op not in (Op.STEP, Op.COPY) for i in program.instrs]
    layer_sets = [frozenset(st.layers) for st in stages]
    slots = [(i.stage, i.round if i.op is Op.GRAD_DOWN else i.mb // program.round_size, layer_sets[i.stage])
             if i.op in (Op.FUSED, Op.BACKWARD, Op.GRAD_DOWN) else None for i in program.instrs]
    intervals: list[list[tuple[float, float, int]]] = [[] for _ in range(nw)]
    grads: dict[tuple[int, int, int, int], list[float]] = {}  # slot -> [first write, last use]
    for j, w in enumerate(wk):
        k = j % n
        if w < 0 or not counted[k]:
            continue
        size, work = sizes[k]
        if work:
            intervals[w].append((starts[j], ends[j], work))
        if size:
            intervals[w].append((starts[j], free_at[j], size))
        slot = slots[k]
        if slot is not None and not slot[2] <= resident[w]:
            span = grads.setdefault((j // n, w, slot[0], slot[1]), [starts[j], ends[j]])
            if ends[j] > span[1]:
                span[1] = ends[j]
    for (_, w, s, _), (a, b) in grads.items():
        intervals[w].append((a, b, sum(costs.grad_bytes[l] for l in stages[s].layers)))
    return [peak_usage(intervals[w]) for w in range(nw)]


def per_kind(fn, instrs, *args) -> list:
    """[fn(i, *args) for i in instrs], computed once per kind of instruction: `simulator._duration` and
    `buffer_size` read only the op, stage, chunk, grad flag, layer and whether the worker is the host (a paper
    model's program has thousands of instructions of a few hundred kinds)."""
    seen: dict[tuple, Any] = {}
    out = []
    for i in instrs:
        key = (i.op, i.stage, i.chunk, i.grad, i.layer, i.worker < 0)
        if key not in seen:
            seen[key] = fn(i, *args)
        out.append(seen[key])
    return out


def buffer_size(i: Instr, program: Program, costs: CostTable, moved: Callable[[Instr], int]) -> tuple[int, int]:
    """(bytes of the buffer an instruction makes, bytes of workspace while it runs)."""
    if i.op in (Op.ACT_UP, Op.PARAM_UP):
        return moved(i), 0
    if i.stage < 0 or i.op not in COMPUTE_OPS:
        return 0, 0
    layers = program.plan.stages[i.stage].layers
    if i.op is Op.FORWARD:
        return moved(Instr(Op.ACT_DOWN, i.worker, i.stage, i.mb)), 0
    if i.op is Op.RECOMPUTE:  # autograd tensors of the stage, held until its backward
        return sum(costs.peak_bytes[l] for l in layers), 0
    grad_in = costs.act_bytes[layers.start - 1] if layers.start > 0 else 0
    return grad_in, sum(costs.peak_bytes[l] for l in layers) if i.op is Op.FUSED else 0
