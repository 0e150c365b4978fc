"""emit: lower a StagePlan to the RoundPipe Program of one iteration.

Note: the dependencies reproduce `passes/partition/timing.py` exactly when transfers and
the optimizer cost nothing. Slot k (local: k = r*S + i, round r, stage i) runs
on template worker k mod N. Per slot, in program order:
  P  chunks (param_up lane): after the RELEASE of the worker's slot k-2N
     (possibly `back` iterations earlier) and the COPY of every layer in the
     chunk that produced the version this iteration reads (R2: C.l@-1; with
     staleness 1 only from iteration 2 on, `since=2`);
  U  (act_up lane) of m: after the producer's D of m (previous slot for F/X
     and for a B slot's gradient "g"; for a B slot's saved input the forward
     slot computing layer start-1; nothing for batch inputs) and after the
     final compute of the worker's microbatch two before (two buffers);
  F/X of m: after its U (and all P chunks for the slot's first microbatch);
  R of m: after its saved-input U (and the P chunks first); B of m: after R of m
     and the gradient U of m;
  D  of m after the compute of m (omitted when nothing consumes it);
  G  chunks (FB/B slots): after the slot's last compute and STEP.l@-1 (R4);
  E  after the last compute and the slot's G chunks.
Host, layers descending: STEP.l after every G of l (R3), the copy before it
(R5: C.l@-1; staleness 1: C.l@0 from iteration 1) and the previous step
(O.l+1, or O.0@-1); COPY.l after STEP.l (staleness 1: STEP.l@-1) and every P
of l in this iteration (R1). With staleness 1, COPY in iteration t writes
copy(t-1, l), read by iteration t+1.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from rpcompile.ir.costs import CostTable
from rpcompile.passes.partition.timing import default_round_size
from rpcompile.ir.plan import StageKind, StagePlan
from rpcompile.ir.program import Chunk, Instr, Op, Program, Ref

_FINAL = {StageKind.F: Op.FORWARD, StageKind.FB: Op.FUSED, StageKind.B: Op.BACKWARD}


def emit(plan: StagePlan, *, gpus: int, microbatches: int, round_size: int | None = None,
         staleness: int = 1, costs: CostTable | None = None,
         readers: Mapping[int, Sequence[int]] | None = None) -> Program:
    """Emit the Program of one RoundPipe iteration (a template for all iterations).

    Args:
        plan: the stage grouping.
        gpus: number of workers N.
        microbatches: microbatches per iteration M.
        round_size: microbatches per round R (default `default_round_size(N, M)`); must divide M.
        staleness: 0 (synchronous) or 1 (RoundPipe: iteration t reads the update of t-2).
        costs: per-layer costs; only `param_bytes` is used, to size the P/G chunks. None: one
            chunk per layer (round robin into at most R chunks), 0 bytes.
        readers: tied parameters: optimizer layer l (the lowest owner) -> every layer using them.
            COPY.l / STEP.l then also wait for those layers' P / G chunks (R1 / R3), and their
            P / G chunks for C.l / O.l (R2 / R4).
    Returns:
        A Program with worker_offset 0.

    >>> p = emit(StagePlan.from_str("1|1|1"), gpus=2, microbatches=2, staleness=0)
    >>> [i.name for i in p.instrs if i.worker == 1][:4]
    ['w1 P1.r0.c0', 'w1 U1.m0', 'w1 X1.m0', 'w1 D1.m0']
    """
    if gpus < 1 or microbatches < 1:
        raise ValueError(f"emit: gpus ({gpus}) and microbatches ({microbatches}) must be >= 1")
    if staleness not in (0, 1):
        raise ValueError(f"emit: staleness must be 0 or 1, got {staleness!r}")
    rr = round_size or default_round_size(gpus, microbatches)
    if rr < 1 or microbatches % rr:
        raise ValueError(f"emit: round_size {rr} must divide microbatches {microbatches}")
    if costs is not None and costs.num_layers != plan.num_layers:
        raise ValueError(f"emit: plan has {plan.num_layers} layers but the cost table has {costs.num_layers}")
    n, stages = gpus, plan.stages
    ns, rounds = len(stages), microbatches // rr
    sr = ns * rounds
    chunks = tuple(c for s in stages for c in pack_chunks(
        s.index, s.layers, None if costs is None else costs.param_bytes, rr))
    by_stage: dict[int, list[Chunk]] = {s.index: [] for s in stages}
    for c in chunks:
        by_stage[c.stage].append(c)
    producer = saved_input_producer(plan)
    tied = tuple(sorted((int(l), tuple(sorted({int(l), *map(int, rs)}))) for l, rs in (readers or {}).items()
                        if set(rs) - {l}))
    for l, rs in tied:
        if not all(0 <= x < plan.num_layers for x in rs + (l,)):
            raise ValueError(f"emit: readers of layer {l} {list(rs)} outside [0, {plan.num_layers})")
    groups = [sorted({j} | {l for l, rs in tied if j in rs}) for j in range(plan.num_layers)]

    def loc(k: int) -> tuple[int, int]:
        """A slot index relative to this iteration's start -> (template slot, iterations back)."""
        back = -(k // sr) if k < 0 else 0
        return k + back * sr, back

    def final_ref(k: int, j: int) -> Ref:
        """The final compute of the j-th microbatch of slot k (j may be negative: earlier slots of the worker)."""
        while j < 0:
            k, j = k - n, j + rr
        kl, back = loc(k)
        st = stages[kl % ns]
        return Ref(f"w{kl % n} {_FINAL[st.kind].value}{st.index}.m{(kl // ns) * rr + j}", back)

    out: list[Instr] = []
    p_of_layer: dict[int, list[str]] = {l: [] for l in range(plan.num_layers)}
    g_of_layer: dict[int, list[str]] = {l: [] for l in range(plan.num_layers)}
    copy_since = 2 if staleness == 1 else 0
    for k in range(sr):
        i, r, w = k % ns, k // ns, k % n
        st = stages[i]
        # Parameter upload: after the release of the worker's slot before last (R2: and the copy).
        kl, back = loc(k - 2 * n)
        release = Ref(f"w{kl % n} E{kl % ns}.r{kl // ns}", back)
        ps = []
        for c in by_stage[i]:
            gl = sorted({g for l in c.layers for g in groups[l]})
            deps = (release,) + tuple(Ref(f"h C.l{l}", 1, copy_since) for l in gl)
            ps.append(Instr(Op.PARAM_UP, w, stage=i, round=r, chunk=c.index, deps=deps))
            for l in gl:
                p_of_layer[l].append(ps[-1].name)
        out += ps
        params = tuple(Ref(p.name) for p in ps)
        last = None
        for j in range(rr):
            m = r * rr + j
            bufs = (final_ref(k, j - 2),)
            first = params if j == 0 else ()
            if st.kind is StageKind.B:
                up = [] if producer[i] is None else [Ref(f"w{(k - i + producer[i]) % n} D{producer[i]}.m{m}")]
                us = Instr(Op.ACT_UP, w, stage=i, mb=m, deps=tuple(up) + bufs)
                rc = Instr(Op.RECOMPUTE, w, stage=i, mb=m, deps=first + (Ref(us.name),))
                ug = Instr(Op.ACT_UP, w, stage=i, mb=m, grad=True,
                           deps=(Ref(f"w{(k - 1) % n} D{i - 1}.m{m}"),) + bufs)
                last = Instr(Op.BACKWARD, w, stage=i, mb=m, deps=(Ref(rc.name), Ref(ug.name)))
                out += [us, rc, ug, last]
            else:
                up = [Ref(f"w{(k - 1) % n} D{i - 1}.m{m}")] if i > 0 else []
                u = Instr(Op.ACT_UP, w, stage=i, mb=m, deps=tuple(up) + bufs)
                last = Instr(_FINAL[st.kind], w, stage=i, mb=m, deps=first + (Ref(u.name),))
                out += [u, last]
            if i < ns - 1 or st.kind is StageKind.FB:  # the fused stage also brings the loss down
                out.append(Instr(Op.ACT_DOWN, w, stage=i, mb=m, deps=(Ref(last.name),)))
        gs = []
        if st.kind is not StageKind.F:
            for c in by_stage[i]:
                gl = sorted({g for l in c.layers for g in groups[l]})
                deps = (Ref(last.name),) + tuple(Ref(f"h O.l{l}", 1) for l in gl)
                gs.append(Instr(Op.GRAD_DOWN, w, stage=i, round=r, chunk=c.index, deps=deps))
                for l in gl:
                    g_of_layer[l].append(gs[-1].name)
        out += gs
        out.append(Instr(Op.RELEASE, w, stage=i, round=r, deps=(Ref(last.name),) + tuple(Ref(g.name) for g in gs)))
    nl = plan.num_layers
    for l in range(nl - 1, -1, -1):
        prev = Ref(f"h O.l{l + 1}") if l < nl - 1 else Ref("h O.l0", 1)
        grads = tuple(Ref(g) for g in g_of_layer[l])
        ups = tuple(Ref(p) for p in p_of_layer[l])
        if staleness == 0:
            step = Instr(Op.STEP, -1, layer=l, deps=grads + (Ref(f"h C.l{l}", 1), prev))
            out += [step, Instr(Op.COPY, -1, layer=l, deps=(Ref(step.name),) + ups)]
        else:
            copy = Instr(Op.COPY, -1, layer=l, deps=(Ref(f"h O.l{l}", 1),) + ups)
            out += [copy, Instr(Op.STEP, -1, layer=l, deps=grads + (Ref(copy.name, 0, 1), prev))]
    return Program(plan=plan, gpus=n, microbatches=microbatches, round_size=rr, staleness=staleness,
                   worker_offset=0, next_offset=sr % n, instrs=tuple(out), chunks=chunks, readers=tied)


def saved_input_producer(plan: StagePlan) -> list[int | None]:
    """For each stage, the forward stage whose output is its saved input (B stages not starting at layer 0)."""
    owner = [i for i, r in enumerate(plan.fwd) for _ in r]
    return [owner[s.layers.start - 1] if s.kind is StageKind.B and s.layers.start > 0 else None
            for s in plan.stages]


def pack_chunks(stage: int, layers: range, param_bytes, count: int) -> list[Chunk]:
    """Split a stage's parameters into at most `count` chunks, longest-processing-time first.

    A layer above the cap ceil(total / count) is split into pieces of at most the cap; the pieces
    go, largest first, to the least-loaded chunk. Every layer appears in some chunk.

    >>> [c.pieces for c in pack_chunks(0, range(2), [300, 100], 2)]
    [((0, 0, 200),), ((0, 200, 300), (1, 0, 100))]
    """
    sizes = [0 if param_bytes is None else int(param_bytes[l]) for l in layers]
    total = sum(sizes)
    cap = math.ceil(total / count) if total else 0
    pieces = []
    for l, b in zip(layers, sizes):
        cuts = list(range(0, b, cap)) + [b] if cap and b else [0, b]
        pieces += [(l, a, z) for a, z in zip(cuts, cuts[1:])]
    bins: list[list[tuple[int, int, int]]] = [[] for _ in range(min(count, len(pieces)))]
    load = [0] * len(bins)
    for p in sorted(pieces, key=lambda p: (-(p[2] - p[1]), p[0], p[1])):
        j = min(range(len(bins)), key=lambda q: (load[q], len(bins[q]), q))
        bins[j].append(p)
        load[j] += p[2] - p[1]
    return [Chunk(stage, j, tuple(sorted(b)), load[j]) for j, b in enumerate(bins)]
