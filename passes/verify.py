"""verify: check a Program against the schedule's rules; the checker `compile()` calls.

Each rule is a small function in `RULES` (name -> checker), run in order; pass
`rules=(...)` to run a subset. Path properties are checked on two consecutive
iterations instantiated in the steady state (logical iterations 2 and 3, so
no dependency is vacuous), with the lanes of both joined in execution order.

    >>> from rpcompile.passes import emit
    >>> from rpcompile.ir.plan import StagePlan
    >>> p = emit(StagePlan.from_str("2|1|2"), gpus=2, microbatches=4)
    >>> verify(p) is p
    True
"""
from __future__ import annotations

from collections import Counter

from rpcompile.ir.costs import CostTable
from rpcompile.ir.plan import StageKind
from rpcompile.ir.program import CHUNK_OPS, COMPUTE_OPS, HOST_OPS, MB_OPS, Instr, Op, Program, ProgramError
from rpcompile.passes.order import HappensBefore

FIRST = 2  # logical iteration of the window's first instance (>= every `since` in use)


class _Ctx:
    """Shared facts: names, the two-iteration window and its happens-before (`passes.order`)."""

    def __init__(self, program: Program, costs: CostTable | None, budget: int | None) -> None:
        self.p, self.costs, self.budget = program, costs, budget
        self.n, self.stages = program.gpus, program.plan.stages
        self.ns, self.rr = len(self.stages), program.round_size
        self.pos = {i.name: k for k, i in enumerate(program.instrs)}
        self._order: HappensBefore | None = None
        self.forward_of: dict[int, int] = {}  # layer -> the first forward group holding it
        for j, r in enumerate(program.plan.fwd):
            for layer in r:
                self.forward_of.setdefault(layer, j)
        self.slots: dict[tuple, list[Instr]] = {}
        for i in program.instrs:
            if not i.is_host:
                rnd = i.round if i.op in CHUNK_OPS or i.op is Op.RELEASE else i.mb // self.rr
                self.slots.setdefault((i.op, i.stage, rnd), []).append(i)

    def fail(self, rule: str, name: str | None, message: str) -> None:
        grid = self.p.grid(mark=name, context=6) if name in self.pos else ""
        raise ProgramError(rule, name, message, grid)

    def order(self) -> HappensBefore:
        """The happens-before of the window (deps + lane order, every lane), built once."""
        if self._order is None:
            self._order = HappensBefore(self.p, first=FIRST, iterations=2)
        return self._order

    def need(self, rule: str, a: tuple[int, str], b: tuple[int, str], what: str) -> None:
        """Fail `rule` at b unless a is ordered before b."""
        if not self.order().before(a, b):
            it = lambda x: f"{x[1]} (iteration t{'+1' if x[0] else ''})"
            self.fail(rule, b[1], f"{what}: {it(b)} is not ordered after {it(a)}")

    def final(self, stage: int, mb: int) -> str:
        """Name of the final compute of (stage, mb)."""
        st = self.stages[stage]
        op = {StageKind.F: Op.FORWARD, StageKind.FB: Op.FUSED, StageKind.B: Op.BACKWARD}[st.kind]
        return f"w{self.worker(stage, mb // self.rr)} {op.value}{stage}.m{mb}"

    def worker(self, stage: int, rnd: int) -> int:
        return (self.p.worker_offset + rnd * self.ns + stage) % self.n

    def slot_instrs(self, op: Op, stage: int, rnd: int) -> list[Instr]:
        return self.slots.get((op, stage, rnd), [])


