"""The planner's C kernel (`native.py`: shape.c, steady.c, exact.c, layouts.c) gives the floats of the Python recurrences bit for bit: the exact
`timing.shape_time` and the fast `steady.steady_time`, one plan or a batch, with and without a cutoff; so
`partition` returns the same plan, report and float with or without it. Without a C compiler, or with
RPCOMPILE_PLANNER_KERNEL=0, it is not used and nothing else changes.
"""
import itertools
import json
import math
import os
import random

import pytest

from forked import damaged_copy, exit_status
from rpcompile import CostTable
from rpcompile.ir.cache import SEAL, intact
from rpcompile.passes import partition
from rpcompile.passes.partition import cap_walk, native
from rpcompile.passes.partition.evaluator import Evaluator
from rpcompile.passes.partition.steady import steady_time
from rpcompile.passes.partition.timing import shape, shape_time

from test_steady import PAPER, problem, random_plan

LIB = native.load()
needs_lib = pytest.mark.skipif(LIB is None, reason="no C compiler: the planner kernel is not built here")


def cutoffs(rng, exact):
    """None, the time itself, just below it (1 ulp and 1e-12), and well below and above."""
    return [None, exact, math.nextafter(exact, 0.0), exact * (1 - 1e-12), exact * rng.choice([0.5, 0.9]),
            exact * 1.1]


@needs_lib
@pytest.mark.parametrize("seed", range(3))
def test_one_plan_equals_the_python_recurrences_bit_for_bit(seed):
    rng = random.Random(seed)
    for _ in range(120):
        costs, kw = problem(rng)
        ev = Evaluator(costs, staleness=0, memory=None, **kw)
        stages = ev.stages(*random_plan(rng, costs.num_layers))
        for staleness in (0, 1):
            exact = shape_time(shape(stages), staleness=staleness, **kw)
            for cut in cutoffs(rng, exact):
                for python, is_exact in ((shape_time, True), (steady_time, False)):
                    want = python(shape(stages), staleness=staleness, cutoff=cut, **kw)
                    got = native.time(LIB, stages, staleness=staleness, cutoff=cut, exact=is_exact, **kw)
                    assert got == want, (stages, kw, staleness, cut, is_exact)


@needs_lib
@pytest.mark.parametrize("seed", range(3))
def test_a_batch_equals_steady_time_bit_for_bit(seed):
    rng = random.Random(50 + seed)
    for _ in range(30):
        costs, kw = problem(rng)
        for staleness in (0, 1):
            ev = Evaluator(costs, staleness=staleness, memory=None, **kw)
            plans = [random_plan(rng, costs.num_layers) for _ in range(rng.randint(1, 30))]
            want = [steady_time(shape(ev.stages(*p)), staleness=staleness, **kw) for p in plans]
            assert native.steady_times(LIB, ev, plans) == want, (kw, staleness)
            cut = rng.choice(want) * rng.choice([0.9, 1.0, 1.1])
            want = [steady_time(shape(ev.stages(*p)), staleness=staleness, cutoff=cut, **kw) for p in plans]
            assert native.steady_times(LIB, ev, plans, cut) == want, (kw, staleness, cut)


def walk_problem(rng):
    """Random layer times (equal, within 1e-13 or 1e-10 of each other, zero) and bytes, and an evaluator with a
    memory budget (or none) that some stages exceed."""
    nl = rng.randint(2, 40)
    layer = rng.choice([1.0, 0.1, rng.uniform(0.1, 2.0)])  # equal layers: contiguous sums that tie
    near = [layer * (1 + rng.choice([1e-13, -1e-13, 1e-10])) for _ in range(3)]  # one cap within 1e-12, or not
    fwd = [rng.choice([layer, layer, 0.0, rng.uniform(0.0, 3.0), *near]) for _ in range(nl)]
    bwd = [x * rng.choice([2.0, rng.uniform(0.0, 3.0)]) for x in fwd]
    big = rng.choice([10, 10**6, 10**12])

    def rand():
        return [rng.choice([0, rng.randint(1, big)]) for _ in range(nl)]
    costs = CostTable.from_lists(fwd=fwd, bwd=bwd, param_bytes=rand(), grad_bytes=rand(), peak_bytes=rand(),
                                 act_bytes=rand(), saved_bytes=rand())
    memory = rng.choice([None, rng.randint(0, 4 * big)])
    return costs, Evaluator(costs, gpus=rng.randint(1, 8), microbatches=4, round_size=2, staleness=1, memory=memory)


