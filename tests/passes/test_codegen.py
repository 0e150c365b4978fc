"""emit: the RoundPipe program reproduces the exact timing recurrence and passes verify."""
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpcompile import CostTable, Op, StagePlan
from rpcompile.passes import emit, iteration_time, verify
from rpcompile.passes.codegen import pack_chunks
from rpcompile.passes.partition.timing import default_round_size, schedule
from rpcompile.ir.plan import StageKind
from rpcompile.ir.program import COMPUTE_OPS, Ref
from tests.strategies import plans


def longest_path(prog, costs, iterations=1):
    """Zero-cost-transfer evaluation: start = max(dep ends, lane predecessor end); per-iteration compute end."""
    stg = prog.plan.stages
    f = [sum(costs.fwd[l] for l in s.layers) for s in stg]
    b = [sum(costs.bwd[l] for l in s.layers) for s in stg]
    dur = {Op.FORWARD: lambda i: f[i.stage], Op.FUSED: lambda i: f[i.stage] + b[i.stage],
           Op.RECOMPUTE: lambda i: f[i.stage], Op.BACKWARD: lambda i: b[i.stage]}
    end, lane_end, ends = {}, {}, []
    for t in range(iterations):
        tend = 0.0
        for i in prog.instrs:
            s = max([end[(t - d.back, d.name)] for d in i.deps if t - d.back >= 0 and t >= d.since] + [0.0])
            key = (-1 if i.is_host else (i.worker + t * prog.shift) % prog.gpus, i.lane)
            e = max(s, lane_end.get(key, 0.0)) + (dur[i.op](i) if i.op in dur else 0.0)
            end[(t, i.name)] = lane_end[key] = e
            if i.op in COMPUTE_OPS:
                tend = max(tend, e)
        ends.append(tend)
    return ends


@st.composite
def cases(draw):
    layers = draw(st.integers(2, 12))
    plan = draw(plans(layers))
    n = draw(st.integers(1, 8))
    m = draw(st.integers(n, 4 * n))
    times = st.sampled_from([0.0, 0.01, 0.5, 1.0, 2.0, 3.3, 17.0])
    costs = CostTable.from_lists(fwd=draw(st.lists(times, min_size=layers, max_size=layers)),
                                 bwd=draw(st.lists(times, min_size=layers, max_size=layers)),
                                 param_bytes=draw(st.lists(st.integers(0, 10**6), min_size=layers,
                                                           max_size=layers)))
    rr = draw(st.sampled_from([default_round_size(n, m)] + [d for d in range(1, m + 1) if m % d == 0]))
    return plan, n, m, rr, costs