def _structure(c: _Ctx) -> None:
    """Fields in range, each slot on its round-robin worker, complete chunk sets."""
    p = c.p
    chunk_keys = {(ch.stage, ch.index) for ch in p.chunks}
    for i in p.instrs:
        if (i.worker == -1) != (i.op in HOST_OPS):
            c.fail("STRUCTURE", i.name, "host ops (O, C) run on worker -1, all others on a device")
        if i.op in HOST_OPS:
            if not 0 <= i.layer < p.plan.num_layers:
                c.fail("STRUCTURE", i.name, f"layer {i.layer} out of range")
            continue
        rnd = i.mb // c.rr if i.op in MB_OPS else i.round
        if not (0 <= i.stage < c.ns and 0 <= rnd < p.rounds) or (i.op in MB_OPS and not 0 <= i.mb < p.microbatches):
            c.fail("STRUCTURE", i.name, "stage, round or microbatch out of range")
        if i.worker != c.worker(i.stage, rnd):
            c.fail("STRUCTURE", i.name, f"slot {rnd * c.ns + i.stage} must run on worker {c.worker(i.stage, rnd)}")
        if i.op in CHUNK_OPS and (i.stage, i.chunk) not in chunk_keys:
            c.fail("STRUCTURE", i.name, "no such chunk")
    chunks: dict[int, list] = {}  # stage -> its chunks (`Program.stage_chunks`, grouped in one pass)
    for ch in p.chunks:
        chunks.setdefault(ch.stage, []).append(ch)
    for st in c.stages:
        n_chunks = len(chunks.get(st.index, ()))
        covered = {l for ch in chunks.get(st.index, ()) for l in ch.layers}
        if covered != set(st.layers):
            c.fail("STRUCTURE", None, f"chunks of stage {st.index} cover layers {sorted(covered)}, not {list(st.layers)}")
        for r in range(p.rounds):
            for op in (Op.PARAM_UP,) + ((Op.GRAD_DOWN,) if st.kind is not StageKind.F else ()):
                if len(c.slot_instrs(op, st.index, r)) != n_chunks:
                    c.fail("STRUCTURE", None, f"slot (stage {st.index}, round {r}) needs {n_chunks} {op.name}")


def _once(c: _Ctx) -> None:
    """Every (stage, microbatch) computed exactly once: F/X, or R then B for B stages."""
    count = Counter((i.op, i.stage, i.mb) for i in c.p.instrs if i.op in COMPUTE_OPS)
    want = {StageKind.F: (Op.FORWARD,), StageKind.FB: (Op.FUSED,), StageKind.B: (Op.RECOMPUTE, Op.BACKWARD)}
    for (op, stage, mb), k in count.items():
        if op not in want[c.stages[stage].kind] or k != 1:
            c.fail("ONCE", next(i.name for i in c.p.instrs if (i.op, i.stage, i.mb) == (op, stage, mb)),
                   f"computed {k} times on a {c.stages[stage].kind.value} stage")
    for st in c.stages:
        for mb in range(c.p.microbatches):
            for op in want[st.kind]:
                if not count[(op, st.index, mb)]:
                    c.fail("ONCE", None, f"{op.name} of stage {st.index} microbatch {mb} is missing")


def _deps(c: _Ctx) -> None:
    """Names unique; every dependency names an instruction of the program."""
    seen = Counter(i.name for i in c.p.instrs)
    for name, k in seen.items():
        if k > 1:
            c.fail("DEPS", name, f"instruction name used {k} times")
    for i in c.p.instrs:
        for d in i.deps:
            if d.name not in c.pos or d.back < 0 or d.since < 0:
                c.fail("DEPS", i.name, f"dependency {d} does not resolve")


def _acyclic(c: _Ctx) -> None:
    """Program order is topological (same-iteration deps come earlier), so no cycle exists."""
    for k, i in enumerate(c.p.instrs):
        for d in i.deps:
            if d.back == 0 and c.pos[d.name] >= k:
                c.fail("ACYCLIC", i.name, f"depends on {d.name}, which is not earlier in program order "
                                          "(a cycle, or an order the lanes cannot execute)")


