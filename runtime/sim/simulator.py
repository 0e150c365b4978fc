"""simulate(program, costs, hardware) -> Timeline: a discrete-event run of a Program.

The hardware model: per GPU one compute lane and two PCIe directions. Uploads
(act_up, high priority; param_up, low) share the host->device bandwidth,
downloads (act_down, high; grad_down, low) the device->host bandwidth; a
started transfer is not preempted (chunks keep the wait short). The host runs
the optimizer lane (per-layer steps) and the copy lane. Every (worker, lane)
runs its instructions FIFO in program order, iteration t before t+1.

    >>> from rpcompile import CostTable, StagePlan
    >>> from rpcompile.passes import emit
    >>> hw = type("HW", (), dict(h2d_bandwidth=float("inf"), d2h_bandwidth=float("inf"),
    ...                          optimizer_bytes_per_s=float("inf")))()
    >>> c = CostTable.from_lists(fwd=[1.0] * 2, bwd=[2.0] * 2)
    >>> simulate(emit(StagePlan.from_str("1|1|1"), gpus=2, microbatches=2), c, hw).makespan
    9.0

What it returns, the `Timeline` and its `Record`s with their views, is in
`runtime/sim/timeline.py`; this module holds the run and its cost model, `runtime/sim/memory.py` its
memory model.

Note: durations. F = sum of the stage's `fwd`, X = fwd + bwd, R = fwd, B = bwd,
E = 0. P/G move `Chunk.bytes`. U moves the input activation (`act_bytes` of the
layer before the stage; the model input `saved_bytes[0]` for layer 0), a B
slot's saved input (`saved_bytes` of its first layer) or, with `grad`, the
output gradient (`act_bytes` of its last layer). D moves an F stage's output
plus the saved inputs of B stages that start strictly inside it, or a
backward's input gradient. A transfer takes link_latency + bytes / bandwidth.
A host step O takes MASTER_PER_PARAM_BYTE * grad_bytes / optimizer_bytes_per_s
(an fp32 master of a 16-bit training copy; frozen parameters have none), plus with `nodes` k > 1 the ring
all-reduce of its fp32 gradient (`ring_allreduce_time` over `net_bandwidth`,
`net_latency`: data parallelism, issue #9); a copy C takes grad_bytes /
host_memcpy_bandwidth (0 without one). An O on a GPU worker (the bound-stage
baselines) takes fp32 master bytes / device_optimizer_bytes_per_s (default
mem_bandwidth * ADAM_MASTER_SHARE, as Adam is memory-bound; 0 without
either) and makes that GPU hold the layer's parameters, gradients and
optimizer state for the whole run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rpcompile.ir.costs import CostTable
from rpcompile.passes.partition.timing import steady_state_window
from rpcompile.ir.plan import StageKind
from rpcompile.ir.program import COMPUTE_OPS, Instr, Lane, Op, Program
from rpcompile.runtime.distributed import ring_allreduce_time
from rpcompile.runtime.sim.events import Jobs, StuckError, exposed_waits, run_jobs
from rpcompile.runtime.sim.memory import peaks, per_kind
from rpcompile.runtime.sim.native import expand_native, load, totals_native
from rpcompile.runtime.sim.timeline import Records, Timeline

MASTER_PER_PARAM_BYTE = 2   # fp32 master bytes per byte of 16-bit parameters
ADAM_MASTER_SHARE = 4 / 30  # a GPU Adam step moves ~30 B per parameter (4 B of it the fp32 master)
_TRANSFER_OPS = frozenset({Op.PARAM_UP, Op.ACT_UP, Op.ACT_DOWN, Op.GRAD_DOWN})
_HIGH = frozenset({Lane.ACT_UP, Lane.ACT_DOWN})
_CHANNEL = {Lane.ACT_UP: "h2d", Lane.PARAM_UP: "h2d", Lane.ACT_DOWN: "d2h", Lane.GRAD_DOWN: "d2h"}


def simulate(program: Program, costs: CostTable, hardware, *, iterations: int = 1,
             nodes: int | None = None) -> Timeline:
    """Run `iterations` back-to-back iterations of `program` on a hardware model.

    Args:
        program: the schedule (emit's RoundPipe program or a runtime.sim.baselines program).
        costs: per-layer times and bytes; must match program.plan.
        hardware: any object with `h2d_bandwidth`, `d2h_bandwidth` (bytes/s per GPU),
            `optimizer_bytes_per_s` (fp32 master bytes/s of the host optimizer) and optionally
            `link_latency` (s), `host_memcpy_bandwidth`, `device_optimizer_bytes_per_s` (bytes/s).
        iterations: iteration t runs `program.shifted(t)`; deps reach back through Ref.back.
        nodes: data-parallel processes (default `hardware.nodes`, else 1); > 1 adds each layer group's
            gradient all-reduce (hardware `net_bandwidth`, `net_latency`) to its host step.
    Returns:
        A Timeline. With iterations > 1 the steady time is (C[K-1] - C[K-1-P]) / P over the
        last P iterations, (K, P) = steady_state_window(gpus, stages, rounds), when
        iterations >= K; else C[-1] / iterations (the mean from time 0, fill included).

    >>> hw = type("HW", (), dict(h2d_bandwidth=1e9, d2h_bandwidth=1e9, optimizer_bytes_per_s=1e9))()
    >>> from rpcompile import CostTable, StagePlan
    >>> from rpcompile.passes import emit
    >>> c = CostTable.from_lists(fwd=[1.0] * 2, bwd=[2.0] * 2, act_bytes=[10**8] * 2)
    >>> t = simulate(emit(StagePlan.from_str("1|1|1"), gpus=2, microbatches=2), c, hw)
    >>> round(t.iteration_time, 3), t.iterations, round(t.exposed_comm, 3)
    (9.4, 1, 0.4)
    """
    plan = program.plan
    if costs.num_layers != plan.num_layers:
        raise ValueError(f"simulate: the program's plan has {plan.num_layers} layers but the cost table has "
                         f"{costs.num_layers}")
    if iterations < 1:
        raise ValueError(f"simulate: iterations must be >= 1, got {iterations}")
    bw = _Bandwidths.of(hardware, nodes)
    tmpl = program.instrs
    n = len(tmpl)
    pos = program.index()
    moved = _Moved(program, costs)
    durations = per_kind(_duration, tmpl, program, costs, bw, moved)
    lane_ids: dict[tuple[int, Lane], int] = {}
    channel_ids: dict[tuple[int, str], int] = {}
    deps_of = []
    for i in tmpl:
        for ref in i.deps:
            if ref.name not in pos:
                raise ValueError(f"simulate: {i.name} depends on {ref.name!r}, which is not in the program")
        deps_of.append([(ref.back, ref.since, pos[ref.name]) for ref in i.deps])
    short = [i.short for i in tmpl]
    # per template instruction, what does not depend on the iteration (the loop below runs K x n times)
    host = [i.is_host for i in tmpl]
    lanes = [i.lane for i in tmpl]
    chans = [_CHANNEL.get(lane, lane.value) for lane in lanes]
    prio = [0 if lane in _HIGH else 1 for lane in lanes]
    lane_col: list[int] = []
    chan_col: list[int] = []
    wk: list[int] = []  # each job's physical worker: program.shifted(t)'s
    ids: dict[int, tuple[list[int], list[int], list[int]]] = {}  # per rotation: each template's worker, lane, channel
    # the distinct (template worker, lane, channel) in order of first use: a rotation maps them one to one onto
    # physical (worker, lane)s, so numbering these in this order numbers the lanes and channels in order of first use
    kinds: dict[tuple, int] = {}
    kind_of = [kinds.setdefault((i.worker, lanes[k], chans[k], host[k]), len(kinds)) for k, i in enumerate(tmpl)]
    for t in range(iterations):
        shift = (t * program.shift) % program.gpus
        if shift not in ids:  # ids numbered in order of first use, as the jobs are listed
            w_of = [w if h else (w + shift) % program.gpus for w, _, _, h in kinds]
            l_of = [lane_ids.setdefault((w, lane), len(lane_ids)) for w, (_, lane, _, _) in zip(w_of, kinds)]
            c_of = [channel_ids.setdefault((w, ch), len(channel_ids)) for w, (_, _, ch, _) in zip(w_of, kinds)]
            ids[shift] = ([w_of[c] for c in kind_of], [l_of[c] for c in kind_of], [c_of[c] for c in kind_of])
        ws, lane_of, chan_of = ids[shift]
        lane_col += lane_of
        chan_col += chan_of
        wk += ws
    jobs = Jobs(lane_col, chan_col, prio * iterations, durations * iterations,
                *_expand_deps(deps_of, iterations, n))
    try:
        starts, ends = run_jobs(jobs)
    except StuckError as e:
        j = e.stuck[0]
        raise RuntimeError(f"simulate: {len(e.stuck)} instructions never ran, first {tmpl[j % n].name} of "
                           f"iteration {j // n} (template numbering):\n"
                           f"{program.grid(mark=tmpl[j % n].name, context=4)}") from None
    compute = [i.op in COMPUTE_OPS for i in tmpl]
    transfer = [i.op in _TRANSFER_OPS for i in tmpl]
    lib = load()
    totals = totals_native if lib is not None and n else lambda _, *a: _totals_python(*a)
    busy, ends_t, exposed = totals(lib, jobs, starts, ends, wk, compute, transfer, iterations, program.gpus)
    makespan = max(ends, default=0.0)
    steady = _steady(ends_t, program, makespan)
    work = sum(busy)
    records = Records([i.name for i in tmpl], short, host, [lane._value_ for lane in lanes],
                      [i.op._value_ for i in tmpl], wk, starts, ends)
    nw = program.gpus
    return Timeline(
        gpus=nw, iterations=iterations, makespan=makespan, iteration_ends=tuple(ends_t),
        iteration_time=makespan if iterations == 1 else steady, steady_iteration_time=steady,
        busy=tuple(busy), bubble_ratio=1.0 - work / (nw * makespan) if makespan > 0 else 0.0,
        steady_bubble=1.0 - work / iterations / (nw * steady) if steady > 0 else 0.0,
        exposed_comm=sum(exposed), exposed_per_worker=tuple(exposed),
        peak_memory=peaks(program, costs, moved, wk, jobs, starts, ends), records=records)


def _totals_python(jobs: Jobs, starts: list[float], ends: list[float], wk: list[int], compute: list[bool],
                   transfer: list[bool], iterations: int, gpus: int) -> tuple[list[float], list[float], list[float]]:
    """(busy seconds per worker, the latest compute end per iteration, exposed wait per worker) over the compute
    jobs, summed in job order (`native.totals_native` in C: the same floats)."""
    n = len(compute)
    computes = [j for j in range(iterations * n) if compute[j % n]]  # the compute jobs, in order
    busy = [0.0] * gpus
    ends_t = [0.0] * iterations
    for j in computes:
        busy[wk[j]] += ends[j] - starts[j]
        if ends[j] > ends_t[j // n]:
            ends_t[j // n] = ends[j]
    waits = exposed_waits(jobs, starts, ends, transfer * iterations, compute * iterations, native=False)
    exposed = [0.0] * gpus
    for j in computes:
        exposed[wk[j]] += waits[j]
    return busy, ends_t, exposed


def _expand_deps(deps_of: list[list[tuple[int, int, int]]], iterations: int, n: int):
    """The dependencies of `iterations` copies of the n templates, as CSR (ptr, idx): template k's deps
    (back, since, d) in iteration t are job (t - back) * n + d, those with t - back >= 0 and t >= since
    (in C, `native.expand_native`, where the simulator's kernel is available: the same integers)."""
    lib = load()
    if lib is not None:
        return expand_native(lib, deps_of, iterations, n)
    return _expand_deps_python(deps_of, iterations, n)


def _expand_deps_python(deps_of: list[list[tuple[int, int, int]]], iterations: int,
                        n: int) -> tuple[list[int], list[int]]:
    """`_expand_deps`' loop in Python."""
    full = [max((max(back, since) for back, since, _ in dl), default=0) for dl in deps_of]  # all deps from here
    offs = [d - back * n for dl in deps_of for back, _, d in dl]  # iteration t's deps, once t >= max(full)
    ends, acc = [], 0
    for dl in deps_of:
        acc += len(dl)
        ends.append(acc)
    ptr, idx, steady = [0], [], max(full, default=0)
    for t in range(iterations):
        base = t * n
        if t >= steady:
            at = len(idx)
            idx += [base + o for o in offs]
            ptr += [at + e for e in ends]
            continue
        for k, dl in enumerate(deps_of):
            idx += [(t - back) * n + d for back, since, d in dl if t - back >= 0 and t >= since]
            ptr.append(len(idx))
    return ptr, idx


@dataclass(frozen=True, slots=True)
class _Bandwidths:
    """The hardware attributes the simulator reads (bytes/s; inf = free)."""

    h2d: float
    d2h: float
    optimizer: float
    latency: float
    memcpy: float
    device_optimizer: float
    nodes: int = 1
    net: float = math.inf
    net_latency: float = 0.0

    @classmethod
    def of(cls, hw, nodes: int | None = None) -> "_Bandwidths":
        """Read the attributes by name; the first three are required."""
        need = ("h2d_bandwidth", "d2h_bandwidth", "optimizer_bytes_per_s")
        missing = [a for a in need if not hasattr(hw, a)]
        if missing:
            raise ValueError(f"simulate: hardware {hw!r} lacks {missing} (bytes/s; float('inf') for free)")
        vals = cls(float(hw.h2d_bandwidth), float(hw.d2h_bandwidth), float(hw.optimizer_bytes_per_s),
                   float(getattr(hw, "link_latency", 0.0) or 0.0),
                   float(getattr(hw, "host_memcpy_bandwidth", math.inf) or math.inf),
                   float(getattr(hw, "device_optimizer_bytes_per_s", None)
                         or getattr(hw, "mem_bandwidth", math.inf) * ADAM_MASTER_SHARE),
                   int(nodes or getattr(hw, "nodes", 1) or 1), float(getattr(hw, "net_bandwidth", math.inf)),
                   float(getattr(hw, "net_latency", 0.0) or 0.0))
        for name, v in zip(need, (vals.h2d, vals.d2h, vals.optimizer)):
            if not v > 0:
                raise ValueError(f"simulate: hardware {name} must be > 0, got {v!r}")
        return vals


def _duration(i: Instr, program: Program, costs: CostTable, bw: _Bandwidths, moved: "_Moved") -> float:
    """Seconds one instruction takes."""
    op = i.op
    if op is Op.RELEASE:
        return 0.0
    if op in (Op.STEP, Op.COPY):
        pb = costs.grad_bytes[i.layer]  # trainable bytes: frozen parameters are never stepped or copied
        if op is Op.COPY:
            return pb / bw.memcpy
        net = ring_allreduce_time(MASTER_PER_PARAM_BYTE * pb, bw.nodes, bw.net, bw.net_latency) if pb else 0.0
        return net + MASTER_PER_PARAM_BYTE * pb / (bw.optimizer if i.worker < 0 else bw.device_optimizer)
    layers = program.plan.stages[i.stage].layers
    f = sum(costs.fwd[l] for l in layers)
    b = sum(costs.bwd[l] for l in layers)
    if op in COMPUTE_OPS:
        return {Op.FORWARD: f, Op.FUSED: f + b, Op.RECOMPUTE: f, Op.BACKWARD: b}[op]
    return bw.latency + moved(i) / (bw.h2d if op in (Op.PARAM_UP, Op.ACT_UP) else bw.d2h)


def transfer_bytes(i: Instr, program: Program, costs: CostTable) -> int:
    """Bytes a P/G/U/D instruction moves (see the module Note)."""
    if i.op in (Op.PARAM_UP, Op.GRAD_DOWN):
        return program.chunk_of(i).bytes
    stage = program.plan.stages[i.stage]
    first, last = stage.layers.start, stage.layers.stop - 1
    if i.op is Op.ACT_UP:
        if stage.kind is StageKind.B:
            return costs.act_bytes[last] if i.grad else costs.saved_bytes[first]
        return costs.act_bytes[first - 1] if first > 0 else costs.saved_bytes[0]
    if stage.kind is StageKind.F:  # D of a forward stage: output + saved inputs made inside it
        inner = sum(costs.saved_bytes[s.layers.start] for s in program.plan.stages
                    if s.kind is StageKind.B and first < s.layers.start <= last)
        return costs.act_bytes[last] + inner
    return costs.act_bytes[first - 1] if first > 0 else 0


class _Moved:
    """`transfer_bytes` of one program's instructions, each distinct transfer computed once (a paper model's
    program has thousands of P/G/U/D instructions over a few hundred distinct chunks and slots)."""

    def __init__(self, program: Program, costs: CostTable) -> None:
        self.program, self.costs = program, costs
        self.chunks = {(c.stage, c.index): c.bytes for c in program.chunks}
        self.seen: dict[tuple, int] = {}

    def __call__(self, i: Instr) -> int:
        if i.op in (Op.PARAM_UP, Op.GRAD_DOWN):
            return self.chunks[(i.stage, i.chunk)]
        key = (i.op, i.stage, i.grad)
        if key not in self.seen:
            self.seen[key] = transfer_bytes(i, self.program, self.costs)
        return self.seen[key]


def steady_iterations(program: Program) -> int:
    """How many back-to-back iterations `simulate` needs for the steady state of `program` (staleness 1)."""
    return steady_state_window(program.gpus, program.plan.num_stages, program.rounds)[0]


def _steady(ends: list[float], program: Program, makespan: float) -> float:
    """Steady-state time per iteration from the C_t (see simulate)."""
    it = len(ends)
    if it == 1:
        return makespan
    k, p = steady_state_window(program.gpus, program.plan.num_stages, program.rounds)
    if it < k:  # too few for the window (early iterations overlap unevenly): average from time 0
        return ends[-1] / it
    return (ends[-1] - ends[-1 - p]) / p
