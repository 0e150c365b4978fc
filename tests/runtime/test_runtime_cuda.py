"""The CUDA backend (streams, events, pinned buffers, the stream-aware pool). Skipped without CUDA.

Run by `bash bench/gpu.sh` on a machine with a GPU (by path, ~1-2 min on an H200). Several workers
share one GPU here: each has its own five streams, so the multi-worker protocol runs on real streams
even with one device. The helpers `predicted_peak` and `bf16_runs` are plain functions, so
`tests/test_gpu_readiness.py` checks them on the CPU.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

import models  # noqa: E402
import rpcompile  # noqa: E402
from rpcompile import AdamW, CostTable, StagePlan  # noqa: E402
from rpcompile.ir.hardware import blas_workspace_bytes  # noqa: E402
from rpcompile.passes import emit, trace  # noqa: E402
from rpcompile.ir.program import Op  # noqa: E402
from rpcompile.runtime.executor import Runtime, RuntimeFailure  # noqa: E402
from rpcompile.runtime.host.optimizer import HostState  # noqa: E402

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


@pytest.mark.parametrize("gpus,mbs,staleness,attn", [(1, 4, 0, "sdpa"), (2, 4, 1, "eager"), (4, 8, 1, "sdpa")])
def test_cuda_matches_host(gpus, mbs, staleness, attn):
    """1, 2 and 4 workers on one GPU, multi-chunk transfers, SDPA (the default users get: CUDA's fused
    kernels vs the CPU's) and eager attention: CUDA equals the host backend within 1e-4."""
    graph = trace(models.llama(attn=attn), models.lm_batch(batch=4, seq=8))
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


def bf16_runs(tmp_path, backend: str, *, attn: str = "eager", dropout: float = 0.2, steps: int = 8, **compile_kw):
    """Train in bf16 from one compile, then again from its step-0 checkpoint: [(losses, evaluate, stats, plan)] x 2.

    The plan is pinned: the second run loads the checkpoint (its saved costs and plan, nothing measured
    again), since two compiles from measured costs may choose different plans. `compile_kw` go to compile.
    """
    batch, path = models.lm_batch(batch=8, seq=16), str(tmp_path / "step0.rp")

    def train(c):
        with c:
            losses = [c.step(batch) for _ in range(steps)]
            ev = c.evaluate(batch)
            return losses, ev, c.stats(), c.plan.to_str()
    model = lambda: models.llama(attn=attn, attention_dropout=dropout)  # noqa: E731
    c = rpcompile.compile(model(), gpus=2, example=batch, microbatches=4, dtype=torch.bfloat16,
                          optimizer=AdamW(lr=3e-3), seed=5, backend=backend, **compile_kw)
    c.save(path)
    first = train(c)
    return [first, train(rpcompile.load(path, model()))]


def test_compile_bf16_with_dropout_end_to_end_and_evaluate(tmp_path):
    """compile() on CUDA in bf16 with attention dropout: trains, reproducible, evaluate matches the loss scale."""
    (l1, ev1, stats, p1), (l2, ev2, _, p2) = bf16_runs(tmp_path, "cuda")
    assert p1 == p2 and l1 == l2 and ev1 == ev2  # per-worker generators, seeded per (iteration, microbatch, layer)
    assert all(torch.isfinite(torch.tensor(l1))) and l1[-1] < l1[0]
    assert 0 < ev1 < l1[0] * 1.5
    assert stats["device_allocations"] == 0 and stats["host_allocations"] == 0


def test_compile_bf16_sdpa_end_to_end(tmp_path):
    """bf16 with SDPA (flash / memory-efficient kernels) trains; SDPA dropout is refused, naming the op."""
    (l1, ev1, stats, p1), (l2, _, _, p2) = bf16_runs(tmp_path, "cuda", attn="sdpa", dropout=0.0, steps=6)
    assert p1 == p2 and l2 == pytest.approx(l1, rel=2e-2)  # a fused backward may accumulate with atomics
    assert all(torch.isfinite(torch.tensor(l1))) and l1[-1] < l1[0] and 0 < ev1 < l1[0] * 1.5
    assert stats["device_allocations"] == 0
    batch = models.lm_batch(batch=4, seq=16)
    with pytest.raises(Exception, match="attention dropout to 0"):  # fused kernels draw from the global RNG
        with rpcompile.compile(models.llama(attn="sdpa", attention_dropout=0.2), gpus=1, example=batch,
                               microbatches=2, backend="cuda") as c:
            c.step(batch)
            c.stats()


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


def predicted_peak(plan: StagePlan, costs: CostTable, capability: tuple[int, int], gpus: int = 1) -> int:
    """A worker's predicted device bytes: its largest stage, plus the cuBLAS workspaces of its compute stream.

    The workspaces (32 MiB on sm90, ~9 MiB elsewhere) come from the caching allocator outside the
    plan's buffers, once per (handle, stream): `Hardware.blas_workspace`, which `Hardware.stage_budget`
    takes off the budget the stages must fit.
    """
    return max(plan.stage_memory(costs, gpus=gpus)) + blas_workspace_bytes(capability)


def test_a_new_streams_blas_workspaces_fit_the_hardware_figure():
    """The first matmuls on a new stream (cuBLAS, a cuBLASLt bias epilogue, bf16) allocate at most the
    `blas_workspace_bytes` that `Hardware.measure()` records for this GPU."""
    a = torch.randn(256, 256, device="cuda")
    bias, a16 = torch.randn(256, device="cuda"), a.bfloat16()
    b16 = bias.bfloat16()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    before = torch.cuda.memory_allocated()
    with torch.cuda.stream(s):
        outs = [torch.addmm(bias, a, a), a @ a, torch.nn.functional.linear(a16, a16, b16)]
    s.synchronize()
    grew = torch.cuda.memory_allocated() - before - sum(o.nbytes for o in outs)
    assert 0 <= grew <= blas_workspace_bytes(torch.cuda.get_device_capability()), grew


def test_cuda_peak_memory_within_the_plan_prediction():
    """max_memory_allocated of one worker stays within the plan's predicted peak (stages + cuBLAS workspace) + 15%."""
    from rpcompile.passes.cost import estimate_costs
    torch.manual_seed(0)
    batch = (torch.randn(256, 1024), torch.randn(256, 1024))
    graph = trace(_MLP(1024, 8), batch)
    plan = StagePlan.from_str("2,2,2|2|2,2,2")
    costs = estimate_costs(graph, batch, mode="measure", device="cuda", microbatches=4, progress=False)
    predicted = predicted_peak(plan, costs, torch.cuda.get_device_capability())
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


# -- the review's findings that only a GPU can show (issue 22; the CPU sides are in test_cuda_review.py and
#    test_runtime_review.py) -----------------------------------------------------------------------------------
def test_cuda_issuer_never_blocks_on_host_work_and_matches_host():
    """1d: back-to-back staleness-1 steps on 2 workers: no issuing thread blocked on host work."""
    graph = trace(models.llama(attn="sdpa"), models.lm_batch(batch=4, seq=8))
    batches = [models.lm_batch(batch=4, seq=8, seed=s) for s in range(4)]
    lc, pc, stats = _train(graph, "cuda", 2, 4, 1, batches)
    lh, ph, _ = _train(graph, "host", 2, 4, 1, batches)
    assert stats["issue_waits"] == 0 and stats["issue_blocked_s"] == 0
    assert lc == pytest.approx(lh, rel=1e-4)


def test_cuda_batch_on_another_stream_is_read_in_the_callers_order():
    """1c: a batch written on the caller's stream right before step() trains as the same batch on the CPU."""
    graph = trace(models.llama(attn="sdpa"), models.lm_batch(batch=4, seq=8))
    cpu = [models.lm_batch(batch=4, seq=8, seed=s) for s in range(2)]
    side = torch.cuda.Stream()
    gpu = []
    for b in cpu:
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # the copies below land late on the caller's stream
            gpu.append({k: v.cuda(non_blocking=True) for k, v in b.items()})
    with torch.cuda.stream(side):
        lg, pg, _ = _train(graph, "cuda", 2, 4, 0, gpu)
    lh, ph, _ = _train(graph, "cuda", 2, 4, 0, cpu)
    assert lg == pytest.approx(lh, rel=1e-5)  # a fused attention backward may accumulate with atomics
    assert all(torch.allclose(pg[n], ph[n], rtol=1e-5, atol=1e-6) for n in ph)


def test_cuda_event_wait_has_a_deadline():
    """1f: an event behind a long kernel: wait(timeout) raises TimeoutError instead of hanging."""
    from rpcompile.runtime.streams.devices import make_workers
    from rpcompile.runtime.streams.host import StreamContext
    ctx = StreamContext(timeout=60.0)
    w = make_workers(1, ctx, "cuda", None, False)[0]
    try:
        s = w.streams["compute"]
        s.submit(lambda: torch.cuda._sleep(2_000_000_000), "sleep", 0)  # seconds of GPU time
        ev = s.record(0, "after sleep")
        with pytest.raises(TimeoutError):
            ev.wait(timeout=0.2)
    finally:
        torch.cuda.synchronize()
        w.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_stats_on_two_devices():
    """1b: stats() and the measured timeline with workers on two GPUs (elapsed_time within one device)."""
    graph = trace(models.llama(attn="sdpa"), models.lm_batch(batch=4, seq=8))
    state = HostState.from_graph(graph, optimizer=OPT, pin_memory=True)
    with Runtime(graph, _program(graph, 2, 4, 1), state, backend="cuda", devices=["cuda:0", "cuda:1"],
                 timeout=60) as rt:
        rt.step(models.lm_batch(batch=4, seq=8))
        rt.flush()
        assert rt.stats()["busy_s"] and rt.last_timeline


# -- the paper's recipe (issue 33): fp16 accumulation, the fused LM head, exact-size pinning ----------------

def _flag() -> bool:
    return bool(torch.backends.cuda.matmul.allow_fp16_accumulation)


def _recipe_losses(dtype, steps: int = 5, **kw) -> tuple[list[float], list[bool]]:
    """Losses of `steps` compile() steps of the tiny Llama on CUDA (2 workers), and the flag seen inside its layers."""
    batch = models.lm_batch(batch=4, seq=16)
    seen: list[bool] = []
    with rpcompile.compile(models.llama(), gpus=2, example=batch, microbatches=2, staleness=0, dtype=dtype,
                           optimizer=rpcompile.SGD(lr=0.05), backend="cuda", lm_head_shards=1, **kw) as c:
        for runner in c._runtime.runners:
            for mod in runner.modules:
                mod.register_forward_pre_hook(lambda m, a: seen.append(_flag()))
        losses = [c.step(batch) for _ in range(steps)]
        c.stats()  # waits for the last step's work
    return losses, seen


def test_cuda_fp16_accumulation_is_on_in_the_workers_off_in_the_caller_and_trains_like_fp32():
    """fp16 with fp16 accumulation: every layer runs with the flag on, the caller's setting is untouched
    before, between and after the steps, and the loss stays within 1% of fp32 over 5 steps."""
    assert not _flag()
    fp16, seen = _recipe_losses(torch.float16, fp16_accumulation=True, fused_head=True,
                                loss_scale=rpcompile.DynamicLossScale(init_scale=2.0 ** 10))
    assert seen and all(seen) and not _flag()
    fp32, seen32 = _recipe_losses(torch.float32)
    assert seen32 and not any(seen32)
    for a, b in zip(fp16, fp32):
        assert abs(a - b) <= 0.01 * abs(b), (fp16, fp32)


def test_cuda_fused_head_runs_the_compiled_chunk_and_matches_eager():
    """The fused head on CUDA (its elementwise work one torch.compile kernel): loss and gradients equal eager."""
    from rpcompile.passes.shard_head import fused as fh
    torch.manual_seed(0)
    x = torch.randn(96, 32, device="cuda", requires_grad=True)
    w = torch.randn(300, 32, device="cuda", requires_grad=True)
    t = torch.randint(0, 300, (96,), device="cuda")
    t[::7] = -100
    total = None
    for i in range(2):  # two token shards, chunks of 20 tokens
        total = fh.fused_ce(x, w, None, t, total, (i, 2), 20, (), 0, -100)
    loss = fh.fused_loss(total, t, -100, "mean", torch.float32)
    loss.backward()
    assert fh._compiled.cache_info().currsize == 1  # the compiled chunk ran
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(x2 @ w2.t(), t)
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w.grad, w2.grad, atol=1e-5, rtol=1e-4)