@needs_lib
@pytest.mark.parametrize("seed", range(4))
def test_the_cap_walk_in_c_steps_as_the_python_one(seed):
    # both walks of a fused size (up and down, sharing each side's layouts), stepped in a random interleaving until
    # both are done: every step's caps, fewest stages and new layouts that may fit equal the Python walk's
    rng = random.Random(900 + seed)
    for _ in range(40):
        costs, ev = walk_problem(rng)
        pf = list(itertools.accumulate(costs.fwd, initial=0.0))
        pb = list(itertools.accumulate((a + b for a, b in zip(costs.fwd, costs.bwd)), initial=0.0))
        kernel = native.cap_walks(LIB, ev, pf, pb, cap_walk._EXTRA)
        try:
            for f in rng.sample(range(1, costs.num_layers), min(3, costs.num_layers - 1)):
                n = costs.num_layers - f
                pair, seen = kernel.pair(n), (set(), set())
                t_min = max(pb[-1] - pb[n], max(a + b for a, b in zip(costs.fwd[:n], costs.bwd[:n])))
                walks = []
                for down, lo, hi in ((False, (t_min, t_min), math.inf),
                                     (True, (max(costs.fwd[:n]), t_min * rng.choice([0.0, 0.5])), t_min)):
                    sides = [cap_walk._Caps(p, n, lo[i], hi, seen[i], ok=lambda sizes, b=bool(i): ev.side_fits(
                        sizes, backward=b)) for i, p in enumerate((pf, pb))]
                    walks.append((kernel.walk(pair, n, down, lo, hi), cap_walk._PyWalk(tuple(sides), down)))
                while walks:
                    c, py = walk = rng.choice(walks)
                    got, want = c.step(), py.step()
                    assert got == want, (costs, ev.memory, f, walk is walks[0])
                    if want is None or want[1] is None:
                        walks.remove(walk)
        finally:
            kernel.close()


@needs_lib
def test_bytes_too_large_for_the_c_walk_leave_it_to_python(monkeypatch):
    # the C walk counts bytes in 64-bit integers: a memory budget over bytes of 2**62 and more, or given as a
    # float, leaves the walk to Python (`_Caps`); the plans are the same either way
    rng = random.Random(7)
    nl = 12
    fwd, zeros = [rng.uniform(0.5, 1.5) for _ in range(nl)], [0.0] * (nl + 1)
    small = CostTable.from_lists(fwd=fwd, bwd=[2.0] * nl, param_bytes=[2**40] * nl, grad_bytes=[2**40] * nl)
    huge = CostTable.from_lists(fwd=fwd, bwd=[2.0] * nl, param_bytes=[2**60] * nl, grad_bytes=[2**60] * nl)
    kw = dict(gpus=4, microbatches=8, round_size=4, staleness=1)
    for costs, memory, in_c in ((small, None, True), (small, 2**43, True), (small, float(2**43), False),
                                (huge, None, True), (huge, 2**63, False)):
        ev = Evaluator(costs, memory=memory, **kw)
        assert (native.cap_walks(LIB, ev, zeros, zeros, 1) is not None) == in_c, (memory, in_c)
    for budget in (2**63 + 2**61, 2.5 * 2**62):  # some plans of `huge` fit, some do not
        a = partition(huge, memory_budget=budget, **kw)
        monkeypatch.setenv(native.SWITCH, "0")
        b = partition(huge, memory_budget=budget, **kw)
        monkeypatch.delenv(native.SWITCH)
        assert (a.to_str(), a.report.iteration_time) == (b.to_str(), b.report.iteration_time)


def paper_models():
    with open(PAPER) as f:
        return json.load(f)