def _input(c: _Ctx) -> None:
    """Every compute reads its uploaded input (produced upstream) and its slot's uploaded parameters."""
    for i in c.p.instrs:
        if i.op not in COMPUTE_OPS:
            continue
        st, m, w = c.stages[i.stage], i.mb, i.worker
        ups = [(f"w{w} U{i.stage}.m{m}", None)]
        if i.op is Op.BACKWARD:
            ups = [(f"w{w} R{i.stage}.m{m}", None), (f"w{w} U{i.stage}.m{m}g", i.stage - 1)]
        elif i.op is Op.RECOMPUTE:
            ups = [(ups[0][0], c.forward_of.get(st.layers.start - 1))]
        elif i.stage > 0:
            ups = [(ups[0][0], i.stage - 1)]
        for u, producer in ups:
            if u not in c.pos:
                c.fail("INPUT", i.name, f"missing its input {u}")
            c.need("INPUT", (1, u), (1, i.name), "a compute must read its uploaded input")
            if producer is not None:
                src = c.final(producer, m)
                down = f"{src.split(' ')[0]} D{producer}.m{m}"
                if down not in c.pos:
                    c.fail("INPUT", u, f"the producer's download {down} is missing")
                c.need("INPUT", (1, src), (1, down), "a download must follow its compute")
                c.need("INPUT", (1, down), (1, u), "an upload must follow the producer's download")
        if i.op in (Op.FORWARD, Op.FUSED, Op.RECOMPUTE) and m % c.rr == 0:
            for pu in c.slot_instrs(Op.PARAM_UP, i.stage, m // c.rr):
                c.need("INPUT", (1, pu.name), (1, i.name), "a slot's parameters must be uploaded before it runs")


def _grad(c: _Ctx) -> None:
    """Gradient chunks after the slot's last microbatch; the release after its compute and gradients."""
    for i in c.p.instrs:
        if i.op in (Op.GRAD_DOWN, Op.RELEASE):
            last = c.final(i.stage, (i.round + 1) * c.rr - 1)
            c.need("GRAD", (1, last), (1, i.name), "gradients/release must follow the slot's last microbatch")
            if i.op is Op.RELEASE:
                for g in c.slot_instrs(Op.GRAD_DOWN, i.stage, i.round):
                    c.need("GRAD", (1, g.name), (1, i.name), "a slot is released after its gradient downloads")


def _release(c: _Ctx) -> None:
    """Two stage buffers: slot k's parameter upload waits for the release of the worker's slot k-2N."""
    sr = c.ns * c.p.rounds
    for i in c.p.instrs:
        if i.op is Op.PARAM_UP:
            k = i.round * c.ns + i.stage - 2 * c.n
            if k < -sr:
                continue  # more than one iteration back: outside the window
            t, kl = (1, k) if k >= 0 else (0, k + sr)
            e = f"w{c.worker(kl % c.ns, kl // c.ns)} E{kl % c.ns}.r{kl // c.ns}"
            c.need("RELEASE", (t, e), (1, i.name), "a parameter upload needs a free stage buffer")


def _layer_instrs(c: _Ctx, op: Op) -> dict[int, list[str]]:
    """Optimizer group l -> the P or G chunks touching it (its own layer and tied readers)."""
    out: dict[int, list[str]] = {l: [] for l in range(c.p.plan.num_layers)}
    groups = {(ch.stage, ch.index): sorted({g for j in ch.layers for g in c.p.groups_of(j)}) for ch in c.p.chunks}
    for i in c.p.instrs:
        if i.op is op:
            for l in groups.get((i.stage, i.chunk), ()):  # no such chunk: STRUCTURE's to report
                out[l].append(i.name)
    return out


def _r1(c: _Ctx) -> None:
    """R1: COPY.l of iteration t (overwriting the version t reads) after every upload of l in t; with
    staleness 0 also STEP.l, which the runtime lets write the compute copy in the update's pass."""
    for l, ps in _layer_instrs(c, Op.PARAM_UP).items():
        for t in (0, 1):
            for pu in ps:
                c.need("R1", (t, pu), (t, f"h C.l{l}"), "a copy must wait for the uploads reading the old version")
                if c.p.staleness == 0:
                    c.need("R1", (t, pu), (t, f"h O.l{l}"), "a step that writes the copy (staleness 0) must wait "
                                                            "for the uploads reading the old version")


def _r2(c: _Ctx) -> None:
    """R2: uploads of l in t+1 after the COPY.l of iteration t (copy(t) or, staleness 1, copy(t-1))."""
    for l, ps in _layer_instrs(c, Op.PARAM_UP).items():
        for pu in ps:
            c.need("R2", (0, f"h C.l{l}"), (1, pu), "an upload must read the version its iteration needs")


def _r3(c: _Ctx) -> None:
    """R3: STEP.l after every gradient download of l in its iteration."""
    for l, gs in _layer_instrs(c, Op.GRAD_DOWN).items():
        for t in (0, 1):
            for g in gs:
                c.need("R3", (t, g), (t, f"h O.l{l}"), "a step must wait for all gradient downloads of its layer")


def _r4(c: _Ctx) -> None:
    """R4: the next iteration's gradient downloads of l after this iteration's STEP.l."""
    for l, gs in _layer_instrs(c, Op.GRAD_DOWN).items():
        for g in gs:
            c.need("R4", (0, f"h O.l{l}"), (1, g), "a gradient write must wait for the previous step")


def _r5(c: _Ctx) -> None:
    """R5: steps totally ordered (layers descending); each COPY between its STEP and the next STEP of l."""
    order = [(t, f"h O.l{l}") for t in (0, 1) for l in range(c.p.plan.num_layers - 1, -1, -1)]
    for a, b in zip(order, order[1:]):
        c.need("R5", a, b, "optimizer steps run one at a time, layers descending")
    s1 = c.p.staleness == 1
    for l in range(c.p.plan.num_layers):
        c.need("R5", (0, f"h O.l{l}"), (int(s1), f"h C.l{l}"), "a copy follows the step that produced it")
        c.need("R5", (int(s1), f"h C.l{l}"), (1, f"h O.l{l}"), "a copy precedes the next step of its layer")


def _memory(c: _Ctx) -> None:
    """Each compute step of a worker's lane fits the budget (the partitioner's `StagePlan.stage_memory`).

    Note: the model (see `stage_memory`): the running stage's parameters, the prefetched stage N
    slots later (at most two resident: a P waits for the release of slot k-2N), gradients and
    workspace of FB/B stages, two input buffers (one microbatch ahead) and the outputs.
    """
    if c.costs is None or c.budget is None:
        return
    need = c.p.plan.stage_memory(c.costs, gpus=c.n)
    for i in c.p.instrs:
        if i.op in COMPUTE_OPS and need[i.stage] > c.budget:
            c.fail("MEMORY", i.name, f"stage {i.stage} ({c.stages[i.stage].label}) needs {need[i.stage]} bytes "
                                     f"on its worker > budget {c.budget} (StagePlan.stage_memory)")


RULES = {"STRUCTURE": _structure, "ONCE": _once, "DEPS": _deps, "ACYCLIC": _acyclic, "INPUT": _input,
         "GRAD": _grad, "RELEASE": _release, "R1": _r1, "R2": _r2, "R3": _r3, "R4": _r4, "R5": _r5,
         "MEMORY": _memory}


def verify(program: Program, costs: CostTable | None = None, memory_budget: int | None = None, *,
           rules=None) -> Program:
    """Check `program`; return it unchanged when valid.

    Args:
        program: the Program to check.
        costs: per-layer bytes for the MEMORY rule.
        memory_budget: device bytes per worker; MEMORY is checked only with costs and a budget.
        rules: names from `RULES` to run (default: all, in order).
    Returns:
        `program`.
    Raises:
        ProgramError: naming the rule and instruction, with the grid around it (>>marked<<).
    """
    ctx = _Ctx(program, costs, memory_budget)
    for name in rules or RULES:
        RULES[name](ctx)
    return program


__all__ = ["verify", "ProgramError", "RULES", "Instr"]
