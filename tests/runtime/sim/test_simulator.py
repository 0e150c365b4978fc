"""The discrete-event simulator: exact against the timing recurrence with free transfers, sane with real ones."""
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpcompile import CostTable, StagePlan
from rpcompile.passes.codegen import emit
from rpcompile.passes.partition.timing import default_round_size, iteration_time, steady_state_window
from rpcompile.ir.program import Instr, Op, Program, Ref
from rpcompile.runtime import Timeline, simulate
from rpcompile.runtime.sim.events import Job, StuckError, peak_usage, run_jobs
from tests.strategies import plans

INF = float("inf")


class HW:
    """Stand-in hardware: only the attributes simulate reads."""

    def __init__(self, h2d=INF, d2h=INF, opt=INF, latency=0.0):
        self.h2d_bandwidth, self.d2h_bandwidth, self.optimizer_bytes_per_s = h2d, d2h, opt
        self.link_latency = latency


FREE = HW()
PCIE = HW(h2d=32e9, d2h=32e9, opt=20e9, latency=10e-6)


def uniform(layers, fwd=1.0, bwd=2.0, **kw):
    return CostTable.from_lists(fwd=[fwd] * layers, bwd=[bwd] * layers, **kw)


@st.composite
def cases(draw):
    """(plan, costs, N, M): 2..12 layers, any valid plan, N in 1..8, M in N..4N."""
    layers = draw(st.integers(2, 12))
    plan = draw(plans(layers))
    times = st.integers(1, 40).map(lambda x: x / 8)
    costs = CostTable.from_lists(fwd=draw(st.lists(times, min_size=layers, max_size=layers)),
                                 bwd=draw(st.lists(times, min_size=layers, max_size=layers)),
                                 param_bytes=[10**8] * layers, grad_bytes=[10**8] * layers,
                                 act_bytes=[3 * 10**7] * layers, saved_bytes=[3 * 10**7] * layers,
                                 peak_bytes=[10**8] * layers)
    n = draw(st.integers(1, 8))
    return plan, costs, n, draw(st.integers(n, 4 * n))


def work(plan, costs, m):
    """Compute seconds of one iteration: F once, FB once, B stages twice the forward (recompute)."""
    per = sum(costs.fwd) + sum(costs.bwd) + sum(costs.fwd[l] for s in plan.bwd for l in s)
    return m * per


_FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FAST
@given(cases())
def test_makespan_is_at_least_the_work_per_worker(case):
    plan, costs, n, m = case
    t = simulate(emit(plan, gpus=n, microbatches=m, staleness=0, costs=costs), costs, PCIE)
    assert t.makespan >= work(plan, costs, m) / n - 1e-9
    assert sum(t.busy) == pytest.approx(work(plan, costs, m))
    assert 0.0 <= t.bubble_ratio < 1.0 and max(t.peak_memory) > 0


@_FAST
@given(cases())
def test_free_transfers_reproduce_the_isolated_recurrence(case):
    plan, costs, n, m = case
    t = simulate(emit(plan, gpus=n, microbatches=m, staleness=0, costs=costs), costs, FREE)
    want = iteration_time(plan, costs, gpus=n, microbatches=m, staleness=0)
    assert t.makespan == pytest.approx(want, rel=0, abs=1e-9)
    assert t.iteration_time == t.makespan and t.exposed_comm == pytest.approx(0.0, abs=1e-9)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_free_transfers_reproduce_the_steady_state_recurrence(case):
    plan, costs, n, m = case
    k, _ = steady_state_window(n, plan.num_stages, m // default_round_size(n, m))
    t = simulate(emit(plan, gpus=n, microbatches=m, staleness=1, costs=costs), costs, FREE, iterations=k)
    want = iteration_time(plan, costs, gpus=n, microbatches=m, staleness=1)
    assert t.steady_iteration_time == pytest.approx(want, rel=0, abs=1e-9)
    assert t.iteration_time == t.steady_iteration_time


def closed_form_plan(n):
    """Every stage takes 3 (fwd 1, bwd 2 per layer) and N-1 forward stages precede the fused one."""
    plan = StagePlan.from_sizes([3] * (n - 1), 1, [1] * (3 * (n - 1)))
    return plan, uniform(plan.num_layers)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_uniform_stages_give_the_closed_form_bubble(n, k):
    plan, c = closed_form_plan(n)
    m, s = k * n, plan.num_stages
    t = simulate(emit(plan, gpus=n, microbatches=m, round_size=n, staleness=0), c, FREE)
    assert t.bubble_ratio == pytest.approx(n * (n - 1) / (m * s + n * (n - 1)), rel=0, abs=1e-9)


@pytest.mark.parametrize("n,r", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 6), (8, 8), (8, 10)])
def test_every_worker_is_busy_in_the_steady_state(n, r):
    plan, c = closed_form_plan(max(n, 2))
    k, p = steady_state_window(n, plan.num_stages, 2)
    t = simulate(emit(plan, gpus=n, microbatches=2 * r, round_size=r, staleness=1), c, FREE, iterations=k)
    assert t.steady_bubble == pytest.approx(0.0, abs=1e-9)
    ends = t.iteration_ends
    lo, hi = ends[k - 1 - 2 * p], ends[k - 1 - p]  # a window away from the final drain
    assert t.worker_busy(lo, hi) == pytest.approx([hi - lo] * n, abs=1e-9)


