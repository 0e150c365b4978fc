"""The stream/event execution model (DESIGN.md 3a) at work in the runtime: poison mode and each dependency kind.

The building blocks (host streams, events, the buffer pool) are tested in tests/runtime/test_host_streams.py.

The host backend runs every stream on its own thread, so a missing dependency
shows up on the CPU as it would on a GPU: poison mode fills pool buffers with
NaN when handed out (host buffers when released) and random delays reorder the
streams. Each test that drops one kind of dependency proves that the poison
test can fail.

The runtime tests run in two issuing modes (`MODES`): "host" (host streams
take every wait themselves) and "host-cuda" (the CUDA backend's issuing side,
`runtime/streams/launch.py`, over host streams: the issuer launches directly, a wait on
unfinished host work puts the stream's later work in a backlog), so the CPU
suite runs CUDA's issuing pattern too.
"""
from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

import models  # noqa: E402
from rpcompile import AdamW, CostTable, StagePlan  # noqa: E402
from rpcompile.passes import emit, trace  # noqa: E402
from rpcompile.runtime.executor import DEP_KINDS, Runtime, RuntimeFailure  # noqa: E402
from rpcompile.runtime.host.optimizer import HostState  # noqa: E402
from rpcompile.runtime.host.staging import graph_staging  # noqa: E402
from rpcompile.runtime.stage.cuts import stage_io  # noqa: E402

OPT = AdamW(lr=1e-2, eps=1e-4, impl="foreach")
MODES = ("host", "host-cuda")  # backends: host streams; CUDA's issuing side over host streams
PLAN3 = "2,2|1|1,1,1,1"  # llama, 5 layers, 3 workers: several slots per worker, tied-free


def _batch(seed: int, n: int) -> dict:
    return models.lm_batch(batch=n, seq=8, seed=seed)


def _graph():
    return trace(models.llama(), _batch(0, 4))


def _program(graph, plan: str, gpus: int, mbs: int, staleness: int, round_size: int | None = None):
    """A program whose P/G transfers are cut into several chunks (costs carry the real parameter bytes)."""
    pb = [sum(graph.params[p].bytes for p in lay.params) for lay in graph.layers]
    costs = CostTable.from_lists(fwd=[1e-3] * len(pb), bwd=[2e-3] * len(pb), param_bytes=pb, grad_bytes=pb)
    return emit(StagePlan.from_str(plan), gpus=gpus, microbatches=mbs, round_size=round_size,
                staleness=staleness, costs=costs)


def _train(graph, prog, steps: int, mbs: int, backend: str = "host", **kw) -> dict:
    state = HostState.from_graph(graph, optimizer=OPT)
    with Runtime(graph, prog, state, backend=backend, timeout=20, **kw) as rt:
        for s in range(steps):
            rt.step(_batch(s, mbs))
        rt.flush()
    return state.parameters_fp32()


# -- the runtime in poison mode ----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", MODES)
@pytest.mark.parametrize("gpus,plan,mbs,staleness", [(2, "2,2|1|1,3", 4, 1), (3, PLAN3, 6, 0),
                                                      (4, "1,1,1,1|1|1,1,1,1", 8, 1)])
def test_poison_with_random_delays_is_bit_identical_and_finite(gpus, plan, mbs, staleness, backend):
    """8 runs (poison on, random stream delays, multi-chunk transfers): the same bits every time, all finite
    (the reference is the plain host backend in every mode)."""
    graph = _graph()
    prog = _program(graph, plan, gpus, mbs, staleness)
    assert max(sum(1 for c in prog.chunks if c.stage == s.index) for s in prog.plan.stages) > 1
    ref = _train(graph, prog, 3, mbs)
    runs = (8 if backend == "host" else 4) if gpus == 3 else 3
    for k in range(runs):
        got = _train(graph, prog, 3, mbs, backend, poison=True, lane_delay=k)
        for n in ref:
            assert torch.isfinite(got[n]).all(), f"run {k}: {n} not finite"
            assert torch.equal(got[n], ref[n]), f"run {k}: {n} differs"


