"""StagePlan: per-stage time and memory (term by term, by hand), t_max, the printed table."""
import pytest

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


# -- stage_memory, term by term --------------------------------------------------------------------------
# distinct values per layer and column (primes), so a term counted twice or in the wrong place shows
P, G, A, SV, PK = ([11, 13, 17, 19, 101], [23, 29, 31, 37, 103], [41, 43, 47, 53, 107], [59, 61, 67, 71, 109],
                   [73, 79, 83, 89, 113])

COLUMNS = {"param_bytes": P, "grad_bytes": G, "act_bytes": A, "saved_bytes": SV, "peak_bytes": PK}

# The documented model (StagePlan.stage_memory's Note), counted by hand: per plan, the number of layers,
# each stage's own parameters and every other column's bytes per stage (slot order).
HAND = {
    # s0 F[0], s1 F[1,2], s2 FB[3], s3 B[2], s4 B[0,1]; the backward cut at layer 2 lies inside s1
    "1,2|1|1,2": (4, [P[0], P[1] + P[2], P[3], P[2], P[0] + P[1]], {
        "grad_bytes": [0, 0, G[3], G[2], G[0] + G[1]],  # FB/B only
        "peak_bytes": [0, 0, PK[3], PK[2], PK[0] + PK[1]],  # FB/B only: the whole stage's workspace
        # s0: the batch (current + next); s1: the saved input of the cut at 2; s3, s4: their saved inputs
        "saved_bytes": [2 * SV[0], SV[2], 0, 2 * SV[2], 2 * SV[0]],
        # s0 output; s1 2 inputs + output; s2 2 inputs + output + outgoing gradient;
        # s3 output + outgoing + incoming gradient; s4 output + incoming gradient (none leaves layer 0)
        "act_bytes": [A[0], 2 * A[0] + A[2], 2 * A[2] + A[3] + A[2], A[2] + A[1] + A[2], A[1] + A[1]],
    }),
    # s0 F[0,1], s1 F[2,3], s2 FB[4], s3 B[2,3], s4 B[0,1]; s1 starts at the cut: its input is the
    # activation a1, it holds no saved input of its own
    "2,2|1|2,2": (5, [P[0] + P[1], P[2] + P[3], P[4], P[2] + P[3], P[0] + P[1]], {
        "grad_bytes": [0, 0, G[4], G[2] + G[3], G[0] + G[1]],
        "peak_bytes": [0, 0, PK[4], PK[2] + PK[3], PK[0] + PK[1]],
        "saved_bytes": [2 * SV[0], 0, 0, 2 * SV[2], 2 * SV[0]],
        "act_bytes": [A[1], 2 * A[1] + A[3], 2 * A[3] + A[4] + A[3], A[3] + A[1] + A[3], A[1] + A[1]],
    }),
}


def _table(n: int, only: str | None = None) -> CostTable:
    cols = {k: (v[:n] if only in (None, k) else [0] * n) for k, v in COLUMNS.items()}
    return CostTable.from_lists(fwd=[1.0] * n, bwd=[2.0] * n, **cols)


@pytest.mark.parametrize("gpus", [None, 1, 2, 3, 5])
@pytest.mark.parametrize("plan_str", list(HAND))
def test_stage_memory_term_by_term(plan_str, gpus):
    plan = StagePlan.from_str(plan_str)
    assert [s.kind.value for s in plan.stages] == ["F", "F", "FB", "B", "B"]
    n, own, cols = HAND[plan_str]
    if gpus is None:  # a bound: the largest other stage's parameters
        nxt = [max(o for j, o in enumerate(own) if j != i) for i in range(5)]
    else:  # the stage N slots later in the rotation, prefetched
        nxt = [own[(i + gpus) % 5] for i in range(5)]
    hand = {"param_bytes": [own[i] + nxt[i] for i in range(5)], **cols}
    for column, want in hand.items():
        assert list(plan.stage_memory(_table(n, column), gpus=gpus)) == want, column
    total = [sum(col[i] for col in hand.values()) for i in range(5)]
    assert list(plan.stage_memory(_table(n), gpus=gpus)) == total


def test_stage_memory_single_fused_stage_by_hand():
    c = CostTable.from_lists(fwd=[1.0] * 2, bwd=[1.0] * 2, param_bytes=[3, 5], grad_bytes=[7, 11],
                             act_bytes=[13, 17], saved_bytes=[19, 23], peak_bytes=[29, 31])
    # FB[0,1]: params 3+5, prefetched itself (one stage) 3+5, batch 2*19, output 17, grads 7+11, peaks 29+31
    assert StagePlan.from_str("|2|").stage_memory(c, gpus=1) == (8 + 8 + 2 * 19 + 17 + 18 + 60,)
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
