"""verify: each rule accepts emit's programs and rejects a program that breaks it."""
from dataclasses import replace

import pytest

from rpcompile import CostTable, Instr, ProgramError, StagePlan
from rpcompile.passes import emit, verify
from rpcompile.passes.verify import RULES
from rpcompile.ir.program import Ref

PLAN = StagePlan.from_str("2,1|1|1,2")   # F0 F1 X2 B3 B4, layers 0..3


def prog(staleness=1, plan=PLAN, gpus=2, microbatches=4, **kw):
    return emit(plan, gpus=gpus, microbatches=microbatches, staleness=staleness, **kw)


def edit(p, name, deps=None, drop=(), add=()):
    """p with instruction `name`'s deps replaced, or some names dropped / refs added."""
    assert name in p.by_name(), name
    out = []
    for i in p.instrs:
        if i.name == name:
            d = tuple(deps) if deps is not None else i.deps
            d = tuple(r for r in d if r.name not in drop) + tuple(add)
            i = replace(i, deps=d)
        out.append(i)
    return replace(p, instrs=tuple(out))


def rule_of(p, **kw):
    with pytest.raises(ProgramError) as e:
        verify(p, **kw)
    return e.value


@pytest.mark.parametrize("staleness", [0, 1])
def test_valid_programs_pass_every_rule(staleness):
    p = prog(staleness)
    assert verify(p) is p
    assert verify(p.shifted(1)) == p.shifted(1)


def test_message_names_rule_and_marks_the_instruction():
    e = rule_of(edit(prog(), "w1 U1.m0", drop=("w0 D0.m0",)))
    assert e.rule == "INPUT" and e.instr == "w1 U1.m0"
    assert str(e).startswith("[INPUT] at w1 U1.m0") and ">>U1.m0<<" in str(e) and "step" in str(e)


def test_structure_wrong_worker():
    p = prog()
    instrs = tuple(replace(i, worker=1) if i.name == "w0 X2.m0" else i for i in p.instrs)
    assert rule_of(replace(p, instrs=instrs)).rule == "STRUCTURE"


def test_structure_a_chunk_the_program_does_not_have():
    p = prog()
    name = next(i.name for i in p.instrs if i.op.name == "PARAM_UP")
    instrs = tuple(replace(i, chunk=9) if i.name == name else i for i in p.instrs)
    e = rule_of(replace(p, instrs=instrs))
    assert e.rule == "STRUCTURE" and "no such chunk" in str(e)


def test_deps_must_resolve():
    e = rule_of(edit(prog(), "w0 F0.m1", add=(Ref("w0 F9.m1"),)))
    assert e.rule == "DEPS" and "F9" in str(e)


def test_acyclic():
    e = rule_of(edit(prog(), "w0 F0.m0", add=(Ref("w0 D0.m0"),)))
    assert e.rule == "ACYCLIC" and e.instr == "w0 F0.m0"


def test_once_duplicate_and_missing():
    p = prog()
    dup = next(i for i in p.instrs if i.name == "w1 B3.m1")
    k = p.instrs.index(dup)
    assert rule_of(replace(p, instrs=p.instrs[:k + 1] + (dup,) + p.instrs[k + 1:])).rule == "ONCE"
    assert rule_of(replace(p, instrs=p.instrs[:k] + p.instrs[k + 1:])).rule == "ONCE"


def test_input_needs_producer_and_parameters():
    assert rule_of(edit(prog(), "w1 U1.m0", drop=("w0 D0.m0",))).rule == "INPUT"
    assert rule_of(edit(prog(), "w1 B3.m1", drop=("w1 U3.m1g",))).rule == "INPUT"
    e = rule_of(edit(prog(), "w0 F0.m0", drop=("w0 P0.r0.c0", "w0 P0.r0.c1")))
    assert e.rule == "INPUT" and "parameters" in str(e)


def test_grad_download_before_the_last_backward():
    p = prog()
    g = next(i for i in p.instrs if i.name == "w1 G3.r0.c0")
    rest = [i for i in p.instrs if i is not g]
    k = next(j for j, i in enumerate(rest) if i.name == "w1 B3.m0")
    moved = replace(g, deps=(Ref("w1 B3.m0"),) + g.deps[1:])
    e = rule_of(replace(p, instrs=tuple(rest[:k + 1] + [moved] + rest[k + 1:])))
    assert e.rule == "GRAD" and e.instr == "w1 G3.r0.c0"


def test_release_gates_the_parameter_upload():
    p = prog(microbatches=8, round_size=4)          # slot 5 reuses the buffer of slot 1
    name = "w1 P0.r1.c0"
    e = rule_of(edit(p, name, drop=("w1 E1.r0",)))
    assert e.rule == "RELEASE" and e.instr == name


def test_r1_copy_waits_for_old_version_uploads():
    p = prog(staleness=1)
    c = next(i for i in p.instrs if i.name == "h C.l3")
    e = rule_of(edit(p, "h C.l3", deps=[d for d in c.deps if not d.name.startswith("w")]))
    assert e.rule == "R1" and e.instr == "h C.l3"


def test_r1_a_step_that_writes_the_copy_waits_for_old_version_uploads():
    """Staleness 0: the runtime writes the compute copy in STEP's pass, so STEP.l must follow every upload of l
    of its iteration (emit's programs order it through the gradients; here the step waits for nothing of t)."""
    p = prog(staleness=0)
    o = next(i for i in p.instrs if i.name == "h O.l3")
    bad = edit(p, "h O.l3", deps=[d for d in o.deps if not d.name.startswith("w")])
    e = rule_of(bad, rules=("R1",))  # COPY.l3 itself still waits for the uploads
    assert e.rule == "R1" and e.instr == "h O.l3" and "writes the copy" in str(e)
    assert verify(edit(prog(staleness=1), "h O.l3", deps=o.deps[-1:]), rules=("R1",))  # no fused copy there