@needs_lib
@pytest.mark.parametrize("model", ["qwen3-1.7b", "gpt-oss-20b"])
def test_partition_is_the_same_with_and_without_the_kernel(monkeypatch, model):
    data = paper_models()[model]
    costs = CostTable.from_lists(**data["costs"])
    kw = dict(gpus=8, microbatches=16, round_size=16, staleness=1, memory_budget=data["memory_budget"])
    with_kernel = partition(costs, **kw)
    monkeypatch.setenv(native.SWITCH, "0")
    assert Evaluator(costs, gpus=8, microbatches=16, round_size=16, staleness=1, memory=None).lib is None
    without = partition(costs, **kw)
    assert with_kernel.to_str() == without.to_str()
    assert with_kernel.report.iteration_time == without.report.iteration_time


@pytest.mark.parametrize("seed", range(2))
def test_random_problems_plan_the_same_with_and_without_the_kernel(monkeypatch, seed):
    rng = random.Random(300 + seed)
    for _ in range(12):
        nl = rng.randint(8, 30)  # past the exhaustive search: the cap walk and the even family's batch
        costs = CostTable.from_lists(fwd=[rng.uniform(0.5, 1.5) for _ in range(nl)],
                                     bwd=[rng.uniform(1.0, 3.0) for _ in range(nl)])
        kw = dict(gpus=rng.choice([2, 4, 8]), microbatches=16, round_size=rng.choice([4, 8, 16]),
                  staleness=rng.choice([0, 1]))
        monkeypatch.delenv(native.SWITCH, raising=False)
        a = partition(costs, **kw)
        monkeypatch.setenv(native.SWITCH, "0")
        b = partition(costs, **kw)
        assert (a.to_str(), a.report.iteration_time) == (b.to_str(), b.report.iteration_time), kw


def test_without_a_compiler_the_planner_times_in_python(monkeypatch, tmp_path):
    monkeypatch.setenv("RPCOMPILE_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert native.load() is None
    assert not any(tmp_path.rglob("*.so"))
    costs = CostTable.from_lists(fwd=[1e-3] * 8, bwd=[2e-3] * 8)
    assert partition(costs, gpus=4, microbatches=8, staleness=0).to_str() == '1,2,2,2|1|1,1,1,1,1,1,1'


@needs_lib
def test_the_kernel_is_built_once_per_cache_and_then_loaded(monkeypatch, tmp_path):
    monkeypatch.setenv("RPCOMPILE_CACHE", str(tmp_path))
    (tmp_path / "kernels").mkdir()  # the folder may exist already (the host optimizer's kernels live there too)
    assert native.load() is not None
    built = list(tmp_path.rglob("*.so"))
    assert len(built) == 1 and built[0].name.startswith("rpcompile_planner_")
    stamp = os.stat(built[0]).st_mtime_ns
    assert native.load() is not None
    seal = built[0].parent / (built[0].name + SEAL)  # its size and digest, checked before each load
    assert sorted(tmp_path.rglob("*")) == [built[0].parent, built[0], seal]  # no second build, no temporary left
    assert os.stat(built[0]).st_mtime_ns == stamp


@needs_lib
@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_a_damaged_kernel_is_built_again_before_a_process_maps_it(monkeypatch, tmp_path, how):
    """Half the file (a link stopped by a full disk: mapping it killed the process with SIGBUS) or as many
    garbage bytes (it failed to load, and was never built again): the next process builds it again and loads it,
    and the one after plans with it."""
    monkeypatch.setenv("RPCOMPILE_CACHE", str(tmp_path))
    path = native.LIBRARY.path()
    damaged_copy(LIB._name, path, how)  # a copy this process has not mapped
    assert exit_status(lambda: native.load() is not None) == 0
    assert intact(path)
    ev = Evaluator(CostTable.from_lists([1.0] * 4, [2.0] * 4), gpus=1, microbatches=2, round_size=2, staleness=0,
                   memory=None)
    assert ev.lib is not None and native.steady_times(ev.lib, ev, [((3,), 1, (3,)), ((1, 2), 1, (2, 1))]) == [30.0] * 2
