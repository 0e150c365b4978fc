"""host_lean (compile's host fallback): the backward stages as wide as a worker holds, the forward stages cut to
no more parameters than those, a plan that fits the device and keeps fewer saved inputs on the host; compile
takes it where the partitioner's fastest plan is over the host memory, and it trains as eager PyTorch."""
import random

import pytest
import torch

from oracle import reference_train
from rpcompile import AdamW
from rpcompile.ir.costs import CostTable
from rpcompile.ir.hardware import Hardware
from rpcompile.ir.plan import StagePlan
from rpcompile.models.zoo import LlamaConfig, TinyLlama
from rpcompile.options import options
from rpcompile import pipeline
from rpcompile.passes import emit
from rpcompile.passes.cost.host_bytes import round_saved_bytes
from rpcompile.passes.partition import partition
from rpcompile.passes.partition.host_lean import _split, host_lean, widest_backward
from rpcompile.runtime.executor import Runtime
from rpcompile.runtime.host.assign import assign_buffers
from rpcompile.runtime.host.optimizer import HostState
from rpcompile.runtime.stage.batch import split_batch


def random_costs(rng: random.Random, n: int) -> CostTable:
    return CostTable.from_lists(
        fwd=[rng.uniform(1, 3) for _ in range(n)], bwd=[rng.uniform(2, 6) for _ in range(n)],
        param_bytes=[rng.randrange(10, 100) for _ in range(n)], grad_bytes=[rng.randrange(0, 100) for _ in range(n)],
        peak_bytes=[rng.randrange(10, 200) for _ in range(n)], saved_bytes=[rng.randrange(5, 50) for _ in range(n)],
        act_bytes=[rng.randrange(5, 50) for _ in range(n)])


def window_bytes(c: CostTable, lo: int, hi: int, fetch: int) -> int:
    """A backward window's bytes, term by term (the module doc's list)."""
    own = sum(c.param_bytes[i] + c.grad_bytes[i] + c.peak_bytes[i] for i in range(lo, hi + 1))
    grad_down = c.act_bytes[lo - 1] if lo > 0 else 0
    return own + fetch + 2 * c.saved_bytes[lo] + 2 * c.act_bytes[hi] + grad_down


@pytest.mark.parametrize("seed", range(30))
def test_each_window_fits_and_the_next_layer_down_would_not(seed) -> None:
    rng = random.Random(seed)
    n = rng.randrange(1, 12)
    c, fetch = random_costs(rng, n + 1), rng.randrange(0, 100)
    cap = rng.randrange(200, 1500)
    sizes = widest_backward(c, cap, n, fetch)
    assert sum(sizes) == n and all(s >= 1 for s in sizes)
    hi = n - 1
    for s in sizes:  # execution order: from the top layer down
        lo = hi - s + 1
        assert s == 1 or window_bytes(c, lo, hi, fetch) <= cap, (sizes, lo, hi)
        assert lo == 0 or window_bytes(c, lo - 1, hi, fetch) > cap, (sizes, lo, hi)
        hi = lo - 1
    assert widest_backward(c, None, n, fetch) == [n]  # no device limit: one backward stage


@pytest.mark.parametrize("seed", range(40))
def test_the_lean_plan_fits_the_device_and_keeps_fewer_saved_inputs(seed) -> None:
    rng = random.Random(seed)
    n, gpus = rng.randrange(3, 14), rng.randrange(1, 5)
    c = random_costs(rng, n)
    budget = rng.randrange(400, 2000)
    try:
        plan = partition(c, gpus=gpus, microbatches=2 * gpus, memory_budget=budget)
    except ValueError:  # no plan fits this budget
        return
    lean = host_lean(plan, c, gpus=gpus, memory_budget=budget)
    # where the windows grown with the largest layer's parameters prefetched fit (the forward stages cut to the
    # widest of them), they are the plan
    first = widest_backward(c, budget, sum(len(r) for r in plan.bwd), max(c.param_bytes))
    widest = max([max(c.param_bytes), *(sum(c.param_bytes[i] for i in r) for r in StagePlan.from_sizes(
        [len(r) for r in plan.fwd], len(plan.fused), first).bwd)])
    cand = StagePlan.from_sizes(_split(c, plan.fwd, widest), len(plan.fused), first)
    if len(first) < len(plan.bwd) and max(cand.stage_memory(c, gpus=gpus)) <= budget:
        assert lean == cand, (plan.to_str(), lean, cand.to_str())
    if lean is None:
        return
    assert lean.fused == plan.fused
    assert max(lean.stage_memory(c, gpus=gpus)) <= budget, (plan.to_str(), lean.to_str())
    assert len(lean.bwd) < len(plan.bwd)
    saved = list(c.saved_bytes)
    assert round_saved_bytes(saved, lean, gpus, 2 * gpus)[0] <= round_saved_bytes(saved, plan, gpus, 2 * gpus)[0]
    # the forward stages are the partitioner's, some cut in parts (fewer parameters to prefetch)
    assert {r.start for r in plan.fwd} <= {r.start for r in lean.fwd}