def _slow_transfers(seed: int):
    """Random delays, longer on the transfer lanes (0-10 ms) than on compute (0-2 ms), one stream per (worker,
    lane) so they do not depend on thread timing: a transfer that a compute forgot to wait for is still running."""
    gens: dict = {}
    lock = threading.Lock()

    def delay(worker: int, lane: str, label: str) -> float:
        with lock:
            g = gens.setdefault((worker, lane), torch.Generator().manual_seed(seed * 131 + worker * 7 + len(lane)))
            return float(torch.rand((), generator=g)) * (0.002 if lane == "compute" else 0.010)
    return delay


@pytest.mark.parametrize("backend", MODES)
@pytest.mark.parametrize("kind", [k for k in DEP_KINDS if k != "step>grad_down"])  # (that one: the test below)
def test_each_dropped_dependency_is_detected(kind, backend):
    """With one kind of dependency dropped, poison mode plus delays sees it within 20 runs."""
    graph = _graph()
    prog = _program(graph, PLAN3, 3, 6, 0)
    ref = _train(graph, prog, 3, 6)
    for k in range(20):
        try:
            got = _train(graph, prog, 3, 6, backend, poison=True, lane_delay=_slow_transfers(k), drop=(kind,))
        except (RuntimeFailure, FloatingPointError):
            return  # a value read before its producer ran, or poison (NaN) reaching a gradient
        if any(not torch.equal(got[n], ref[n]) for n in ref):
            return
    pytest.fail(f"dropping {kind!r} went unnoticed in 20 runs")


@pytest.mark.parametrize("drop", [(), ("step>grad_down",)], ids=["kept", "dropped"])
def test_a_staging_buffer_refilled_before_its_unit_is_accumulated_is_caught(drop):
    """The accumulate lane is held until unit K's gradients have landed, or 2 s. Unit K's ring buffer is unit
    0's: with the wait for unit 0's accumulation ("step>grad_down") it does not land, and training is exact;
    without it, it lands over unit 0's gradients, which are then accumulated wrong, and (poison mode) the
    buffer is poisoned under unit K: a NaN gradient, or weights unlike the reference."""
    graph = _graph()
    prog = _program(graph, PLAN3, 3, 6, 0)
    ref = _train(graph, prog, 2, 6)
    state = HostState.from_graph(graph, optimizer=OPT)
    landed, failed = [], None
    with Runtime(graph, prog, state, backend="host", timeout=20, poison=True, drop=drop) as rt:
        plan, gate = rt.host.plan, threading.Event()
        assert plan.k < len(plan.units)
        rt.host.lanes["accumulate"].submit(gate.wait)

        def opener() -> None:
            try:
                for ev in rt.board.get((0, plan.units[plan.k].chunks[-1]), 0, "the test"):
                    ev.wait(2.0)
                landed.append(True)
            except TimeoutError:
                landed.append(False)
            gate.set()
        th = threading.Thread(target=opener)
        th.start()
        try:
            for s in range(2):
                rt.step(_batch(s, 6))
            rt.flush()
        except (RuntimeFailure, FloatingPointError) as exc:
            failed = exc
        th.join()
    got = state.parameters_fp32()
    if drop:
        assert landed == [True] and (failed is not None or any(not torch.equal(got[n], ref[n]) for n in ref))
    else:
        assert landed == [False] and failed is None and all(torch.equal(got[n], ref[n]) for n in ref)


def test_unknown_dependency_kind_is_refused():
    graph = _graph()
    with pytest.raises(ValueError, match="act_up>compute"):
        Runtime(graph, _program(graph, PLAN3, 3, 6, 0), HostState.from_graph(graph, optimizer=OPT),
                backend="host", drop=("upload",))


# -- the host waits on work, not on instructions; nothing is allocated in the steady state ------------------
def _stats(graph, prog, mbs: int, steps: int = 4) -> list[dict]:
    state = HostState.from_graph(graph, optimizer=OPT)
    with Runtime(graph, prog, state, backend="host", timeout=20, lane_delay=1) as rt:
        out = []
        for s in range(steps):
            rt.step(_batch(s, mbs))
            rt.flush()
            out.append(rt.stats())
    return out


