"""The planner's C kernel (`native.py`: shape.c, steady.c, exact.c, layouts.c) gives the floats of the Python recurrences bit for bit: the exact
`timing.shape_time` and the fast `steady.steady_time`, one plan or a batch, with and without a cutoff; so
`partition` returns the same plan, report and float with or without it. Without a C compiler, or with
RPCOMPILE_PLANNER_KERNEL=0, it is not used and nothing else changes.
"""
import json
import math
import os
import random

import pytest

from rpcompile import CostTable
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


@needs_lib
@pytest.mark.parametrize("seed", range(3))
def test_the_cap_walk_layouts_equal_the_python_ones(seed):
    rng = random.Random(900 + seed)
    for _ in range(150):
        n = rng.randint(1, 40)
        layer = rng.choice([1.0, 0.1, rng.uniform(0.1, 2.0)])  # equal layers: contiguous sums that tie
        times = [rng.choice([layer, layer, 0.0, rng.uniform(0.0, 3.0)]) for _ in range(n + rng.randint(0, 3))]
        p = [0.0]
        for t in times:
            p.append(p[-1] + t)
        side = native.Layouts(LIB, p, n, cap_walk._EXTRA)
        rp = [p[n] - x for x in reversed(p[:n + 1])]
        i, j = sorted(rng.sample(range(n + 1), 2)) if n > 1 else (0, 1)
        for cap in (p[j] - p[i], (p[j] - p[i]) * (1 + 1e-12), (p[j] - p[i]) * (1 - 1e-12), max(times[:n]),
                    rng.uniform(0.0, p[n] + 1.0)):
            k0 = cap_walk._fewest(p, n, cap)
            assert side.fewest(cap) == k0, (p, n, cap)
            want = []
            for k in range(k0, min(n, k0 + cap_walk._EXTRA) + 1):
                right = cap_walk._greedy(rp, n, cap, k)
                want += [cap_walk._even(p, n, cap, k), cap_walk._greedy(p, n, cap, k), right and right[::-1]]
            assert side(cap) == (k0, want), (p, n, cap)


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
    assert list(tmp_path.rglob("*")) == [built[0].parent, built[0]]  # no second build, no temporary left
    assert os.stat(built[0]).st_mtime_ns == stamp
