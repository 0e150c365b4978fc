"""Pinned host memory at its exact size (runtime/host/pinned.py): what is registered is what admission counts."""
from __future__ import annotations

import gc
import math

import pytest
import torch

import models as M
import rpcompile
from rpcompile import StagePlan
from rpcompile.hostmem import host_bytes
from rpcompile.ir.hardware import Hardware
from rpcompile.passes import emit, estimate_costs, shard_lm_head, trace
from rpcompile.passes.cost.host_bytes import compute_blocks
from rpcompile.runtime.executor import Runtime, RuntimeFailure
from rpcompile.runtime.host.buffers import arena_key, nbytes, pool_buffers, transfer_bytes
from rpcompile.runtime.host.optimizer import HostState
from rpcompile.runtime.host.pinned import PAGE, PinnedAllocator
from rpcompile.runtime.streams.pool import BufferPool


class Recording:
    """A registrar that records the ranges instead of page-locking them."""

    def __init__(self, fail_above: int | None = None) -> None:
        self.live: dict[int, int] = {}
        self.calls: list[int] = []
        self.unregistered: list[int] = []  # every unregister call, a repeated one included
        self.fail_above = fail_above

    def register(self, ptr: int, nbytes: int) -> None:
        if self.fail_above is not None and nbytes > self.fail_above:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed")
        assert ptr % PAGE == 0 and ptr not in self.live
        self.live[ptr] = nbytes
        self.calls.append(nbytes)

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)  # before the KeyError a second call raises (swallowed inside a __del__)
        del self.live[ptr]


def _graph(kind: str):
    if kind == "gpt2":  # tied embedding / head: one block holds them
        pytest.importorskip("transformers")
        return trace(M.gpt2(), M.lm_batch())
    model = M.sequential(width=5)  # 5-element biases: views padded to 16-byte boundaries inside the blocks
    return trace(model, M.regression_batch(width=5), loss_fn=M.mse_loss)