def test_host_waits_scale_with_microbatches_not_instructions():
    """M = 4 -> 16 (about 4x the instructions): host waits per step grow by at most 12, one per gradient
    staging unit more (the accumulate lane waits once per unit: 5 per round, rounds of 4) plus a constant (2)."""
    graph = _graph()
    small, big = _program(graph, "1,1,1,1|1|1,1,1,1", 4, 4, 1), _program(graph, "1,1,1,1|1|1,1,1,1", 4, 16, 1)
    assert len(big.instrs) > 3.5 * len(small.instrs)
    units = [len(graph_staging(graph, p, stage_io(graph, p.plan)).units) for p in (small, big)]
    assert units == [5, 20]  # one unit per gradient slot here
    w4, w16 = _stats(graph, small, 4)[-1]["host_waits"], _stats(graph, big, 16)[-1]["host_waits"]
    assert 0 < w16 <= w4 + (16 - 4) + (units[1] - units[0]) + 2, (w4, w16)
    assert w16 < len(big.instrs) / 20  # the old executor synchronised the host after every instruction


def test_stats_default_to_the_last_step():
    # `stats()` is the iteration just stepped (the first allocates its buffers), the same as asking for it
    graph = _graph()
    with Runtime(graph, _program(graph, PLAN3, 3, 6, 1), HostState.from_graph(graph, optimizer=OPT),
                 backend="host", timeout=20) as rt:
        for s in range(2):
            rt.step(_batch(s, 6))
            rt.flush()
            assert rt.stats() == rt.stats(s) and rt.stats()["bytes_to_device"] > 0, s
        assert rt.stats(0)["host_allocations"] > 0


def test_no_allocation_after_two_warm_up_steps():
    # The third: 7 stages on 4 workers, the embedding and head larger than a block. A worker's slot-count
    # parity drifts between rotations (its parameter buffers were sized for one rotation: they grew in
    # steps 4-7) and each worker meets the template parts one iteration at a time (one activation buffer
    # more in step 2).
    graph, wide = _graph(), trace(models.llama(num_hidden_layers=4, vocab_size=2048), _batch(0, 4))
    for g, prog, mbs, steps in ((graph, _program(graph, PLAN3, 3, 6, 1), 6, 5),
                                (graph, _program(graph, "2,2|1|1,3", 2, 4, 0), 4, 5),
                                (wide, _program(wide, "1,1,1|4|1,1,1", 4, 4, 1), 4, 10)):
        stats = _stats(g, prog, mbs, steps=steps)
        assert stats[0]["device_allocations"] > 0 and stats[0]["host_allocations"] > 0
        for k, st in enumerate(stats[2:], 2):
            assert st["device_allocations"] == 0 and st["host_allocations"] == 0, (k, st)
        last = stats[-1]
        assert last["bytes_to_device"] > 0 and last["bytes_to_host"] > 0
        assert {"w0/compute", "w0/param_up", "w0/act_up", "w0/act_down", "w0/grad_down"} <= set(last["busy_s"])