def test_cuda_compute_copies_are_registered_at_exact_size():
    """The compute-copy blocks are page-locked by cudaHostRegister at exactly the bytes admission counts, not
    from torch's caching host allocator (which rounds up to a power of two), and uploads from them work."""
    from rpcompile.passes.cost.host_bytes import compute_blocks
    from rpcompile.runtime.host.pinned import CudaRegistrar, PinnedAllocator

    class Counting(CudaRegistrar):
        def __init__(self):
            self.calls = []

        def register(self, ptr, nbytes):
            self.calls.append(nbytes)
            super().register(ptr, nbytes)

    graph = trace(models.llama(), models.lm_batch(batch=4, seq=8))
    reg = Counting()
    def host_allocated():  # torch's caching host allocator (pin_memory=True), where this torch reports it
        stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
        return next((v for k, v in stats.items() if "allocated_bytes" in k and k.endswith("current")), None)
    before = host_allocated()
    state = HostState.from_graph(graph, optimizer=OPT, dtype=torch.bfloat16, pin_memory=PinnedAllocator(reg))
    assert sorted(reg.calls) == sorted(compute_blocks(graph, torch.bfloat16).values())
    assert all(b.is_pinned() for b in state.blocks.values())
    assert host_allocated() == before  # nothing came from the caching host allocator
    name = next(iter(graph.params))
    dev = state.read(name).to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), state.read(name))
    del state, dev


