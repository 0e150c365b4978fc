"""The simulator's C event loop (runtime/sim/events.c) against the Python one: the same floats, the same errors."""
import dataclasses
import random

import pytest

from forked import damaged_copy, exit_status
from rpcompile.ir.cache import intact
from rpcompile.runtime.sim import native
from rpcompile.runtime.sim.events import Job, Jobs, StuckError, run_jobs

BUILT = native.load()  # in the suite's cache
pytestmark = pytest.mark.skipif(BUILT is None, reason="no C compiler: the simulator runs in Python")


def random_jobs(rng: random.Random, n: int) -> list[Job]:
    """Jobs on a few lanes sharing a few channels, two priorities, equal and zero durations (ties everywhere),
    each depending on up to three earlier jobs (so list order is a valid run: nothing is stuck)."""
    lanes = rng.randint(1, 6)
    channel = [rng.randint(0, max(0, lanes - 2)) * 3 + 5 for _ in range(lanes)]  # sparse channel ids
    lane_ids = rng.sample(range(40), lanes)  # sparse lane ids: the rank breaks ties
    out = []
    for j in range(n):
        q = rng.randrange(lanes)
        dur = rng.choice([0.0, 0.5, 1.0, 1.0, rng.random(), rng.random() * 1e-9])
        deps = tuple(sorted(rng.sample(range(j), min(j, rng.randint(0, 3)))))
        out.append(Job(lane_ids[q], channel[q], rng.randint(0, 1), dur, deps))
    return out


@pytest.mark.parametrize("seed", range(60))
def test_c_loop_gives_the_python_floats(seed):
    rng = random.Random(seed)
    jobs = random_jobs(rng, rng.randint(1, 300))
    assert run_jobs(jobs) == run_jobs(jobs, native=False)
    assert run_jobs(Jobs.of(jobs)) == run_jobs(jobs, native=False)


@pytest.mark.parametrize("native_loop", [True, False])
def test_both_loops_report_the_same_errors(native_loop):
    with pytest.raises(StuckError) as e:
        run_jobs([Job(0, 0, 0, 1.0, (1,)), Job(0, 0, 0, 1.0, ())], native=native_loop)
    assert e.value.stuck == [0, 1]
    with pytest.raises(StuckError) as e:  # a cycle through two lanes; the third job never waits on it
        run_jobs([Job(0, 0, 0, 1.0, (1,)), Job(1, 1, 0, 1.0, (0,)), Job(2, 2, 0, 1.0, ())], native=native_loop)
    assert e.value.stuck == [0, 1]
    with pytest.raises(ValueError, match="lane 3 spans several channels"):
        run_jobs([Job(3, 0, 0, 1.0, ()), Job(3, 1, 0, 1.0, ())], native=native_loop)
    with pytest.raises(ValueError, match="job 1 depends on job 5"):
        run_jobs([Job(0, 0, 0, 1.0, ()), Job(0, 0, 0, 1.0, (5,))], native=native_loop)
    assert run_jobs([], native=native_loop) == ([], [])


def test_zero_duration_completions_come_before_the_instant_s_start_decisions():
    """A zero-length job on channel 0 ends at time 0 and readies a high-priority job on channel 1; channel 1's
    first decision, also at time 0, must see it (events popped by time, then completions before starts)."""
    jobs = [Job(0, 0, 0, 0.0, ()), Job(1, 1, 1, 1.0, ()), Job(2, 1, 0, 1.0, (0,))]
    for native_loop in (True, False):
        assert run_jobs(jobs, native=native_loop) == ([0.0, 1.0, 0.0], [0.0, 2.0, 1.0])


def test_off_switch_runs_python(monkeypatch):
    monkeypatch.setenv("RPCOMPILE_SIM_KERNEL", "0")
    assert native.load() is None
    assert run_jobs([Job(0, 0, 0, 1.0, ()), Job(1, 0, 0, 2.0, (0,))]) == ([0.0, 1.0], [1.0, 3.0])


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_a_damaged_kernel_is_built_again_before_a_process_maps_it(monkeypatch, tmp_path, how):
    """Half the file (a link stopped by a full disk: mapping it killed the process with SIGBUS) or as many
    garbage bytes: the next process builds it again and loads it, and the one after simulates with it."""
    monkeypatch.setenv("RPCOMPILE_CACHE", str(tmp_path))
    path = native.LIBRARY.path()
    damaged_copy(BUILT._name, path, how)  # a copy this process has not mapped
    assert exit_status(lambda: native.load() is not None) == 0
    assert intact(path)
    jobs = random_jobs(random.Random(7), 200)
    assert native.load() is not None and run_jobs(jobs) == run_jobs(jobs, native=False)


