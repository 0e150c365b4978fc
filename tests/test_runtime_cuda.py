"""The CUDA backend (streams, events, pinned buffers, the stream-aware pool). Skipped without CUDA.

Run by `bash bench/gpu.sh` on a machine with a GPU. Several workers share one
GPU here: each has its own five streams, so the multi-worker protocol runs on
real streams even with one device.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
import rpcompile  # noqa: E402
from rpcompile import AdamW, CostTable, StagePlan  # noqa: E402
from rpcompile.passes import emit, trace  # noqa: E402
from rpcompile.ir.program import Op  # noqa: E402
from rpcompile.runtime.executor import Runtime, RuntimeFailure  # noqa: E402
from rpcompile.runtime.optimizer import HostState  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
OPT = AdamW(lr=1e-2, eps=1e-4, impl="foreach")
PLAN = "2,2|1|1,3"


def _program(graph, gpus: int, mbs: int, staleness: int, plan: str = PLAN):
    """P/G chunks cut from the real parameter bytes, so transfers are multi-chunk."""
    pb = [sum(graph.params[p].bytes for p in lay.params) for lay in graph.layers]
    costs = CostTable.from_lists(fwd=[1e-3] * len(pb), bwd=[2e-3] * len(pb), param_bytes=pb, grad_bytes=pb)
    return emit(StagePlan.from_str(plan), gpus=gpus, microbatches=mbs, staleness=staleness, costs=costs)


def _train(graph, backend: str, gpus: int, mbs: int, staleness: int, batches, **kw):
    state = HostState.from_graph(graph, optimizer=OPT, pin_memory=backend == "cuda")
    with Runtime(graph, _program(graph, gpus, mbs, staleness), state, backend=backend, timeout=60, **kw) as rt:
        losses = [rt.step(b) for b in batches]
        rt.flush()
        stats = rt.stats()
    return losses, state.parameters_fp32(), stats


@pytest.mark.parametrize("gpus,mbs,staleness", [(1, 4, 0), (2, 4, 1), (4, 8, 1)])
def test_cuda_matches_host(gpus, mbs, staleness):
    """1, 2 and 4 workers on one GPU, multi-chunk transfers: CUDA equals the host backend within 1e-4."""
    graph = trace(models.llama(), models.lm_batch(batch=4, seq=8))
    assert any(sum(1 for c in _program(graph, gpus, mbs, staleness).chunks if c.stage == s) > 1 for s in range(5))
    batches = [models.lm_batch(batch=mbs, seq=8, seed=s) for s in range(3)]
    lc, pc, stats = _train(graph, "cuda", gpus, mbs, staleness, batches)
    lh, ph, _ = _train(graph, "host", gpus, mbs, staleness, batches)
    assert lc == pytest.approx(lh, rel=1e-4)
    for n in ph:
        assert torch.allclose(pc[n], ph[n], rtol=1e-4, atol=1e-5), n
    assert stats["bytes_to_device"] > 0 and stats["bytes_to_host"] > 0
    assert stats["host_waits"] < len(_program(graph, gpus, mbs, staleness).instrs) / 4


def test_cuda_poison_and_delays_bit_identical():
    """Poisoned pool buffers and random issue delays change nothing: the same bits in every run."""
    graph = trace(models.llama(), models.lm_batch(batch=4, seq=8))
    batches = [models.lm_batch(batch=8, seq=8, seed=s) for s in range(2)]
    runs = [_train(graph, "cuda", 3, 8, 1, batches, lane_delay=k, poison=k > 0)[1] for k in range(3)]
    assert all(torch.equal(runs[0][n], r[n]) and torch.isfinite(r[n]).all() for r in runs[1:] for n in r)


def test_compile_bf16_with_dropout_end_to_end_and_evaluate():
    """compile() on CUDA in bf16 with attention dropout: trains, reproducible, evaluate matches the loss scale."""
    batch = models.lm_batch(batch=8, seq=16)

    def run():
        with rpcompile.compile(models.llama(attention_dropout=0.2), gpus=2, example=batch, microbatches=4,
                               dtype=torch.bfloat16, optimizer=AdamW(lr=3e-3), seed=5) as c:
            losses = [c.step(batch) for _ in range(8)]
            ev = c.evaluate(batch)
            return losses, ev, c.stats()
    l1, ev1, stats = run()
    l2, ev2, _ = run()
    assert l1 == l2 and ev1 == ev2  # per-worker generators, seeded per (iteration, microbatch, layer)
    assert all(torch.isfinite(torch.tensor(l1))) and l1[-1] < l1[0]
    assert 0 < ev1 < l1[0] * 1.5
    assert stats["device_allocations"] == 0 and stats["host_allocations"] == 0


class _MLP(torch.nn.Module):
    """Equal layers, so the pool's flat slots (sized by the largest stage) are every stage's size."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                                          for _ in range(depth))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return torch.nn.functional.mse_loss(x, y)


def test_cuda_peak_memory_within_the_plan_prediction():
    """max_memory_allocated of one worker stays within the plan's predicted per-stage peak + 15%."""
    from rpcompile.passes.cost import estimate_costs
    torch.manual_seed(0)
    batch = (torch.randn(256, 1024), torch.randn(256, 1024))
    graph = trace(_MLP(1024, 8), batch)
    plan = StagePlan.from_str("2,2,2|2|2,2,2")
    costs = estimate_costs(graph, batch, mode="measure", device="cuda", microbatches=4, progress=False)
    predicted = max(plan.stage_memory(costs, gpus=1))
    state = HostState.from_graph(graph, optimizer=OPT, pin_memory=True)
    prog = emit(plan, gpus=1, microbatches=4, staleness=1, costs=costs)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with Runtime(graph, prog, state, backend="cuda", timeout=60) as rt:
        for _ in range(3):
            rt.step(batch)
        rt.flush()
    peak = torch.cuda.max_memory_allocated() - base
    assert 0 < peak <= 1.15 * predicted, f"peak {peak} B vs predicted {predicted} B"


def test_cuda_fault_recovers():
    graph = trace(models.llama(), models.lm_batch(batch=4, seq=8))
    state = HostState.from_graph(graph, optimizer=OPT, pin_memory=True)
    with Runtime(graph, _program(graph, 2, 4, 1), state, backend="cuda", timeout=30) as rt:
        rt.step(models.lm_batch(batch=4, seq=8))
        orig = rt.handlers[Op.BACKWARD]

        def bad(t, ins, w):
            raise RuntimeError("cuda fault")
        rt.handlers[Op.BACKWARD] = bad
        with pytest.raises(RuntimeFailure, match="cuda fault"):
            rt.step(models.lm_batch(batch=4, seq=8, seed=2))
            rt.flush()
        rt.handlers[Op.BACKWARD] = orig
        rt.step(models.lm_batch(batch=4, seq=8, seed=2))
        rt.flush()
