"""Program IR: text round trip, CSV round trip, Chrome trace, grid, shifting."""
import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpcompile import CostTable, Instr, Op, Program, StagePlan
from rpcompile.passes import emit
from rpcompile.ir.program import CHUNK_OPS, HOST_OPS, MB_OPS, Lane, Ref

small = st.integers(0, 40)


@st.composite
def instrs(draw, with_deps=True):
    op = draw(st.sampled_from(list(Op)))
    if op in HOST_OPS:
        i = Instr(op, -1, layer=draw(small))
    elif op in MB_OPS:
        i = Instr(op, draw(small), stage=draw(small), mb=draw(small),
                  grad=op is Op.ACT_UP and draw(st.booleans()))
    elif op in CHUNK_OPS:
        i = Instr(op, draw(small), stage=draw(small), round=draw(small), chunk=draw(small))
    else:
        i = Instr(op, draw(small), stage=draw(small), round=draw(small))
    if with_deps:
        deps = draw(st.lists(st.tuples(instrs(with_deps=False), st.integers(0, 3), st.integers(0, 3)), max_size=4))
        i = Instr(i.op, i.worker, i.stage, i.mb, i.round, i.chunk, i.layer,
                  tuple(Ref(d.name, b, s) for d, b, s in deps), i.grad)
    return i


@settings(max_examples=300, deadline=None)
@given(instrs())
def test_instr_text_round_trips(i):
    assert Instr.from_str(str(i)) == i
    assert Instr.from_str(i.name).name == i.name


@pytest.mark.parametrize("text, lane", [
    ("w3 P5.r0.c1", Lane.PARAM_UP), ("w3 U5.m2", Lane.ACT_UP), ("w3 U5.m2g", Lane.ACT_UP),
    ("w3 F1.m2", Lane.COMPUTE), ("w3 X4.m2", Lane.COMPUTE), ("w3 R5.m2", Lane.COMPUTE),
    ("w3 B5.m2", Lane.COMPUTE), ("w3 D5.m2", Lane.ACT_DOWN), ("w3 G5.r0.c1", Lane.GRAD_DOWN),
    ("w3 E5.r0", Lane.COMPUTE), ("h O.l7", Lane.OPTIMIZER), ("h C.l7", Lane.COPY)])
def test_every_op_has_its_text_and_lane(text, lane):
    i = Instr.from_str(text)
    assert i.name == text and i.lane is lane and str(i) == text


def test_a_changed_instr_names_itself_anew_and_the_name_is_not_a_field():
    i = Instr.from_str("w3 B5.m2 <- w3 R5.m2")
    assert i.with_worker(2, 8).name == "w5 B5.m2" and replace(i, mb=4).name == "w3 B5.m4"
    assert "_name" not in repr(i) and "w3 B5.m2" not in repr(i)  # the fields, as a dataclass shows them


def test_deps_text():
    i = Instr.from_str("w0 P0.r0.c0 <- w0 E2.r0@-1,h C.l0@-1[t>=2]")
    assert i.deps == (Ref("w0 E2.r0", 1), Ref("h C.l0", 1, 2))
    assert str(i) == "w0 P0.r0.c0 <- w0 E2.r0@-1,h C.l0@-1[t>=2]"


@pytest.mark.parametrize("bad", ["", "w3", "w3 Z5.m2", "w3 F5", "w3 P5.m2", "h F1.m2", "w3 O.l7", "x3 F1.m0",
                                 "w3 F1.m0 <- nonsense", "w3 F1.m2g"])
def test_bad_text_is_rejected(bad):
    with pytest.raises(ValueError, match="cannot parse"):
        Instr.from_str(bad)


def _programs():
    c = CostTable.from_lists(fwd=[1] * 6, bwd=[2] * 6, param_bytes=[1000, 10, 300, 0, 5000, 7])
    return [emit(StagePlan.from_str("2,1|1|1,2"), gpus=2, microbatches=4, staleness=0),
            emit(StagePlan.from_str("2,2|2|3,1"), gpus=3, microbatches=6, staleness=1, costs=c),
            emit(StagePlan.from_str("|1|"), gpus=1, microbatches=1)]


@pytest.mark.parametrize("k", range(3))
def test_csv_round_trip(tmp_path, k):
    p = _programs()[k]
    p.to_csv(tmp_path / "p.csv")
    assert Program.from_csv(tmp_path / "p.csv") == p


@pytest.mark.parametrize("k", range(3))
def test_chrome_trace_has_one_event_per_instruction(tmp_path, k):
    p = _programs()[k]
    p.to_chrome_trace(tmp_path / "t.json")
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert len(ev) == len(p.instrs) and {e["ph"] for e in ev} == {"X"}
    # unit-time placeholder: an instruction starts no earlier than the end of its same-iteration deps
    start = {p.instrs[j].name: e["ts"] for j, e in enumerate(ev)}
    for i in p.instrs:
        for d in i.deps:
            if d.back == 0 and d.since == 0:
                assert start[i.name] >= start[d.name] + 1
    timeline = {i.name: (0.5 * j, 0.5 * j + 0.25) for j, i in enumerate(p.instrs)}
    p.to_chrome_trace(tmp_path / "t2.json", timeline)
    ev = json.loads((tmp_path / "t2.json").read_text())["traceEvents"]
    assert ev[1]["ts"] == pytest.approx(0.5e6) and ev[1]["dur"] == pytest.approx(0.25e6)


def test_grid_is_readable():
    p = _programs()[0]
    text = str(p)
    assert text.splitlines()[0].startswith("Program(2,1|1|1,2, gpus=2")
    assert "w0" in text and "w1" in text and "host" in text and "B4.m3" in text and "O.l3" in text
    marked = p.grid(mark="w0 X2.m1", context=2)
    assert ">>X2.m1<<" in marked and len(marked.splitlines()) <= 7


def test_lanes_and_lookup():
    p = _programs()[0]
    lanes = p.lanes()
    assert sum(len(v) for v in lanes.values()) == len(p.instrs)
    assert all(i.worker == w and i.lane is lane for (w, lane), v in lanes.items() for i in v)
    assert [i.name for i in lanes[(-1, Lane.OPTIMIZER)]] == [f"h O.l{l}" for l in range(3, -1, -1)]
    assert p.by_name()["w0 F0.m0"].op is Op.FORWARD
    assert all(p.chunk_of(i).stage == i.stage for i in p.instrs if i.op in CHUNK_OPS)


@pytest.mark.parametrize("k", range(3))
def test_shifted_is_consistent(k):
    p = _programs()[k]
    assert p.shifted(0) == p
    assert p.shifted(1).shifted(2) == p.shifted(3)
    q = p.shifted(1)
    assert q.worker_offset == p.next_offset
    names = q.by_name()
    for i in q.instrs:
        assert all(d.name in names for d in i.deps)
    assert p.shifted(p.gpus).instrs == p.instrs