@settings(max_examples=150, deadline=None)
@given(cases(), st.sampled_from([0, 1]), st.booleans())
def test_emit_verifies_and_reproduces_the_timing(case, staleness, with_bytes):
    plan, n, m, rr, costs = case
    p = emit(plan, gpus=n, microbatches=m, round_size=rr, staleness=staleness,
             costs=costs if with_bytes else None)
    assert verify(p) is p
    # every (stage, microbatch) computed exactly once, in the right form
    count = Counter((i.op, i.stage, i.mb) for i in p.instrs if i.op in COMPUTE_OPS)
    want = {StageKind.F: [Op.FORWARD], StageKind.FB: [Op.FUSED], StageKind.B: [Op.RECOMPUTE, Op.BACKWARD]}
    assert count == Counter({(op, s.index, mb): 1 for s in plan.stages for op in want[s.kind] for mb in range(m)})
    if staleness == 0:
        assert longest_path(p, costs)[0] == pytest.approx(
            iteration_time(plan, costs, gpus=n, microbatches=m, round_size=rr, staleness=0), abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(cases(), st.sampled_from([0, 1]))
def test_back_to_back_iterations_match_the_recurrence(case, staleness):
    # Stronger than required: every iteration's end over 4 iterations, both stalenesses.
    plan, n, m, rr, costs = case
    p = emit(plan, gpus=n, microbatches=m, round_size=rr, staleness=staleness)
    ref = schedule(plan, costs, gpus=n, microbatches=m, round_size=rr,
                   staleness=staleness, iterations=4).ends
    assert longest_path(p, costs, 4) == pytest.approx(list(ref), abs=1e-9)


def test_staleness_one_steady_state():
    plan = StagePlan.from_str("3,3|1|1,1,1,1,1,1")
    costs = CostTable.from_lists(fwd=[1.0] * 7, bwd=[2.0] * 7)
    p = emit(plan, gpus=4, microbatches=8)
    ends = longest_path(p, costs, 12)
    assert (ends[-1] - ends[-5]) / 4 == pytest.approx(
        iteration_time(plan, costs, gpus=4, microbatches=8, staleness=1))


def test_small_program_by_hand():
    p = emit(StagePlan.from_str("1|1|1"), gpus=2, microbatches=2, staleness=0)
    by = p.by_name()
    assert (p.round_size, p.worker_offset, p.next_offset) == (2, 0, 1)
    assert by["w1 U1.m0"].deps == (Ref("w0 D0.m0"), Ref("w0 B2.m0", 1))   # producer, two-buffer reuse
    assert by["w1 X1.m0"].deps == (Ref("w1 P1.r0.c0"), Ref("w1 U1.m0"))
    assert by["w0 U2.m1g"].deps == (Ref("w1 D1.m1"), Ref("w0 F0.m1"))
    assert by["w0 B2.m1"].deps == (Ref("w0 R2.m1"), Ref("w0 U2.m1g"))
    # slot k-2N = -2 is slot 1 of iteration t-1, named as in the template (w1), physically this worker
    assert by["w0 P2.r0.c0"].deps == (Ref("w1 E1.r0", 1), Ref("h C.l0", 1))
    assert by["w0 G2.r0.c0"].deps == (Ref("w0 B2.m1"), Ref("h O.l0", 1))
    assert by["w0 E2.r0"].deps == (Ref("w0 B2.m1"), Ref("w0 G2.r0.c0"))
    assert by["h O.l0"].deps == (Ref("w0 G2.r0.c0"), Ref("h C.l0", 1), Ref("h O.l1"))
    assert by["h C.l0"].deps == (Ref("h O.l0"), Ref("w0 P0.r0.c0"), Ref("w0 P2.r0.c0"))
    assert "w1 D1.m0" in by and "w0 D2.m0" not in by          # the last B slot has no consumer
    s1 = emit(StagePlan.from_str("1|1|1"), gpus=2, microbatches=2, staleness=1).by_name()
    assert s1["w0 P0.r0.c0"].deps[1] == Ref("h C.l0", 1, 2)
    assert s1["h C.l0"].deps[0] == Ref("h O.l0", 1)
    assert Ref("h C.l0", 0, 1) in s1["h O.l0"].deps


def test_chunks_are_packed_longest_first():
    pb = [900, 10, 300, 0, 5000, 70]
    chunks = pack_chunks(3, range(6), pb, 4)
    assert len(chunks) == 4 and [c.index for c in chunks] == [0, 1, 2, 3]
    got = {}
    for c in chunks:
        assert c.bytes == sum(b - a for _, a, b in c.pieces) and c.stage == 3
        for l, a, b in c.pieces:
            got.setdefault(l, []).append((a, b))
    for l, b in enumerate(pb):   # every layer's bytes exactly once, in pieces of at most the cap
        spans = sorted(got[l])
        assert spans[0][0] == 0 and spans[-1][1] == b
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
    cap = -(-sum(pb) // 4)
    assert max(c.bytes for c in chunks) <= cap + max(pb[l] for l in range(6) if pb[l] <= cap)
    assert [c.layers for c in pack_chunks(0, range(3), None, 2)] == [(0, 2), (1,)]
    assert len(pack_chunks(0, range(2), None, 5)) == 2


def test_chunk_count_is_the_round_size():
    costs = CostTable.from_lists(fwd=[1] * 4, bwd=[1] * 4, param_bytes=[100] * 4)
    p = emit(StagePlan.from_str("2,1|1|1,2"), gpus=2, microbatches=6, round_size=3, costs=costs)
    assert all(len(p.stage_chunks(s.index)) == 3 for s in p.plan.stages if len(s.layers) > 1)
    assert sum(1 for i in p.instrs if i.op is Op.PARAM_UP and i.stage == 0) == 3 * p.rounds


@pytest.mark.parametrize("kw, msg", [(dict(staleness=2), "staleness"), (dict(round_size=4), "divide"),
                                     (dict(gpus=0), "gpus"),
                                     (dict(costs=CostTable.from_lists([1], [1])), "cost table")])
def test_bad_arguments(kw, msg):
    args = dict(gpus=2, microbatches=6) | kw
    with pytest.raises(ValueError, match=msg):
        emit(StagePlan.from_str("1|1|1"), **args)


@pytest.mark.parametrize("staleness", [0, 1])
def test_tied_parameters_join_the_owner_group(tmp_path, staleness):
    # Layer 0 (embedding) and layer 3 (LM head, fused) share a weight; its group is layer 0's.
    plan = StagePlan.from_str("2,1|1|1,2")
    p = emit(plan, gpus=2, microbatches=4, staleness=staleness, readers={0: (0, 3), 1: (1,)})
    assert p.readers == ((0, (0, 3)),) and p.group_readers(0) == (0, 3) and p.groups_of(3) == (0, 3)
    by = p.by_name()
    assert Ref("h O.l0", 1) in by["w0 G2.r0.c0"].deps                       # R4 for the head's download
    assert any(d.name == "h C.l0" for d in by["w0 P2.r0.c0"].deps)          # R2 for the head's upload
    assert Ref("w0 G2.r0.c0") in by["h O.l0"].deps                          # R3
    assert Ref("w0 P2.r0.c0") in by["h C.l0"].deps                          # R1
    assert verify(p) is p
    p.to_csv(tmp_path / "p.csv")
    assert type(p).from_csv(tmp_path / "p.csv") == p
    with pytest.raises(ValueError, match="readers"):
        emit(plan, gpus=2, microbatches=4, readers={0: (0, 9)})