def random_programs(seed: int):
    """(costs, hardware, programs): random RoundPipe programs (staleness 0 and 1), two bound-stage baselines, and
    one with a dependency between compute on two workers."""
    from rpcompile import CostTable, StagePlan
    from rpcompile.passes import emit
    from rpcompile.ir.instr import Ref
    from rpcompile.runtime.sim.baselines import gpipe, one_f_one_b
    rng = random.Random(seed)
    layers = rng.randint(3, 8)
    costs = CostTable.from_lists(fwd=[rng.uniform(1, 3) for _ in range(layers)],
                                 bwd=[rng.uniform(2, 6) for _ in range(layers)],
                                 act_bytes=[rng.randint(1, 9) * 10**6 for _ in range(layers)],
                                 param_bytes=[rng.randint(1, 9) * 10**7 for _ in range(layers)],
                                 grad_bytes=[rng.randint(0, 9) * 10**7 for _ in range(layers)],
                                 peak_bytes=[rng.randint(1, 9) * 10**6 for _ in range(layers)])
    hw = type("HW", (), dict(h2d_bandwidth=1e9, d2h_bandwidth=1e9, optimizer_bytes_per_s=1e10))()
    gpus = rng.choice([2, 3, 4])
    cut = rng.randint(1, layers - 2)
    plan = StagePlan.from_str(f"{cut},{layers - 1 - cut}|1|{layers - 1 - cut},{cut}")
    programs = [emit(plan, gpus=gpus, microbatches=gpus * rng.choice([1, 2]), staleness=st) for st in (0, 1)]
    programs += [gpipe(costs, gpus=2, microbatches=4), one_f_one_b(costs, gpus=2, microbatches=4)]
    # and a dependency between compute on two workers: only a same-worker consumer frees a buffer
    g = programs[-2]
    extra = {"w1 B1.m1": Ref("w0 F0.m0")}
    programs.append(dataclasses.replace(g, instrs=tuple(
        dataclasses.replace(i, deps=i.deps + (extra[i.name],)) if i.name in extra else i for i in g.instrs)))
    return costs, hw, programs


@pytest.mark.parametrize("seed", range(4))
def test_the_c_memory_model_gives_the_python_peaks(seed, monkeypatch):
    """`simulate`'s peak bytes per worker from memory.c equal the Python loop's, on random RoundPipe programs
    (staleness 0 and 1, several iterations: gradient slots, buffers freed by later consumers) and on the
    bound-stage baselines (resident optimizer state)."""
    from rpcompile.runtime import simulate
    costs, hw, programs = random_programs(seed)
    for program in programs:
        monkeypatch.setenv("RPCOMPILE_SIM_KERNEL", "1")
        assert native.load() is not None
        c = simulate(program, costs, hw, iterations=3)
        monkeypatch.setenv("RPCOMPILE_SIM_KERNEL", "0")
        py = simulate(program, costs, hw, iterations=3)
        assert c.peak_memory == py.peak_memory and max(c.peak_memory) > 0
        assert c == py  # and everything else: the expanded dependencies and exposed waits of jobs.c too


@pytest.mark.parametrize("seed", range(6))
def test_the_c_job_passes_give_the_python_ones(seed):
    """jobs.c: the dependencies of K iterations expanded from the template (some reaching back, some from a later
    iteration on) and the exposed waits are the Python's, integers and floats alike."""
    from rpcompile.runtime.sim.events import exposed_waits, exposed_waits_python
    from rpcompile.runtime.sim.simulator import _expand_deps_python
    rng = random.Random(seed)
    n, iterations = rng.randint(1, 40), rng.randint(1, 6)
    deps_of = [[(rng.randint(0, 2), rng.randint(0, 3), rng.randrange(k + 1 if rng.random() < 0.5 else n))
                for _ in range(rng.randint(0, 3))] for k in range(n)]
    deps_of = [[(b, s, d) for b, s, d in dl if b > 0 or d < k] for k, dl in enumerate(deps_of)]  # acyclic
    ptr, idx = native.expand_native(BUILT, deps_of, iterations, n)
    want = _expand_deps_python(deps_of, iterations, n)
    assert (list(ptr), list(idx)) == want
    jobs = random_jobs(rng, rng.randint(1, 300))
    cols = Jobs.of(jobs)
    lanes = sorted({j.lane for j in jobs})
    cols = dataclasses.replace(cols, lane=[lanes.index(j.lane) for j in jobs])  # numbered 0 .. L - 1
    starts, ends = run_jobs(cols)
    transfer = [rng.random() < 0.5 for _ in jobs]
    compute = [not t and rng.random() < 0.8 for t in transfer]
    got = exposed_waits(cols, starts, ends, transfer, compute)
    assert got == exposed_waits_python(cols, starts, ends, transfer, compute)
    assert got == exposed_waits(cols, starts, ends, transfer, compute, native=False) and any(got)
