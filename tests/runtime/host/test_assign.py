"""The host buffer assignment (`runtime.host.assign`): live ranges from happens-before, packing, its verifier.

The live ranges are checked against an independent happens-before (a transitive closure over three
iterations, built here), the arena against an independent sweep of live bytes, and the runtime on a
sub-block model: packed buffers train bit for bit as one buffer each, and a live range cut short is
caught by poison mode.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import models as M
from happens import closure
import rpcompile
from rpcompile import StagePlan
from rpcompile.ir.host_layout import ARENA_ALIGN, BufferAssignment
from rpcompile.ir.instr import Ref
from rpcompile.ir.program import ProgramError
from rpcompile.passes import emit, trace
from rpcompile.passes.trace import sublayer_units
from rpcompile.runtime.executor import Runtime
from rpcompile.runtime.transfer import NonFiniteError
from rpcompile.runtime.host import assign as A
from rpcompile.runtime.host.optimizer import HostState
from rpcompile.runtime.program_info import forward_only


def _graph(sub: bool = False):
    model = M.llama()
    return trace(model, M.lm_batch(batch=8, seq=8), layers=sublayer_units(model) if sub else None)


def _alternate(b, c, before: dict, iterations: int) -> bool:
    """b's life ends before c's begins and c's before b's next one, in every iteration of the window."""
    return all(all((t, r) in before[(t, c.writer)] for r in b.readers)
               and all((t, r) in before[(t + 1, b.writer)] for r in c.readers) for t in range(iterations - 1))


@pytest.mark.parametrize("gpus,mbs,staleness,plan", [(2, 4, 1, "2,2|1|1,3"), (4, 8, 1, "1,1,1,1|1|1,1,1,1"),
                                                     (3, 6, 0, "2,2|1|1,3"), (1, 4, 1, "2,2|1|1,3")])
def test_buffers_that_share_bytes_alternate_on_every_interleaving(gpus, mbs, staleness, plan):
    """Every pair of buffers placed on common bytes is ordered by an independent happens-before over three
    iterations (so also beyond the pass's two-iteration window), one way or the other; so is a pair the
    forward-only evaluation downloads, in its own program."""
    graph = _graph()
    program = emit(StagePlan.from_str(plan), gpus=gpus, microbatches=mbs, staleness=staleness)
    a = A.assign_buffers(graph, program)
    before, ev = closure(program, 3), closure(forward_only(program), 1)
    shared = 0
    for x, b in enumerate(a.buffers):
        for c in a.buffers[x + 1:]:
            if b.offset < c.end and c.offset < b.end:
                shared += 1
                assert _alternate(b, c, before, 3) or _alternate(c, b, before, 3), (b.key, c.key)
                if all((0, n) in ev for n in (b.writer, c.writer)):
                    rb = [r for r in b.readers if (0, r) in ev]
                    rc = [r for r in c.readers if (0, r) in ev]
                    assert (all((0, r) in ev[(0, c.writer)] for r in rb)
                            or all((0, r) in ev[(0, b.writer)] for r in rc)), (b.key, c.key)
    assert shared and a.arena < a.total  # it does share
    assert all(b.offset % ARENA_ALIGN == 0 and b.end <= a.arena for b in a.buffers)


def _sweep_peak(a: BufferAssignment, order: list[str]) -> int:
    """Bytes live at once at the worst point of the linearisation `order` (names): a buffer from its writer
    to its last reader."""
    at = {n: k for k, n in enumerate(order)}
    live = peak = 0
    events = sorted([(at[b.writer], 0, b.bytes) for b in a.buffers]
                    + [(max(at[r] for r in b.readers), 1, -b.bytes) for b in a.buffers])
    for _, _, d in events:
        live += d
        peak = max(peak, live)
    return peak


def _heaviest_clique(weights: list[int], together: list[set]) -> int:
    """The largest total weight of buffers that can all be live at once, pairwise (branch and bound)."""
    best = 0

    def grow(weight: int, cand: set) -> None:
        nonlocal best
        best = max(best, weight)
        for j in sorted(cand, key=lambda j: -weights[j]):
            if weight + sum(weights[k] for k in cand) <= best:
                return
            grow(weight + weights[j], cand & together[j])
            cand = cand - {j}

    grow(0, set(range(len(weights))))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_arena_is_at_most_1_1x_the_peak_of_live_bytes_on_random_plans(seed):
    """Random stage plans, worker counts and microbatches: the arena is at least the heaviest set of buffers
    that can be live at once on some interleaving (by the independent happens-before over three iterations),
    and at most 1.1x it; the live bytes of a sweep in program order are no more than that, and the pass's own
    `peak` (greedy cliques of the buffers that can be live at once) finds it."""
    rng = random.Random(seed)
    graph = _graph(sub=seed % 2 == 1)
    layers = len(graph.layers)
    cut = sorted(rng.sample(range(1, layers - 1), 2))
    fwd = [cut[0], cut[1] - cut[0], layers - 1 - cut[1]]
    plan = StagePlan.from_str(f"{','.join(map(str, fwd))}|1|{','.join(map(str, fwd[::-1]))}")
    gpus = rng.choice([1, 2, 3, 4])
    program = emit(plan, gpus=gpus, microbatches=gpus * rng.choice([1, 2, 4]), staleness=rng.choice([0, 1]))
    a = A.assign_buffers(graph, program)
    before, ev = closure(program, 3), closure(forward_only(program), 1)
    bufs = a.buffers

    def at_once(b, c) -> bool:
        if not (_alternate(b, c, before, 3) or _alternate(c, b, before, 3)):
            return True
        if (0, b.writer) not in ev or (0, c.writer) not in ev:
            return False
        rb, rc = ([r for r in x.readers if (0, r) in ev] for x in (b, c))  # both in an evaluation too
        return bool(rb and rc) and not (all((0, r) in ev[(0, c.writer)] for r in rb)
                                        or all((0, r) in ev[(0, b.writer)] for r in rc))

    together = [{j for j in range(len(bufs)) if j != k and at_once(bufs[k], bufs[j])} for k in range(len(bufs))]
    peak = _heaviest_clique([-(-b.bytes // ARENA_ALIGN) * ARENA_ALIGN for b in bufs], together)
    assert _sweep_peak(a, [i.name for i in program.instrs]) <= peak and a.peak == peak
    assert peak <= a.arena <= 1.1 * peak, (a.arena, peak)


@pytest.mark.parametrize("seed", range(3))
def test_the_c_loops_give_the_python_versions_assignment(seed, monkeypatch):
    """assign.c's loops (which buffers are apart, the best-fit packing, the greedy clique of the peak) and their
    torch versions: the same offsets, arena and peak on random plans."""
    rng = random.Random(seed)
    graph = _graph(sub=True)
    layers = len(graph.layers)
    cut = sorted(rng.sample(range(1, layers - 1), 2))
    fwd = [cut[0], cut[1] - cut[0], layers - 1 - cut[1]]
    plan = StagePlan.from_str(f"{','.join(map(str, fwd))}|1|{','.join(map(str, fwd[::-1]))}")
    gpus = rng.choice([2, 3, 4])
    program = emit(plan, gpus=gpus, microbatches=gpus * rng.choice([1, 2]), staleness=rng.choice([0, 1]))
    bufs = A.live_buffers(graph, program)
    monkeypatch.setenv("RPCOMPILE_ASSIGN_KERNEL", "1")
    c, c_apart = A.assign_buffers(graph, program), A.apart(bufs, program)
    assert A._library() is not None  # the C path ran (this machine has a compiler)
    monkeypatch.setenv("RPCOMPILE_ASSIGN_KERNEL", "0")
    assert A._library() is None
    py, py_apart = A.assign_buffers(graph, program), A.apart(bufs, program)
    assert c == py and c.peak > 0
    assert torch.equal(c_apart, py_apart) and 0 < int(c_apart.sum()) < c_apart.numel() - len(bufs)
    # the buffers of the program's `unshared` assignment (what choosing the round size made) give the same one
    bound = A.unshared(graph, program)
    assert A.assign_buffers(graph, program, unplaced=bound) == py and bound.arena > py.arena


def test_a_pair_ordered_only_from_the_second_iteration_on_may_not_share():
    """A Ref that applies from iteration 1 (`since` 1) orders a buffer's readers before another's writer in
    every iteration but the first. In the first the two can be live at once: they are not apart."""
    graph = _graph()
    program = emit(StagePlan.from_str("2,2|1|1,3"), gpus=2, microbatches=4, staleness=1)
    bufs = A.live_buffers(graph, program)
    ok = A.apart(bufs, program)
    pos = {i.name: k for k, i in enumerate(program.instrs)}
    hb = A._order(program)
    # b, c: c's readers happen before b's next writer, but b's readers do not happen before c's writer,
    # though they come first in program order (so a Ref from c's writer to them points backwards)
    b, c = next((b, c) for b in bufs for c in bufs if b is not c and not ok[bufs.index(b), bufs.index(c)]
                and all(hb.before((0, r), (1, b.writer)) for r in c.readers)
                and all(pos[r] < pos[c.writer] for r in b.readers)
                and not all(hb.before((0, r), (0, c.writer)) for r in b.readers))
    late = tuple(Ref(r, 0, 1) for r in b.readers)
    instrs = tuple(dataclasses.replace(i, deps=i.deps + late) if i.name == c.writer else i for i in program.instrs)
    later = dataclasses.replace(program, instrs=instrs)
    assert all(A._order(later, 3).before((2, r), (2, c.writer)) for r in b.readers)  # ordered from t = 1 on
    again = A.apart(bufs, later)
    assert not again[bufs.index(b), bufs.index(c)] and not again[bufs.index(c), bufs.index(b)]


def _clash(graph, program) -> tuple[BufferAssignment, int, int]:
    """A valid assignment and two of its buffers that can be live at once."""
    a = A.assign_buffers(graph, program)
    ok = A.apart(list(a.buffers), program)
    x, y = next((x, y) for x in range(len(a.buffers)) for y in range(len(a.buffers))
                if x != y and not ok[x, y] and a.buffers[x].bytes == a.buffers[y].bytes)
    return a, x, y


def test_the_verifier_rejects_two_buffers_that_can_be_live_at_once_on_common_bytes():
    graph = _graph()
    program = emit(StagePlan.from_str("2,2|1|1,3"), gpus=2, microbatches=4, staleness=1)
    a, x, y = _clash(graph, program)
    assert A.check_assignment(a, graph, program) is a
    bufs = list(a.buffers)
    bufs[y] = dataclasses.replace(bufs[y], offset=bufs[x].offset)  # one deliberate overlap
    with pytest.raises(ProgramError, match=r"\[BUFFERS\].*share bytes .* but can be live at once"):
        A.check_assignment(dataclasses.replace(a, buffers=tuple(bufs)), graph, program)
    bufs = list(a.buffers)
    bufs[x] = dataclasses.replace(bufs[x], offset=a.arena)  # past the arena's end
    with pytest.raises(ProgramError, match="not inside the arena"):
        A.check_assignment(dataclasses.replace(a, buffers=tuple(bufs)), graph, program)
    cut = dataclasses.replace(a.buffers[x], readers=a.buffers[x].readers[:-1] or ("w0 U0.m0",))
    with pytest.raises(ProgramError, match="the program gives"):  # a live range that is not the program's
        A.check_assignment(dataclasses.replace(a, buffers=a.buffers[:x] + (cut,) + a.buffers[x + 1:]), graph, program)
    with pytest.raises(ProgramError, match=r"\[BUFFERS\].*buffer .* is missing from"):  # one the program has, dropped
        A.check_assignment(dataclasses.replace(a, buffers=a.buffers[:x] + a.buffers[x + 1:]), graph, program)


def test_an_assignment_built_for_one_program_is_refused_for_another():
    graph = _graph()
    one = emit(StagePlan.from_str("2,2|1|1,3"), gpus=2, microbatches=4, staleness=1)
    other = emit(StagePlan.from_str("2,2|1|1,3"), gpus=2, microbatches=4, staleness=0)
    a = A.assign_buffers(graph, one)
    with pytest.raises(ProgramError, match=f"built for program {a.program}, not this one"):
        A.check_assignment(a, graph, other)
    state = HostState.from_graph(graph, optimizer=rpcompile.AdamW(impl="foreach"))
    with pytest.raises(ProgramError, match="built for program"):
        Runtime(graph, other, state, backend="host", assignment=a)


def test_the_assignment_prints_as_a_table_of_value_microbatch_offset_bytes_and_live_range():
    graph = _graph()
    program = emit(StagePlan.from_str("2,2|1|1,3"), gpus=2, microbatches=4, staleness=1)
    a = A.assign_buffers(graph, program)
    lines = str(a).splitlines()
    assert lines[0].startswith("host arena ") and f" for {len(a.buffers)} buffers " in lines[0]
    assert lines[0].endswith(f"program {a.program}")
    assert lines[1].split() == ["value", "mb", "offset", "bytes", "live", "range"]
    b = a.buffers[0]
    assert lines[3].split()[:4] == [b.value, str(b.mb), str(b.offset), str(b.bytes)]
    assert lines[3].endswith(f"{b.writer} -> {','.join(b.readers)}")


def _train(graph, program, batches, assignment=None, **kw):
    state = HostState.from_graph(graph, optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach"))
    with Runtime(graph, program, state, backend="host", timeout=60, assignment=assignment, **kw) as rt:
        losses = [rt.step(b) for b in batches]
        rt.flush()
        allocated = rt.stats(len(batches) - 1).get("host_allocations", 0)
    return losses, {n: p.clone() for n, p in state.parameters_fp32().items()}, allocated


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_sub_block_model_trains_bit_for_bit_as_with_one_buffer_each(staleness):
    """Packed (buffers sharing bytes) and unpacked (one buffer each, as before the pass): the same losses and
    weights, bit for bit, with random delays in the host streams; nothing allocated after the warm-up."""
    graph = _graph(sub=True)
    program = emit(StagePlan.from_str("3,3,4|1|4,3,3"), gpus=4, microbatches=8, staleness=staleness)
    a = A.assign_buffers(graph, program)
    assert a.arena < a.total / 2
    batches = [M.lm_batch(batch=8, seq=8, seed=s) for s in range(4)]
    packed = _train(graph, program, batches, a, lane_delay=7)
    alone = _train(graph, program, batches, A.unshared(graph, program), lane_delay=11)
    assert packed[0] == alone[0]
    assert all(torch.equal(packed[1][n], alone[1][n]) for n in packed[1])
    assert packed[2] == 0


def test_poison_mode_catches_a_live_range_cut_short():
    """A buffer whose assignment forgets its last reader is poisoned (NaN) when the reads it keeps are done;
    the forgotten read, ordered after them, uploads NaN, and the step fails on a non-finite gradient. With
    the true live ranges the same poisoned run trains as an unpoisoned one."""
    graph = _graph(sub=True)
    program = emit(StagePlan.from_str("3,3,4|1|4,3,3"), gpus=4, microbatches=8, staleness=1)
    a = A.assign_buffers(graph, program)
    before = closure(program, 1)
    k, b = next((k, b) for k, b in enumerate(a.buffers) if b.key[0] == "a" and len(b.readers) > 1
                and b.dtype.is_floating_point
                and all((0, r) in before[(0, b.readers[-1])] for r in b.readers[:-1]))
    short = dataclasses.replace(a, buffers=a.buffers[:k] + (dataclasses.replace(b, readers=b.readers[:-1]),)
                                + a.buffers[k + 1:])
    batches = [M.lm_batch(batch=8, seq=8, seed=s) for s in range(2)]
    good = _train(graph, program, batches, a, lane_delay=5, poison=True)
    assert good[0] == _train(graph, program, batches, a)[0]  # the true ranges: poison reads none
    import rpcompile.runtime.executor as E
    real = E.check_assignment
    E.check_assignment = lambda assignment, *args: assignment  # let the broken assignment through
    try:
        with pytest.raises(NonFiniteError, match="non-finite gradient"):
            _train(graph, program, batches, short, lane_delay=5, poison=True)
    finally:
        E.check_assignment = real
