"""StagePlan: per-stage time and memory, t_max, the printed table."""
from rpcompile import CostTable, StagePlan
from rpcompile.passes import with_report


def test_stage_times_and_t_max():
    c = CostTable.from_lists(fwd=[1.0, 2.0, 3.0], bwd=[2.0, 4.0, 6.0])
    p = StagePlan.from_str("2|1|1,1")
    assert p.stage_times(c) == (3.0, 9.0, 6.0, 3.0)  # F sums fwd; FB and B sum fwd + bwd
    assert p.t_max(c) == 9.0 and p.num_stages == 4


def test_memory_model_by_hand():
    c = CostTable.from_lists([1, 1], [2, 2], param_bytes=[10, 20], grad_bytes=[10, 20])
    assert StagePlan.from_str("1|1|1").stage_memory(c, gpus=2) == (20, 50, 40)


def test_str_round_trip_and_table():
    p = StagePlan.from_str("2,2|1|3,1")
    assert p.to_str() == "2,2|1|3,1" and str(p) == "StagePlan(2,2|1|3,1)"
    c = CostTable.from_lists([1e-3] * 5, [2e-3] * 5)
    e = with_report(p, c, gpus=2, microbatches=2)
    assert e == p and "share of t_max" in str(e) and "bubble" in str(e)


def test_stage_memory_without_gpus_prefetches_the_largest_other_stage():
    # gpus=None bounds the prefetched stage by the largest other stage's parameters; with gpus=g it is
    # stage (i + g) mod S: the two differ in that term only, so each is checked against the other
    import random
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(3, 12)
        fwd = [rng.randint(1, n - 1)]
        while sum(fwd) < n - 1:
            fwd.append(rng.randint(1, n - 1 - sum(fwd)))
        bwd = [1] * (n - 1)
        plan = StagePlan.from_sizes(fwd, 1, bwd)
        pb = [rng.choice([0, 5, 10**6, rng.randint(1, 10**9)]) for _ in range(n)]
        c = CostTable.from_lists([1.0] * n, [2.0] * n, param_bytes=pb, grad_bytes=pb,
                                 act_bytes=[rng.randint(0, 99) for _ in range(n)],
                                 saved_bytes=[rng.randint(0, 99) for _ in range(n)])
        own = [sum(pb[i] for i in s.layers) for s in plan.stages]
        g = rng.randint(1, 2 * len(own))
        bound, at = plan.stage_memory(c), plan.stage_memory(c, gpus=g)
        for i in range(len(own)):
            other = max(own[j] for j in range(len(own)) if j != i)
            assert bound[i] == at[i] - own[(i + g) % len(own)] + other, (plan.to_str(), pb, i)
