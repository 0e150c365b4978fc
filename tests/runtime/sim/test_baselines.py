"""Bound-stage baselines (GPipe, 1F1B, interleaved 1F1B, looped BFS) as Programs in the same simulator."""
import pytest

from rpcompile import CostTable
from rpcompile.ir.program import COMPUTE_OPS, Op
from rpcompile.runtime import simulate
from rpcompile.runtime.sim.baselines import (baselines, bound_plan, gpipe, interleaved_1f1b, looped_bfs,
                                         one_f_one_b)

INF = float("inf")


class HW:
    """Stand-in hardware: only the attributes simulate reads."""

    def __init__(self, h2d=INF, d2h=INF, opt=INF, latency=0.0, mem=None):
        self.h2d_bandwidth, self.d2h_bandwidth, self.optimizer_bytes_per_s = h2d, d2h, opt
        self.link_latency = latency
        if mem is not None:
            self.mem_bandwidth = mem


FREE = HW()


def uniform(layers, fwd=1.0, bwd=2.0, **kw):
    return CostTable.from_lists(fwd=[fwd] * layers, bwd=[bwd] * layers, **kw)


ALL = [("gpipe", gpipe, {}), ("1f1b", one_f_one_b, {}), ("interleaved", interleaved_1f1b, {"chunks": 2}),
       ("bfs", looped_bfs, {"chunks": 2})]


def test_layers_split_evenly_with_the_head_on_the_last_stage():
    plan = bound_plan(uniform(33), 8)
    assert plan.to_str() == "4,4,4,4,4,4,4|5|4,4,4,4,4,4,4"
    assert bound_plan(uniform(10), 4).to_str() == "3,2,2|3|2,2,3"
    with pytest.raises(ValueError, match="decoder layers"):
        bound_plan(uniform(4), 4)


@pytest.mark.parametrize("name,fn,kw", ALL)
@pytest.mark.parametrize("n,m", [(1, 3), (2, 4), (4, 8), (3, 6)])
def test_structure_and_single_gpu_time(name, fn, kw, n, m):
    c = uniform(17)
    p = fn(c, gpus=n, microbatches=m, **kw)
    v = kw.get("chunks", 1)
    groups = n * v
    comp = [i for i in p.instrs if i.op in COMPUTE_OPS]
    assert len(comp) == 3 * m * groups                                  # F, R, B per group and microbatch
    assert not any(i.op is Op.PARAM_UP for i in p.instrs)               # parameters stay resident
    assert sorted(i.layer for i in p.instrs if i.op is Op.STEP) == list(range(17))
    for i in comp:  # group g (forward stage g / backward stage 2G-2-g) lives on GPU g mod N
        g = i.stage if i.op is Op.FORWARD or i.stage == groups - 1 else 2 * (groups - 1) - i.stage
        assert i.worker == g % n
    ups = [i for i in p.instrs if i.op is Op.ACT_UP]
    assert len(ups) == (0 if n == 1 else 2 * m * (groups - 1))          # a D + U per cross-GPU edge
    t = simulate(p, c, FREE)
    if n == 1:
        assert t.makespan == pytest.approx(m * 17 * (1 + 1 + 2))
    assert t.makespan >= m * 17 * 4 / n


def test_two_gpus_by_hand():
    # groups [0] and [1, head]; the head costs nothing, so both stages take F 1, R 1, B 2.
    # w0: F0 [0,1] F1 [1,2] R0 [2,3] ... B0 waits for w1's gradient of m0 (t=6) ... B1 ends at 11.
    c = CostTable.from_lists(fwd=[1.0, 1.0, 0.0], bwd=[2.0, 2.0, 0.0])
    assert simulate(gpipe(c, gpus=2, microbatches=2), c, FREE).makespan == 11.0
    assert simulate(one_f_one_b(c, gpus=2, microbatches=2), c, FREE).makespan == 11.0


def test_interleaving_shrinks_the_bubble():
    c = uniform(17)
    b = {k: simulate(p, c, FREE).bubble_ratio for k, p in baselines(c, gpus=4, microbatches=8).items()}
    assert b["interleaved 1F1B (V=2)"] < b["1F1B"] and b["looped BFS (V=2)"] < b["GPipe"]
    assert all(0 < x < 0.5 for x in b.values())
    with pytest.raises(ValueError, match="divisible"):
        interleaved_1f1b(c, gpus=4, microbatches=6)


def test_memory_shows_resident_state_and_in_flight_activations():
    c = uniform(9, param_bytes=[1000] * 9, grad_bytes=[1000] * 9, act_bytes=[10**5] * 9,
                saved_bytes=[10**5] * 9, peak_bytes=[10**6] * 9)
    g = simulate(gpipe(c, gpus=4, microbatches=8), c, FREE)
    f = simulate(one_f_one_b(c, gpus=4, microbatches=8), c, FREE)
    state = 2 * (1000 + 1000 + 6 * 1000)  # two layers on GPU 0: params, grads, fp32 master + Adam moments
    assert g.peak_memory[0] >= state + 8 * 10**5   # GPipe keeps all 8 microbatches' inputs
    assert f.peak_memory[0] < g.peak_memory[0]     # 1F1B keeps at most N in flight
    assert f.peak_memory[0] >= state + 4 * 10**5


def test_real_transfers_and_the_gpu_optimizer_cost_time():
    c = uniform(9, fwd=1e-3, bwd=2e-3, param_bytes=[4 * 10**8] * 9, grad_bytes=[4 * 10**8] * 9, act_bytes=[10**8] * 9)
    p = one_f_one_b(c, gpus=4, microbatches=8)
    free = simulate(p, c, FREE)
    real = simulate(p, c, HW(h2d=32e9, d2h=32e9, opt=20e9, latency=1e-5, mem=1e12))
    assert real.makespan > free.makespan and real.exposed_comm > 0
    steps = [r for r in real.records if r.op == "O"]
    assert steps and all(r.worker >= 0 and r.end > r.start for r in steps)  # Adam on the GPU, memory-bound
    three = simulate(p, c, FREE, iterations=3)  # synchronous: the next iteration waits for the update
    assert three.steady_iteration_time == pytest.approx(free.makespan)