def test_cuda_transfer_buffers_are_registered_at_exact_size_and_unregistered_at_close():
    """With CUDA workers the gradient staging, the host arena (registered once) and the host pool's buffers are
    page-locked by cudaHostRegister at their exact bytes (both what admission counts; none from torch's caching host allocator), the run
    matches the host backend, and close unregisters every one of them."""
    from rpcompile.runtime.host.buffers import transfer_bytes
    from rpcompile.runtime.host.pinned import CudaRegistrar, PinnedAllocator

    class Counting(CudaRegistrar):
        def __init__(self):
            self.live = {}

        def register(self, ptr, nbytes):
            super().register(ptr, nbytes)
            self.live[ptr] = nbytes

        def unregister(self, ptr):
            super().unregister(ptr)
            del self.live[ptr]

    def host_allocated():  # torch's caching host allocator (pin_memory=True), where this torch reports it
        stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
        return next((v for k, v in stats.items() if "allocated_bytes" in k and k.endswith("current")), None)
    graph = trace(models.llama(attn="sdpa"), models.lm_batch(batch=4, seq=8))
    program = _program(graph, 2, 4, 1)
    batches = [models.lm_batch(batch=4, seq=8, seed=s) for s in range(3)]
    reg = Counting()
    state = HostState.from_graph(graph, optimizer=OPT, pin_memory=True)
    before = host_allocated()
    with Runtime(graph, program, state, backend="cuda", timeout=60, pinned=PinnedAllocator(reg)) as rt:
        losses = [rt.step(b) for b in batches]
        rt.flush()
        staging = [b for bufs in rt.host.staging.values() for b in bufs.values()]
        assert staging and all(b.is_pinned() and reg.live[b.data_ptr()] == b.nbytes for b in staging)
        assert sum(b.nbytes for b in staging) == transfer_bytes(graph, program).staging
        need = transfer_bytes(graph, program)
        assert reg.live[rt.arena.data_ptr()] == need.arena > 0 and rt.arena.is_pinned()  # the arena: once
        assert sum(reg.live.values()) - need.staging - need.arena == rt.host_pool.reserved == need.pool > 0
        assert host_allocated() == before  # nothing from the caching host allocator
    assert reg.live == {}  # all unregistered at close
    lh, _, _ = _train(graph, "host", 2, 4, 1, batches)
    assert losses == pytest.approx(lh, rel=1e-4)