def test_an_output_that_is_its_input_is_downloaded_from_a_copy():
    """The sharded LM head passes x through every shard unchanged, so an F stage's output can be the
    upload buffer of its own input. That buffer is reused by the next upload once the compute is done;
    the download must not read it (it did, and the gradients came out ~3% wrong on such plans)."""
    from oracle import reference_train
    from rpcompile.passes import shard_lm_head
    from rpcompile.runtime.stage.batch import split_batch
    model = models.llama(0)
    batches = [_batch(s, 4) for s in range(3)]
    graph = shard_lm_head(trace(model, batches[0]), shards=8, chunk=64)
    opt = AdamW(lr=1e-2, eps=1e-4, impl="foreach")
    loss_fn = lambda m, b: sum(m(**p).loss for p in split_batch(graph, b, 2)) / 2  # noqa: E731
    want, ref = reference_train(model, batches, optimizer=opt, staleness=0, loss_fn=loss_fn)
    n = len(graph.layers) - 3
    twos = ",".join(["2"] * (n // 2)) + ("," + str(n % 2) if n % 2 else "")
    for plan in (f"4,{n - 4}|3|4,{n - 4}", f"5,{n - 5}|3|{twos}"):
        state = HostState.from_graph(graph, optimizer=opt)
        prog = emit(StagePlan.from_str(plan), gpus=2, microbatches=2, staleness=0)
        with Runtime(graph, prog, state, backend="host", timeout=20, poison=True, lane_delay=3) as rt:
            got = [rt.step(b) for b in batches]
            rt.flush()
        assert got == pytest.approx(want, rel=1e-5), plan
        for name, p in state.parameters_fp32().items():
            assert torch.allclose(p, ref[name].float(), rtol=1e-5, atol=1e-6), (plan, name)


# -- CUDA's issuing pattern on host workers (issue 22, 1d) ----------------------------------------------------
@pytest.mark.parametrize("backend,staleness", [("host-cuda", 0), ("host-cuda", 1), ("host-cuda-old", 1)])
def test_cuda_issuing_equals_the_oracle(backend, staleness):
    """The CUDA backend's issuing side over host streams (and its old, blocking one) trains as the oracle."""
    from oracle import reference_train
    from rpcompile.runtime.stage.batch import split_batch
    model = models.llama(0)
    batches = [_batch(s, 6) for s in range(3)]
    graph = trace(model, batches[0])
    loss_fn = lambda m, b: sum(m(**p).loss for p in split_batch(graph, b, 6)) / 6  # noqa: E731
    want, ref = reference_train(model, batches, optimizer=OPT, staleness=staleness, loss_fn=loss_fn)
    state = HostState.from_graph(graph, optimizer=OPT)
    with Runtime(graph, emit(StagePlan.from_str(PLAN3), gpus=3, microbatches=6, staleness=staleness), state,
                 backend=backend, timeout=20, lane_delay=5) as rt:
        got = [rt.step(b) for b in batches]
        rt.flush()
    assert got == pytest.approx(want, rel=1e-5)
    for name, p in state.parameters_fp32().items():
        assert torch.allclose(p, ref[name].float(), rtol=1e-5, atol=1e-6), name


def test_cuda_issuing_never_blocks_the_issuer_on_host_work():
    """Staleness 1, steps back to back, rounds of 2: uploads wait for COPYs and gradient downloads for their
    staging buffer (host work). The old CUDA issuing blocked the issuer there (issue_waits); the backlog
    queues those waits behind the stream instead (deferred_waits), and the issuer never blocks. With the new
    issuing, the accumulate lane starts only once the first G that waits for a staging ring buffer is issued."""
    graph = _graph()
    prog = _program(graph, PLAN3, 3, 6, 1, round_size=3)
    counts = {}
    for backend in ("host-cuda-old", "host-cuda"):
        state = HostState.from_graph(graph, optimizer=OPT)
        with Runtime(graph, prog, state, backend=backend, timeout=20, lane_delay=_slow_transfers(1)) as rt:
            if backend == "host-cuda":  # (the old issuing blocks there, until the lane frees the buffer)
                gate, plan = threading.Event(), rt.host.plan
                rt.host.lanes["accumulate"].submit(gate.wait)
                first = plan.units[plan.k].chunks[0]  # waits for unit 0's accumulation
                opener = threading.Thread(target=lambda: (rt.board.get((0, first), 0, "the test"), gate.set()))
                opener.start()
            for s in range(3):
                rt.step(_batch(s, 6))
            rt.flush()
            counts[backend] = [sum(rt.stats_of(t)[k] for t in range(3)) for k in ("issue_waits", "deferred_waits")]
    assert counts["host-cuda-old"][0] > 0 and counts["host-cuda-old"][1] == 0, counts
    assert counts["host-cuda"][0] == 0 and counts["host-cuda"][1] > 0, counts
