"""partition: coverage, memory feasibility, bad input, LM-head sharding (its guarantees: test_partition_guarantees)."""
import math
import random

import pytest

from rpcompile import CostTable, StagePlan
from rpcompile.passes import partition
from rpcompile.passes.partition.timing import iteration_time


def check_cover(plan, nl):
    assert plan.num_layers == nl
    fwd = [l for r in plan.fwd for l in r] + list(plan.fused)
    bwd = list(reversed(plan.fused)) + [l for r in plan.bwd for l in reversed(r)]
    assert fwd == list(range(nl)) and bwd == list(range(nl - 1, -1, -1))


def test_memory_budget_is_respected_and_costs_time():
    nl = 12
    costs = CostTable.from_lists(fwd=[1.0] * nl, bwd=[2.0] * nl, param_bytes=[100] * nl,
                                 grad_bytes=[100] * nl, peak_bytes=[50] * nl, act_bytes=[10] * nl,
                                 saved_bytes=[10] * nl)
    kw = dict(gpus=4, microbatches=8, staleness=0)
    free = partition(costs, **kw)
    budget = 420
    tight = partition(costs, memory_budget=budget, **kw)
    assert max(tight.stage_memory(costs, gpus=4)) <= budget < max(free.stage_memory(costs, gpus=4))
    check_cover(tight, nl)
    assert tight.report.iteration_time >= free.report.iteration_time


def test_layer_larger_than_budget_is_named():
    costs = CostTable.from_lists(fwd=[1.0] * 3, bwd=[2.0] * 3, param_bytes=[10, 5000, 10],
                                 names=["embed", "huge", "head"])
    with pytest.raises(ValueError, match=r"'huge'.*5000.*budget.*1000"):
        partition(costs, gpus=2, microbatches=2, memory_budget=1000)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_costs_name_the_layer(bad):
    with pytest.raises(ValueError, match="'mlp3'"):
        CostTable.from_lists(fwd=[1.0, bad], bwd=[1.0, 1.0], names=["embed", "mlp3"])


def test_print_shows_the_table():
    costs = CostTable.from_lists(fwd=[1e-3] * 6, bwd=[2e-3] * 6)
    text = str(partition(costs, gpus=2, microbatches=4))
    assert "share of t_max" in text and "iteration" in text and "bubble" in text and "FB" in text


def realistic(layers, head=3.0, seed=0):
    rng = random.Random(seed)
    fwd = [1e-5] + [1e-3 * rng.uniform(0.9, 1.1) for _ in range(layers)] + [head * 1e-3]
    return fwd, [2 * x for x in fwd]


def test_sharded_lm_head_is_at_least_five_percent_faster():
    # With the whole head as one layer the best plan found is 0.2985 s, sharded 0.2777 s (7% faster): the
    # head sets t_max either way, the shards let the backward stages balance around it. (This was 10% when
    # the search still missed the even plans of the unsharded table.)
    kw = dict(gpus=8, microbatches=16, staleness=0)
    fwd, bwd = realistic(28)
    whole = CostTable.from_lists(fwd=fwd, bwd=bwd)
    t_whole = partition(whole, **kw).report.iteration_time
    best_sharded = math.inf
    for k in (2, 3, 4, 6):
        sf = fwd[:-1] + [3e-3 / k] * k + [1e-5]
        sharded = CostTable.from_lists(fwd=sf, bwd=[2 * x for x in sf])
        best_sharded = min(best_sharded, partition(sharded, **kw).report.iteration_time)
    assert best_sharded <= 0.95 * t_whole, (best_sharded, t_whole)


def test_beats_the_closed_form_trap():
    # 28 equal layers plus a heavier LM head: 9,9,9,1 is slower than 7,7,7,7 (see test_timing).
    fwd = [1.0] * 28 + [3.0]
    c = CostTable.from_lists(fwd=fwd, bwd=[2 * x for x in fwd])
    kw = dict(gpus=8, microbatches=16, staleness=0)
    plan = partition(c, **kw)
    trap = StagePlan.from_str("9,9,9,1|1|3,3,3,3,3,3,3,3,2,2")
    assert plan.report.iteration_time < iteration_time(trap, c, **kw)