def test_slow_pcie_is_exposed_and_costs_time():
    plan, n, m = StagePlan.from_str("2,2|1|1,1,1,1"), 2, 4
    c = uniform(5, fwd=1e-3, bwd=2e-3, param_bytes=[10**9] * 5, grad_bytes=[10**9] * 5, act_bytes=[10**8] * 5, saved_bytes=[10**8] * 5)
    p = emit(plan, gpus=n, microbatches=m, staleness=0, costs=c)
    free, slow = simulate(p, c, FREE), simulate(p, c, HW(h2d=16e9, d2h=16e9, opt=20e9))
    assert slow.makespan > free.makespan + 0.05 and slow.exposed_comm > 0.05
    assert sum(slow.exposed_per_worker) == pytest.approx(slow.exposed_comm)
    # the host optimizer shows up after the last backward: 2 B of fp32 master per parameter byte
    assert slow.makespan >= max(slow.iteration_ends) + 2 * 10**9 / 20e9 - 1e-9


def test_peak_memory_counts_the_parameter_chunks_and_activations():
    plan, n, m = StagePlan.from_str("1|1|1"), 1, 1
    c = uniform(2, param_bytes=[1000, 1000], act_bytes=[10, 10], saved_bytes=[5, 5], peak_bytes=[100, 100])
    t = simulate(emit(plan, gpus=n, microbatches=m, staleness=0, costs=c), c, PCIE)
    # at most two stage slots' parameters (running + prefetched) plus activations and workspace
    assert 1000 < t.peak_memory[0] <= 2 * 1000 + 2 * 1000 + 200 + 40


def test_iterations_follow_the_rotation_of_shifted():
    plan = StagePlan.from_str("1,1|1|1,1")
    p = emit(plan, gpus=3, microbatches=3, staleness=1)
    t = simulate(p, uniform(3), PCIE, iterations=3)
    for it in range(3):
        want = {i.name: i.worker for i in p.shifted(it).instrs}
        got = {r.name: r.worker for r in t.records if r.iteration == it}
        assert got == want
    assert len(t.iteration_ends) == 3 and t.iteration_ends[0] < t.iteration_ends[1] < t.iteration_ends[2]
    assert (0, "w0 F0.m0") in t.times() and t.start["w0 F0.m0"] < t.end["w0 F0.m0"]


def test_records_list_every_instance_in_program_order_and_compare_as_a_tuple():
    """Records are made when read: record j is iteration j // n's instruction j % n, with its physical
    name and worker (host instructions keep their template name), lane, op and times."""
    p = emit(StagePlan.from_str("1,1|1|1,1"), gpus=3, microbatches=3, staleness=1)
    t = simulate(p, uniform(3, param_bytes=[10**6] * 3), PCIE, iterations=3)
    n, recs = len(p.instrs), tuple(t.records)
    assert len(t.records) == len(recs) == 3 * n and t.records == recs and recs == tuple(t.records)
    host = 0
    for j, r in enumerate(recs):
        it, tmpl = divmod(j, n)
        phys = p.shifted(it).instrs[tmpl]
        worker = -1 if p.instrs[tmpl].is_host else phys.worker
        host += worker < 0
        name = p.instrs[tmpl].name if worker < 0 else f"w{worker} {phys.short}"
        assert (r.name, r.template, r.iteration, r.worker, r.lane, r.op) == \
            (name, p.instrs[tmpl].name, it, worker, phys.lane.value, phys.op.value), j
        assert r.start <= r.end and t.records[j] == r and t.records[j - 3 * n] == r
    assert host and t.records[n:2 * n] == recs[n:2 * n] and t.records[::-5] == recs[::-5]
    assert t.records != recs[:-1] and t.records != recs[:-1] + (recs[0],)
    with pytest.raises(IndexError):
        t.records[3 * n]


def test_a_freed_channel_goes_to_the_head_ready_first_among_equal_priorities():
    """Lane 1's head is ready at 0, lane 2's at 0.5 (after a job on another channel); both wait for lane 0's
    job on their channel. When it ends, the one ready first goes, although lane 2 is visited later."""
    jobs = [Job(0, 0, 0, 1.0, ()), Job(3, 1, 0, 0.5, ()), Job(1, 0, 0, 1.0, ()), Job(2, 0, 0, 1.0, (1,))]
    assert run_jobs(jobs) == ([0.0, 0.0, 1.0, 2.0], [1.0, 0.5, 2.0, 3.0])