@pytest.mark.parametrize("kind", ["gpt2", "odd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_registered_bytes_are_the_compute_blocks_host_bytes_counts(dtype, kind):
    graph = _graph(kind)
    reg = Recording()
    state = HostState.from_graph(graph, optimizer=rpcompile.AdamW(), dtype=dtype, pin_memory=PinnedAllocator(reg))
    blocks = compute_blocks(graph, dtype)
    assert sorted(reg.calls) == sorted(blocks.values()) == sorted(b.nbytes for b in state.blocks.values())
    need = host_bytes(graph, microbatches=2, optimizer=rpcompile.AdamW(), dtype=dtype)
    assert sum(reg.live.values()) == need.weights  # admission counts exactly what is pinned
    for name, p in graph.parameters().items():  # the compute copies hold the weights
        torch.testing.assert_close(state.read(name), p.detach().to(dtype), atol=0, rtol=0)
    del state
    gc.collect()
    assert reg.live == {}  # unregistered before the memory went back


def test_close_unregisters_and_a_refusal_leaves_nothing_registered():
    reg = Recording(fail_above=4096)
    alloc = PinnedAllocator(reg)
    small = alloc.zeros(1000, torch.float32)
    assert alloc.registered == 4000 and small.data_ptr() % PAGE == 0 and not small.any()
    with pytest.raises(RuntimeError, match="5000 bytes"):
        alloc.zeros(2500, torch.float16)
    assert list(reg.live.values()) == [4000]
    ptr = small.data_ptr()
    alloc.close()
    assert reg.live == {} and alloc.registered == 0 and reg.unregistered == [ptr]
    alloc.close()  # a second close unregisters nothing
    small += 1  # the memory stays valid (pageable again)
    del small
    gc.collect()
    assert reg.live == {} and reg.unregistered == [ptr]  # the block's finalizer unregisters it no second time


def _run(graph, program, batches, pinned=None):
    """Losses of `batches` on 2 host workers (their host buffers pinned by `pinned`), and the closed runtime."""
    state = HostState.from_graph(graph, optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach"))
    with Runtime(graph, program, state, backend="host", timeout=60, pinned=pinned) as rt:
        losses = [rt.step(b) for b in batches]
        rt.flush()
        staging = [b for bufs in rt.host.staging.values() for b in bufs.values()]
        registered = dict(pinned.registrar.live) if pinned else {}
    return losses, rt, staging, registered


def test_the_runtimes_transfer_buffers_are_registered_at_exactly_their_size_and_admission_counts_them():
    """Gradient staging, the host arena (downloads) and the host pool (step inputs, losses) go through the
    registrar at their exact bytes, the arena once; admission counts them exactly; close unregisters all."""
    graph = trace(M.llama(), M.lm_batch(batch=4, seq=8))
    costs = estimate_costs(graph, M.lm_batch(batch=4, seq=8), mode="predict", hardware=Hardware.preset("cpu"),
                           microbatches=4, progress=False)
    plan = StagePlan.from_str("2,2|1|1,3")
    program = emit(plan, gpus=2, microbatches=4, staleness=1, costs=costs)
    batches = [M.lm_batch(batch=4, seq=8, seed=s) for s in range(3)]
    reg = Recording()
    losses, rt, staging, live = _run(graph, program, batches, PinnedAllocator(reg))
    need = transfer_bytes(graph, program)
    assert staging and all(live[b.data_ptr()] == b.nbytes for b in staging)  # each at its exact size
    assert sum(b.nbytes for b in staging) == need.staging
    assert live[rt.arena.data_ptr()] == need.arena > 0  # the arena: registered once, at its exact size
    assert need.arena < need.unshared  # buffers that are never live at once share its bytes
    pool = sum(live.values()) - need.staging - need.arena
    assert pool == rt.host_pool.reserved == need.pool > 0  # nothing rounded, nothing learned in a warm-up
    host = host_bytes(graph, costs, plan, program=program, microbatches=4, gpus=2, round_size=program.round_size,
                      optimizer=rpcompile.AdamW())
    assert host.buffers == need.total and "transfer buffers" in str(host)
    assert reg.live == {} and rt.host.staging  # unregistered at close, the buffers still referenced
    assert losses == _run(graph, program, batches)[0]  # pinning changes no number


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gradient_staging_of_odd_sized_parameters_is_counted_with_its_alignment_padding(dtype):
    """5 x 5 weights and 5- and 4-element biases: each view in a staging unit starts 16-byte aligned, so the
    ring's buffers (each the largest unit) hold padding that admission counts too: counted bytes ==
    registered bytes. A frozen weight has no gradient to stage, and is counted nowhere."""
    batch = tuple(x.to(dtype) for x in M.regression_batch(width=5))
    model = M.sequential(width=5).to(dtype)
    model[2].weight.requires_grad_(False)
    graph = trace(model, batch, loss_fn=M.mse_loss)
    program = emit(StagePlan.from_str("3,3|1|3,3"), gpus=2, microbatches=2, staleness=1)
    reg = Recording()
    state = HostState.from_graph(graph, optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach"))
    with Runtime(graph, program, state, backend="host", timeout=60, pinned=PinnedAllocator(reg)) as rt:
        rt.step(batch)
        rt.flush()
        staging = [b for bufs in rt.host.staging.values() for b in bufs.values()]
        registered = [reg.live[b.data_ptr()] for b in staging]
        plan = rt.host.plan
    assert len(staging) == plan.k == 2  # one ring for the three stages' gradients
    largest = max(sum(u.elements().values()) for u in plan.units)
    assert all(b.numel() == largest for b in staging)
    assert any(sum(u.elements().values()) > sum(n for _, _, n in u.grads.values()) for u in plan.units)  # padded
    assert transfer_bytes(graph, program).staging == sum(registered) == sum(b.nbytes for b in staging)


_PLANS = {(False, 1): "2,2|1|1,3", (False, 2): "2,2|1|1,3", (False, 4): "1,1,1,1|1|1,1,1,1",
          (True, 1): "3,3|1|3,3", (True, 2): "3,3|1|3,3", (True, 4): "2,2,2|1|2,2,2"}


@pytest.mark.parametrize("sharded", [False, True], ids=["head", "sharded-head"])
@pytest.mark.parametrize("microbatches", [4, 8])
@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_the_host_pool_registers_exactly_the_buffers_admission_counts(gpus, staleness, microbatches, sharded):
    """Every configuration, however the threads interleave (random lane delays): the arena of the downloads is
    registered once, and the pool one buffer per counted loss and step input, each at its counted bytes; an
    evaluation adds none."""
    example = M.lm_batch(batch=8, seq=8)
    graph = trace(M.llama(), example)
    costs = estimate_costs(graph, example, mode="predict", hardware=Hardware.preset("cpu"),
                           microbatches=microbatches, progress=False)
    if sharded:
        graph = shard_lm_head(graph, shards=2, costs=costs)
    program = emit(StagePlan.from_str(_PLANS[(sharded, gpus)]), gpus=gpus, microbatches=microbatches,
                   staleness=staleness)
    reg = Recording()
    state = HostState.from_graph(graph, optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach"))
    with Runtime(graph, program, state, backend="host", timeout=60, pinned=PinnedAllocator(reg),
                 lane_delay=gpus * 10 + microbatches) as rt:
        for s in range(3):
            rt.step(M.lm_batch(batch=8, seq=8, seed=s))
        rt.evaluate(M.lm_batch(batch=8, seq=8, seed=9))
        rt.flush()
        staging = {b.data_ptr() for bufs in rt.host.staging.values() for b in bufs.values()}
        pool = sorted(n for p, n in reg.live.items() if p not in staging and p != rt.arena.data_ptr())
        need = transfer_bytes(graph, program)
        assert reg.live[rt.arena.data_ptr()] == need.arena  # the downloads: views of the arena, made once
        assert sum(pool) == need.pool == rt.host_pool.reserved
        own = [b for k, b in pool_buffers(graph, program).items() if arena_key(k) is None]
        assert pool == sorted(nbytes(*b) for b in own)  # one per key, its bytes
    assert reg.live == {}  # unregistered at close


@pytest.mark.parametrize("traced,run", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_a_value_of_another_dtype_than_traced_fills_its_planned_buffer(traced, run, monkeypatch):
    """fp32 traced, bf16 run: bf16 activations in fp32-sized buffers; bf16 traced, fp32 run: planned at fp32.
    Either way the pool registers what admission counts for the run's dtype, and trains as unpinned; a
    download keeps its value's dtype (a view of the buffer's first bytes), never the buffer's."""
    recast = BufferPool.recast
    recast_to = []

    def spy(self, h, shape, dtype):
        recast_to.append(dtype)
        return recast(self, h, shape, dtype)
    monkeypatch.setattr(BufferPool, "recast", spy)
    example = M.lm_batch(batch=4, seq=8)
    graph = trace(M.llama().to(traced), example)
    program = emit(StagePlan.from_str("2,2|1|1,3"), gpus=2, microbatches=4, staleness=1)
    batches = [M.lm_batch(batch=4, seq=8, seed=s) for s in range(3)]
    losses = []
    for reg in (Recording(), None):
        state = HostState.from_graph(graph, optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach"), dtype=run)
        with Runtime(graph, program, state, backend="host", timeout=60,
                     pinned=reg and PinnedAllocator(reg)) as rt:
            losses.append([rt.step(b) for b in batches])
            rt.flush()
            if reg is not None:
                need = transfer_bytes(graph, program, run)
                assert sum(reg.live.values()) == need.total == rt.host_pool.reserved + need.staging + need.arena
    assert losses[0] == losses[1]
    assert set(recast_to) == ({run} if run.itemsize < traced.itemsize else set())  # narrower values only


def test_a_value_larger_than_its_planned_buffer_fails_naming_it_and_the_next_step_trains():
    graph = trace(M.llama(), M.lm_batch(batch=4, seq=8))
    program = emit(StagePlan.from_str("2,2|1|1,3"), gpus=2, microbatches=4, staleness=1)
    state = HostState.from_graph(graph, optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach"))
    with Runtime(graph, program, state, backend="host", timeout=60) as rt:
        first = rt.step(M.lm_batch(batch=4, seq=8))
        with pytest.raises(RuntimeFailure, match=r"of microbatch 0 is \(1, 16\) .* larger than its host buffer of "
                                                 r"\(1, 8\)"):
            rt.step(M.lm_batch(batch=4, seq=16))
        assert rt.step(M.lm_batch(batch=4, seq=8)) == first  # iteration 1 again, on the weights it read before


def test_a_first_batch_shaped_unlike_the_trace_learns_its_shapes():
    """The pool follows the plan only for batches shaped as traced (`IssueHandlers`' Note): a longer first
    batch has no planned buffer to outgrow, its buffers are learned as it runs, and it trains."""
    graph = trace(M.llama(), M.lm_batch(batch=4, seq=8))
    program = emit(StagePlan.from_str("2,2|1|1,3"), gpus=2, microbatches=4, staleness=1)
    state = HostState.from_graph(graph, optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach"))
    with Runtime(graph, program, state, backend="host", timeout=60) as rt:
        losses = [rt.step(M.lm_batch(batch=4, seq=16, seed=s)) for s in range(2)]
    assert all(math.isfinite(x) for x in losses)
