"""What the runtime derives once from a Program: per-worker order, readers, gradient downloads; and its
forward-only version for evaluation.

    >>> from rpcompile.passes import emit
    >>> p = emit(StagePlan.from_str("1|1|1"), gpus=2, microbatches=2)
    >>> [i.name for i in forward_only(p).instrs if i.worker == 0][:3]
    ['w0 P0.r0.c0', 'w0 U0.m0', 'w0 F0.m0']
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rpcompile.ir.plan import StageKind, StagePlan  # noqa: F401 - StagePlan for the doctest
from rpcompile.ir.program import COMPUTE_OPS, Instr, Op, Program, Ref
from rpcompile.runtime.stage.cuts import count_readers

__all__ = ["ProgramInfo", "forward_only", "dep_kind", "EVAL_BASE"]

EVAL_BASE = 1 << 40  # iteration ids of evaluation runs (apart from training iterations)


def dep_kind(producer: Op, consumer: Op) -> str | None:
    """The name of a dependency kind the test switch `drop` can remove (None: not droppable).

    >>> dep_kind(Op.ACT_UP, Op.FORWARD)
    'act_up>compute'
    """
    if consumer in COMPUTE_OPS and producer is Op.ACT_UP:
        return "act_up>compute"
    if consumer in COMPUTE_OPS and producer is Op.PARAM_UP:
        return "param_up>compute"
    if producer in COMPUTE_OPS and consumer is Op.ACT_DOWN:
        return "compute>act_down"
    if producer in COMPUTE_OPS and consumer is Op.GRAD_DOWN:
        return "compute>grad_down"
    return None


@dataclass(frozen=True)
class ProgramInfo:
    """A Program with the tables the runtime consults on every instruction."""

    program: Program
    deps: dict[str, tuple[Ref, ...]]  # instruction name -> refs (the protocol's, for training)
    readers: dict[tuple, int]  # host key (no iteration) -> uploads of one iteration reading it
    by_name: dict[str, Instr]
    by_worker: dict[int, tuple[Instr, ...]]  # template worker -> its device instructions, program order
    host: dict[Op, tuple[Instr, ...]]  # STEP / COPY instructions, program order
    grads: tuple[Instr, ...]  # G instructions, program order
    loss_downs: tuple[str, ...]  # the D instructions that bring the losses down
    forward_only: bool
    max_back: int  # the furthest back (in iterations) any dependency reaches

    @classmethod
    def of(cls, program: Program, deps: dict[str, tuple[Ref, ...]], io: Any) -> "ProgramInfo":
        """Derive the tables of `program` (deps: its dependencies, e.g. `protocol_deps`)."""
        by_worker: dict[int, list[Instr]] = {}
        host: dict[Op, list[Instr]] = {Op.STEP: [], Op.COPY: []}
        grads: list[Instr] = []
        for i in program.instrs:
            if i.is_host:
                host[i.op].append(i)
            else:
                by_worker.setdefault(i.worker, []).append(i)
                if i.op is Op.GRAD_DOWN:
                    grads.append(i)
        kinds = {s.index: s.kind for s in program.plan.stages}
        fwd_only = not grads and not host[Op.STEP]
        loss_downs = tuple(i.name for i in program.instrs if i.op is Op.ACT_DOWN and kinds[i.stage] is StageKind.FB)
        return cls(program, deps, count_readers(program, io), {i.name: i for i in program.instrs},
                   {w: tuple(v) for w, v in by_worker.items()}, {k: tuple(v) for k, v in host.items()},
                   tuple(grads), loss_downs, fwd_only,
                   max((r.back for v in deps.values() for r in v), default=0))


def forward_only(program: Program) -> Program:
    """The forward half of `program`: the F stages and the fused stage run forward to the loss.

    Keeps the P, U, F, X (as F) and D instructions of the forward and fused stages and
    their releases, on the same workers; drops gradients, backward stages and host
    instructions, and every ref to something dropped or to an earlier iteration. The
    buffer bounds are rebuilt over what is kept: a slot's P waits for the release of the
    worker's slot before last, an upload for the worker's compute two before. So
    evaluation streams the stages through the workers, and no worker holds more
    parameters than in training.
    """
    kinds = {s.index: s.kind for s in program.plan.stages}
    keep_ops = {Op.PARAM_UP, Op.ACT_UP, Op.FORWARD, Op.FUSED, Op.ACT_DOWN, Op.RELEASE}
    kept = [i for i in program.instrs if not i.is_host and kinds[i.stage] is not StageKind.B and i.op in keep_ops]
    rename = {i.name: replace(i, op=Op.FORWARD).name for i in kept if i.op is Op.FUSED}
    names = {rename.get(i.name, i.name) for i in kept}
    releases: dict[int, list[str]] = {}  # worker -> its E names, in order
    computes: dict[int, list[str]] = {}  # worker -> its compute names, in order
    slot_release: dict[tuple[int, int], int] = {}  # (stage, round) -> position among its worker's releases
    for i in kept:
        if i.op is Op.RELEASE:
            slot_release[(i.stage, i.round)] = len(releases.setdefault(i.worker, []))
            releases[i.worker].append(i.name)
    out = []
    for i in kept:
        deps = tuple(r if r.since == 0 and r.name not in rename else replace(r, name=rename.get(r.name, r.name), since=0)
                     for r in i.deps if r.back == 0)
        deps = tuple(r for r in deps if r.name in names)
        if i.op in (Op.PARAM_UP, Op.ACT_UP):  # their buffer bounds are rebuilt below, over the kept slots
            deps = tuple(r for r in deps if r.name.split(" ")[1][0] not in ("E", "F"))
        if i.op is Op.PARAM_UP:
            k = slot_release[(i.stage, i.round)]
            deps += (Ref(releases[i.worker][k - 2]),) if k >= 2 else ()
        if i.op is Op.ACT_UP:
            done = computes.get(i.worker, [])
            deps += (Ref(done[-2]),) if len(done) >= 2 else ()
        new = i if i.op is not Op.FUSED and deps == i.deps else replace(
            i, op=Op.FORWARD if i.op is Op.FUSED else i.op, deps=deps)
        if new.op is Op.FORWARD:
            computes.setdefault(i.worker, []).append(new.name)
        out.append(new)
    return replace(program, instrs=tuple(out), staleness=0)