def test_trace_and_plot(tmp_path):
    plan, c = StagePlan.from_str("1|1|1"), uniform(2, act_bytes=[10**6] * 2)
    p = emit(plan, gpus=2, microbatches=2, staleness=0, costs=c)
    t = simulate(p, c, PCIE)
    t.to_chrome_trace(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == len(p.instrs)
    p.to_chrome_trace(tmp_path / "p.json", t)  # the Program's own trace accepts a Timeline
    t.plot(tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    assert isinstance(t, Timeline) and "bubble" in str(t)


def test_bad_inputs_have_clear_errors():
    p = emit(StagePlan.from_str("1|1|1"), gpus=1, microbatches=1)
    with pytest.raises(ValueError, match="layers"):
        simulate(p, uniform(3), FREE)
    with pytest.raises(ValueError, match="optimizer_bytes_per_s"):
        simulate(p, uniform(2), object())
    bad = Program(p.plan, 1, 1, 1, 0, 0, 0, (Instr(Op.FORWARD, 0, 0, 0, deps=(Ref("w0 F9.m0"),)),), ())
    with pytest.raises(ValueError, match="F9"):
        simulate(bad, uniform(2), FREE)
    cyc = Program(p.plan, 1, 1, 1, 0, 0, 0, (Instr(Op.FORWARD, 0, 0, 0, deps=(Ref("w0 B2.m0"),)),
                                             Instr(Op.BACKWARD, 0, 2, 0, deps=(Ref("w0 F0.m0"),))), ())
    with pytest.raises(RuntimeError, match="never ran"):
        simulate(cyc, uniform(2), FREE)


# --- the scheduler core ---------------------------------------------------------------------------

def test_core_fifo_and_deps():
    jobs = [Job(0, 0, 0, 2.0, ()), Job(1, 1, 0, 1.0, ()), Job(0, 0, 0, 1.0, (1,)), Job(1, 1, 0, 5.0, (2,))]
    assert run_jobs(jobs) == ([0.0, 0.0, 2.0, 3.0], [2.0, 1.0, 3.0, 8.0])


def test_core_priority_on_a_shared_channel():
    # lane 0 (low, parameters) and lane 1 (high, activations) share channel 7
    jobs = [Job(0, 7, 1, 2.0, ()), Job(0, 7, 1, 2.0, ()), Job(1, 7, 0, 1.0, ()), Job(2, 9, 0, 1.5, ()),
            Job(1, 7, 0, 1.0, (3,))]
    starts, ends = run_jobs(jobs)
    assert starts == [1.0, 4.0, 0.0, 0.0, 3.0]  # high first; no preemption of a started chunk


def test_core_zero_durations_chain_within_an_instant():
    jobs = [Job(i, i, 0, 0.0, (i - 1,) if i else ()) for i in range(50)] + [Job(0, 0, 0, 1.0, (49,))]
    starts, ends = run_jobs(jobs)
    assert max(ends) == 1.0 and starts[-1] == 0.0


def test_core_reports_stuck_jobs():
    with pytest.raises(StuckError) as e:
        run_jobs([Job(0, 0, 0, 1.0, (1,)), Job(0, 0, 0, 1.0, ())])  # FIFO order against the dep
    assert e.value.stuck == [0, 1]
    assert peak_usage([]) == 0 and peak_usage([(0.0, 1.0, 3), (1.0, 2.0, 4)]) == 4
    assert math.isinf(INF)


def test_each_job_lasts_its_own_instructions_duration():
    """Every job of a run lasts what `_duration` gives its own instruction (computed once per kind of
    instruction: chunks of one stage of different sizes, a B slot's saved-input and gradient uploads of different
    sizes, layers' steps and copies must not share a duration)."""
    from rpcompile.runtime.sim.simulator import _Bandwidths, _duration, _Moved
    costs = CostTable.from_lists(fwd=[1.0, 2.0, 3.0, 4.0], bwd=[2.0, 4.0, 6.0, 8.0],
                                 act_bytes=[3 * 10**6, 5 * 10**6, 7 * 10**6, 11 * 10**6],
                                 saved_bytes=[13 * 10**6, 17 * 10**6, 19 * 10**6, 23 * 10**6],
                                 param_bytes=[29 * 10**6, 31 * 10**6, 37 * 10**6, 41 * 10**6],
                                 grad_bytes=[43 * 10**6, 47 * 10**6, 53 * 10**6, 59 * 10**6])
    hw = type("HW", (), dict(h2d_bandwidth=1e9, d2h_bandwidth=2e9, optimizer_bytes_per_s=3e9,
                             host_memcpy_bandwidth=5e9, link_latency=1e-6))()
    program = emit(StagePlan.from_str("3|1|3"), gpus=2, microbatches=4, costs=costs)
    assert len({c.bytes for c in program.chunks if c.stage == 0}) > 1  # a stage's chunks differ in size
    t = simulate(program, costs, hw, iterations=2)
    bw, moved = _Bandwidths.of(hw), _Moved(program, costs)
    want = [_duration(i, program, costs, bw, moved) for i in program.instrs]
    assert len(set(want)) > 10
    for j, r in enumerate(t.records):
        assert r.end - r.start == pytest.approx(want[j % len(want)], rel=1e-9, abs=1e-15), r.name
