"""The exact RoundPipe timing recurrence, checked by hand and against closed forms."""
import pytest

from rpcompile import CostTable, StagePlan
from rpcompile.passes.partition.timing import (bubble_ratio, default_round_size, iteration_time,
                                      steady_state_window)


def uniform(layers, fwd=1.0, bwd=2.0):
    return CostTable.from_lists(fwd=[fwd] * layers, bwd=[bwd] * layers)


def test_single_worker_is_the_sum_of_all_work():
    # F: 3 layers x 1; FB: 1 x 3; B: 3 x (1 + 2); two microbatches, one worker.
    c = uniform(4)
    assert iteration_time(StagePlan.from_str("3|1|3"), c, gpus=1, microbatches=2) == 2 * (3 + 3 + 9)


def test_two_workers_by_hand():
    # Stages F(1 layer) FB(1) B(1); f=1, b=2 per layer. R=2 microbatches, slots on w0, w1, w0.
    # F  on w0: m0 [0,1]  m1 [1,2]
    # FB on w1: m0 [1,4]  m1 [4,7]
    # B  on w0: recompute m0 [2,3], backward waits for FB m0 (4) -> [4,6]; m1: recompute [6,7], backward [7,9]
    c = uniform(2)
    assert iteration_time(StagePlan.from_str("1|1|1"), c, gpus=2, microbatches=2) == 9.0


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_uniform_stages_give_the_closed_form_bubble(n, k):
    # Every stage takes 3: F = 3 layers of fwd 1; FB = 1 layer of 1+2; B = 1 layer of 1+2.
    # With R = N and as many forward stages + fused as workers, no recompute can start early,
    # so the bubble is exactly N(N-1) / (M*S + N(N-1)).
    plan = StagePlan.from_str("3,3|1|1,1,1,1,1,1")
    c = uniform(7)
    m, s = k * n, plan.num_stages
    t = iteration_time(plan, c, gpus=n, microbatches=m)
    assert t == pytest.approx((m * s + n * (n - 1)) * 3 / n, abs=1e-9)
    assert bubble_ratio(plan, c, gpus=n, microbatches=m) == pytest.approx(n * (n - 1) / (m * s + n * (n - 1)),
                                                                          abs=1e-9)


def test_early_recompute_beats_the_closed_form():
    # With more workers than leading stages, backward stages recompute before their gradient arrives.
    plan, c = StagePlan.from_str("3,3|1|1,1,1,1,1,1"), uniform(7)
    assert iteration_time(plan, c, gpus=5, microbatches=5) < (5 * 9 + 20) * 3 / 5


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_staleness_one_steady_state_has_no_bubble_for_uniform_stages(n):
    plan, c = StagePlan.from_str("3,3|1|1,1,1,1,1,1"), uniform(7)
    assert iteration_time(plan, c, gpus=n, microbatches=16, staleness=1) == pytest.approx(16 * 27 / n)


def test_uneven_forward_grouping_is_slower_even_with_equal_closed_form():
    # 28 equal layers plus a heavier LM head: 9,9,9,1 and 7,7,7,7 have the same t_max-based closed
    # form (t_max = 9 either way), yet the uneven fill and drain cost time.
    fwd = [1.0] * 28 + [3.0]
    c = CostTable.from_lists(fwd=fwd, bwd=[2 * x for x in fwd])
    bwd = "3,3,3,3,3,3,3,3,2,2"
    even = iteration_time(StagePlan.from_str("7,7,7,7|1|" + bwd), c, gpus=8, microbatches=16)
    uneven = iteration_time(StagePlan.from_str("9,9,9,1|1|" + bwd), c, gpus=8, microbatches=16)
    assert uneven > 1.05 * even  # about 6% (the example)


def test_round_size_and_window():
    assert default_round_size(4, 12) == 4
    assert default_round_size(4, 10) == 5
    assert default_round_size(4, 7) == 7
    assert steady_state_window(8, 3, 1) == (24, 8)
    assert steady_state_window(8, 8, 2) == (4, 1)


def test_rejects_mismatched_costs():
    with pytest.raises(ValueError, match="layers"):
        iteration_time(StagePlan.from_str("1|1|1"), uniform(3), gpus=1, microbatches=1)