def test_r2_upload_waits_for_the_copy():
    for s in (0, 1):
        e = rule_of(edit(prog(s), "w0 P0.r0.c0", drop=("h C.l0",)))
        assert e.rule == "R2" and e.instr == "w0 P0.r0.c0"


def test_r3_step_waits_for_gradients():
    p = prog(staleness=1)
    o = next(i for i in p.instrs if i.name == "h O.l3")
    e = rule_of(edit(p, "h O.l3", deps=[d for d in o.deps if not d.name.startswith("w")]))
    assert e.rule == "R3" and e.instr == "h O.l3"


def test_r4_next_gradient_waits_for_the_step():
    e = rule_of(edit(prog(staleness=1), "w0 G2.r0.c0", drop=("h O.l3",)))
    assert e.rule == "R4" and e.instr == "w0 G2.r0.c0"


def test_r5_step_after_its_copy():
    e = rule_of(edit(prog(staleness=1), "h O.l0", drop=("h C.l0",)))
    assert e.rule == "R5" and e.instr == "h O.l0"


def test_r5_steps_in_order():
    p = prog(staleness=1)
    o3, o2 = (next(i for i in p.instrs if i.name == n) for n in ("h O.l3", "h O.l2"))
    k3, k2 = p.instrs.index(o3), p.instrs.index(o2)     # ... C.l3 O.l3 C.l2 O.l2 ... -> C.l3 C.l2 O.l2 O.l3
    swapped = replace(o2, deps=tuple(d for d in o2.deps if d.name != "h O.l3"))
    instrs = p.instrs[:k3] + (p.instrs[k3 + 1], swapped, o3) + p.instrs[k2 + 1:]
    e = rule_of(replace(p, instrs=instrs))
    assert e.rule == "R5" and "one at a time" in str(e)


def test_memory_budget():
    costs = CostTable.from_lists(fwd=[1], bwd=[1], param_bytes=[100], grad_bytes=[40],
                                 saved_bytes=[7], peak_bytes=[50])
    p = emit(StagePlan.from_str("|1|"), gpus=1, microbatches=2, costs=costs)
    need = 100 + 100 + 2 * 7 + 0 + 40 + 50    # params + prefetched next slot + 2 inputs + out + grads + workspace
    assert p.plan.stage_memory(costs, gpus=1) == (need,)
    assert verify(p, costs, need) is p
    e = rule_of(p, costs=costs, memory_budget=need - 1)
    assert e.rule == "MEMORY" and str(need) in str(e)


def test_memory_on_a_larger_plan():
    costs = CostTable.from_lists(fwd=[1] * 4, bwd=[1] * 4, param_bytes=[100, 200, 300, 400],
                                 grad_bytes=[100, 200, 300, 400], act_bytes=[10] * 4, saved_bytes=[10] * 4,
                                 peak_bytes=[5] * 4)
    p = prog(costs=costs)
    assert verify(p, costs, 10**6) is p
    assert rule_of(p, costs=costs, memory_budget=1000).rule == "MEMORY"


def test_rules_are_switchable():
    bad = edit(prog(), "w1 U1.m0", drop=("w0 D0.m0",))
    assert verify(bad, rules=("STRUCTURE", "ONCE", "R1")) is bad
    assert set(RULES) >= {"DEPS", "ACYCLIC", "ONCE", "INPUT", "GRAD", "RELEASE", "R1", "R2", "R3", "R4", "R5",
                          "MEMORY"}


def test_instr_is_exported():
    assert Instr.from_str("h O.l1").layer == 1


# -- a release dependency on the previous iteration, removed, is rejected ------------------------------
# -- verify: a release dependency on the previous iteration ------------------------------------------------
def _drop(p, name: str, dep: str):
    """p with the dependency `dep` of instruction `name` removed (asserting it was a previous-iteration one)."""
    out = []
    for i in p.instrs:
        if i.name == name:
            (ref,) = [d for d in i.deps if d.name == dep]
            assert ref.back == 1, f"{name} <- {ref} is not a previous-iteration dependency"
            i = replace(i, deps=tuple(d for d in i.deps if d.name != dep))
        out.append(i)
    return replace(p, instrs=tuple(out))


@pytest.mark.parametrize("staleness", [0, 1])
def test_verify_rejects_a_removed_previous_iteration_release(staleness):
    # 5 stages on 2 workers: slot 1's upload w1 P1.r0.c0 reuses the buffer of slot 1 - 2N = -3, i.e. the
    # previous iteration's slot 7 (w1 E2.r1), reached only through a Ref with back=1
    p = emit(StagePlan.from_str("2,1|1|1,2"), gpus=2, microbatches=4, staleness=staleness)
    assert verify(p) is p
    for name, dep in (("w1 P1.r0.c0", "w1 E2.r1"), ("w0 P2.r0.c0", "w0 E3.r1"), ("w1 P3.r0.c0", "w1 E4.r1")):
        with pytest.raises(ProgramError) as e:
            verify(_drop(p, name, dep))
        assert e.value.rule == "RELEASE" and e.value.instr == name and "iteration t)" in str(e.value)


def test_verify_rejects_a_program_without_any_previous_iteration_release():
    p = emit(StagePlan.from_str("2,1|1|1,2"), gpus=2, microbatches=8, round_size=4, staleness=1)
    cross = tuple(replace(i, deps=tuple(d for d in i.deps if not (d.back and " E" in d.name)))
                  if i.op.name == "PARAM_UP" else i for i in p.instrs)
    assert cross != p.instrs
    with pytest.raises(ProgramError) as e:
        verify(replace(p, instrs=cross))
    assert e.value.rule == "RELEASE"
