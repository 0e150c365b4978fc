"""The CUDA backend (streams, events, pinned buffers): same results as the host backend. Skipped without CUDA."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
from rpcompile import AdamW, StagePlan  # noqa: E402
from rpcompile.passes import emit, trace  # noqa: E402
from rpcompile.runtime.executor import Runtime, RuntimeFailure  # noqa: E402
from rpcompile.runtime.optimizer import HostState  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
OPT = AdamW(lr=1e-2, eps=1e-4, impl="foreach")


def _train(graph, backend: str, gpus: int, mbs: int, staleness: int, batches, **kw):
    state = HostState.from_graph(graph, optimizer=OPT, pin_memory=backend == "cuda")
    prog = emit(StagePlan.from_str("2,2|1|1,3"), gpus=gpus, microbatches=mbs, staleness=staleness)
    with Runtime(graph, prog, state, backend=backend, timeout=60, **kw) as rt:
        losses = [rt.step(b) for b in batches]
        rt.flush()
    return losses, state.parameters_fp32()


@pytest.mark.parametrize("gpus,mbs,staleness", [(1, 4, 0), (2, 4, 1), (4, 8, 1)])
def test_cuda_matches_host(gpus, mbs, staleness):
    """Several workers may share one GPU; CUDA results equal the host backend's within 1e-4."""
    graph = trace(models.llama(), models.lm_batch(batch=4, seq=8))
    batches = [models.lm_batch(batch=mbs, seq=8, seed=s) for s in range(3)]
    lc, pc = _train(graph, "cuda", gpus, mbs, staleness, batches)
    lh, ph = _train(graph, "host", gpus, mbs, staleness, batches)
    assert lc == pytest.approx(lh, rel=1e-4)
    for n in ph:
        assert torch.allclose(pc[n], ph[n], rtol=1e-4, atol=1e-5), n


def test_cuda_deterministic_under_delays():
    graph = trace(models.llama(), models.lm_batch(batch=4, seq=8))
    batches = [models.lm_batch(batch=8, seq=8, seed=s) for s in range(2)]
    runs = [_train(graph, "cuda", 3, 8, 1, batches, lane_delay=k)[1] for k in range(3)]
    assert all(torch.equal(runs[0][n], r[n]) for r in runs[1:] for n in r)


def test_cuda_fault_recovers():
    graph = trace(models.llama(), models.lm_batch(batch=4, seq=8))
    state = HostState.from_graph(graph, optimizer=OPT, pin_memory=True)
    prog = emit(StagePlan.from_str("2,2|1|1,3"), gpus=2, microbatches=4, staleness=1)
    with Runtime(graph, prog, state, backend="cuda", timeout=30) as rt:
        rt.step(models.lm_batch(batch=4, seq=8))
        from rpcompile.program import Op
        orig = rt.handlers[Op.BACKWARD]

        def bad(t, ins, w):
            raise RuntimeError("cuda fault")
        rt.handlers[Op.BACKWARD] = bad
        with pytest.raises(RuntimeFailure, match="cuda fault"):
            rt.step(models.lm_batch(batch=4, seq=8, seed=2))
        rt.handlers[Op.BACKWARD] = orig
        rt.step(models.lm_batch(batch=4, seq=8, seed=2))
        rt.flush()