def test_no_lean_plan_where_the_backward_stages_are_already_the_widest() -> None:
    c = CostTable.from_lists([1.0] * 5, [2.0] * 5, param_bytes=[10] * 5, grad_bytes=[10] * 5,
                             saved_bytes=[4] * 5, act_bytes=[4] * 5)
    # a backward window of three layers needs 3 x 20 + 10 prefetched + 2 x 4 + 2 x 4 + 4 = 90 bytes
    assert host_lean(StagePlan.from_str("2,2|1|2,2"), c, gpus=2, memory_budget=90) is None  # 3,1: as many
    assert host_lean(StagePlan.from_str("1,1,1,1|1|1,1,1,1"), c, gpus=2, memory_budget=90).to_str() == "1,1,1,1|1|3,1"
    assert host_lean(StagePlan.from_str("1,1,1,1|1|1,1,1,1"), c, gpus=2, memory_budget=89).to_str() == "1,1,1,1|1|2,2"
    # a budget no window of two fits (the lowest needs 2 x 20 + 10 + 2 x 4 + 2 x 4 = 66): nothing to widen
    assert host_lean(StagePlan.from_str("1,1,1,1|1|1,1,1,1"), c, gpus=2, memory_budget=65) is None


def test_where_the_first_windows_do_not_fit_the_prefetch_bounds_the_second() -> None:
    # the windows grown with the largest layer's parameters prefetched (6, 4) overflow a worker whose next stage
    # is a wide window; bounded by the largest stage's parameters they come out 5, 5, which fit
    rng = random.Random(20)  # case 20 of the random test above, pinned: 13 layers, 2 workers, 1,541 bytes
    assert (rng.randrange(3, 14), rng.randrange(1, 5)) == (13, 2)
    c = random_costs(rng, 13)
    plan = StagePlan.from_str("10|3|4,3,3")
    first = StagePlan.from_sizes([10], 3, widest_backward(c, 1541, 10, max(c.param_bytes)))
    assert first.to_str() == "10|3|6,4" and max(first.stage_memory(c, gpus=2)) > 1541
    lean = host_lean(plan, c, gpus=2, memory_budget=1541)
    assert lean.to_str() == "5,5|3|5,5" and max(lean.stage_memory(c, gpus=2)) <= 1541


def test_forward_stages_are_cut_into_the_fewest_parts_under_the_cap() -> None:
    c = CostTable.from_lists([1.0] * 6, [2.0] * 6, param_bytes=[10, 10, 10, 10, 50, 10])
    fwd = (range(0, 4), range(4, 6))
    assert _split(c, fwd, 20) == [2, 2, 1, 1]  # exactly the cap fits; a layer over it is a stage alone
    assert _split(c, fwd, 30) == [3, 1, 1, 1]
    assert _split(c, fwd, 60) == [4, 2]  # the partitioner's stages are never merged


CFG = LlamaConfig(vocab=64, dim=32, layers=6, heads=4, kv_heads=2, ffn=64, max_seq=32)
OPT = AdamW(lr=1e-2, eps=1e-4, impl="foreach")


def lm_batch(seed: int) -> dict:
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def test_over_the_host_compile_takes_the_lean_plan_and_it_trains_as_eager(monkeypatch) -> None:
    # TinyLlama in 6 blocks, 500,000-byte workers, 2 microbatches (one round size; predicted costs on the cpu
    # preset): the partitioner's fastest plan keeps 6 backward stages, the lean one fewer; with a host between their needs compile takes
    # the lean plan (its report says why) instead of refusing the run, and it trains as eager PyTorch does
    roomy = Hardware.preset("cpu").replace(host_memory=2**34)
    kw = dict(gpus=2, microbatches=2, memory_budget=500_000, backend="host", optimizer=OPT)
    torch.manual_seed(0)
    model = TinyLlama(CFG)

    def passes(host: int):
        return pipeline.compile_passes(model, lm_batch(0), options(hardware=roomy.replace(host_memory=host), **kw),
                                       mode="predict")
    graph, costs, fast, program, m, _, _, asg = passes(2**34)
    opts = options(hardware=roomy, **kw)
    lean = host_lean(fast, costs, gpus=2, memory_budget=pipeline._budget(opts))
    assert lean is not None and len(lean.bwd) < len(fast.bwd), (fast.to_str(), lean)
    lean_program = emit(lean, gpus=2, microbatches=2, round_size=program.round_size, staleness=1, costs=costs)
    need_fast = pipeline.host_need(graph, costs, fast, opts, program, asg).total
    need_lean = pipeline.host_need(graph, costs, lean, opts, lean_program,
                                   assign_buffers(graph, lean_program, opts.dtype)).total
    assert need_lean < need_fast
    host = (need_lean + need_fast) // 2
    graph, costs, plan, program, *_ = passes(host)
    assert plan == lean and "host-lean plan" in str(plan), str(plan)
    with pytest.raises(ValueError, match="host memory: the run needs"):  # the fallback is what admits it
        monkeypatch.setattr(pipeline, "host_lean", lambda *a, **k: None)
        passes(host)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="host memory: the run needs"):  # and below the lean plan's need: refused
        passes(need_lean - 1)

    batches = [lm_batch(s) for s in range(3)]
    want, ref = reference_train(model, batches, optimizer=OPT, staleness=1,
                                loss_fn=lambda mod, b: sum(mod(**p) for p in split_batch(graph, b, 2)) / 2)
    state = HostState.from_graph(graph, optimizer=OPT)
    with Runtime(graph, program, state, backend="host", timeout=60) as rt:
        got = [rt.step(b) for b in batches]
        rt.flush()
    assert got == pytest.approx(want, rel=1e-5)
    for name, p in state.parameters_fp32().items():
        assert torch.allclose(p, ref[name].float(), rtol=1e-5, atol=1e-6), name
