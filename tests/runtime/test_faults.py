"""Faults: an exception in a worker, lane or the optimizer reaches the caller fast, state is kept, next call works."""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch

import models  # noqa: E402
from rpcompile import AdamW, StagePlan  # noqa: E402
from rpcompile.passes import emit, trace  # noqa: E402
from rpcompile.ir.program import Op  # noqa: E402
from rpcompile.runtime.executor import Runtime, RuntimeFailure  # noqa: E402
from rpcompile.runtime.host.optimizer import HostState  # noqa: E402

PLAN, GPUS, MBS = "2,2|1|1,3", 2, 4  # llama: 5 layers; layer 2 is recomputed in B stage "1,3"'s second slot


class Boom(torch.autograd.Function):
    """Identity whose backward raises while `armed["on"]`."""

    armed = {"on": False}

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if Boom.armed["on"]:
            raise RuntimeError("injected backward fault")
        return g


def _graph():
    return trace(models.llama(), models.lm_batch(batch=4, seq=8))


def _inject(rt: Runtime, layer: int, iteration: int) -> None:
    """Route `layer`'s outputs in `iteration` through Boom on every worker (each runs its own module copies).

    Keyed by iteration, not by time: `step` returns with the loss while the previous iteration's backward
    stages may still run, so a global switch would also hit them.
    """
    for runner in rt.runners:
        def run_layer(index, params, env, it, mb, *rest, orig=runner.run_layer, graph=runner.graph):
            orig(index, params, env, it, mb, *rest)
            if index == layer and it == iteration:
                lay = graph.layers[index]
                for n in lay.outputs:
                    v = env[n]
                    if isinstance(v, torch.Tensor) and v.requires_grad:
                        env[n] = Boom.apply(v)
        runner.run_layer = run_layer


def _snapshot(state: HostState) -> dict:
    sd = state.state_dict()
    return {"master": sd["master"], "compute": sd["compute"], "optim": sd["optim"], "steps": sd["steps"],
            "grad": {n: (None if g is None else g.clone()) for n in state.grad for g in [state.grad_of(n)]}}


def _same(a: dict, b: dict) -> None:
    assert a["steps"] == b["steps"]
    for key in ("master", "compute", "grad"):
        for n in a[key]:
            x, y = a[key][n], b[key][n]
            assert (x is None and y is None) or torch.equal(x, y), f"{key}[{n}] differs"
    for n in a["optim"]:
        for k, v in a["optim"][n].items():
            assert torch.equal(v, b["optim"][n][k]) if isinstance(v, torch.Tensor) else v == b["optim"][n][k]


def _runtime(graph, staleness: int, **kw):
    state = HostState.from_graph(graph, optimizer=AdamW(lr=1e-2))
    prog = emit(StagePlan.from_str(PLAN), gpus=GPUS, microbatches=MBS, staleness=staleness)
    return Runtime(graph, prog, state, backend="host", timeout=20, **kw), state


BATCHES = [models.lm_batch(batch=4, seq=8, seed=s) for s in range(4)]


@pytest.mark.parametrize("staleness", [0, 1])
def test_backward_fault_keeps_last_completed_step(staleness):
    """Layer 2 raises in backward during iteration 2: raised in < 5 s naming the instruction (grid shown);
    masters, optimizer state, compute copies and grad buffers equal those after flush() of step 1; the next
    calls work and the run ends bit-identical to a run that never failed."""
    g = _graph()
    clean, s_clean = _runtime(g, staleness)
    with clean:
        clean.step(BATCHES[0]), clean.step(BATCHES[1])
        clean.flush()
        want = _snapshot(s_clean)
        clean.step(BATCHES[2]), clean.step(BATCHES[3])
        clean.flush()
        final = _snapshot(s_clean)
    rt, state = _runtime(g, staleness, lane_delay=5)
    _inject(rt, 2, iteration=2)
    with rt:
        rt.step(BATCHES[0]), rt.step(BATCHES[1])  # no flush: iteration 1's steps may still be in flight
        Boom.armed["on"] = True
        t0 = time.perf_counter()
        try:
            with pytest.raises(RuntimeFailure) as err:  # step returns with the loss: the backward tail may
                rt.step(BATCHES[2])                     # fail after it; the next call raises it
                rt.flush()
        finally:
            Boom.armed["on"] = False
        assert time.perf_counter() - t0 < 5.0
        msg = str(err.value)
        assert err.value.iteration == 2 and (" B" in err.value.instr or " X" in err.value.instr)
        assert "injected backward fault" in msg and f">>{err.value.instr.split(' ', 1)[1]}<<" in msg
        _same(_snapshot(state), want)
        rt.step(BATCHES[2]), rt.step(BATCHES[3])
        rt.flush()
        _same(_snapshot(state), final)


def test_lane_fault_in_transfer():
    """An exception in a transfer lane (a gradient download) is re-raised naming that G instruction."""
    g = _graph()
    rt, state = _runtime(g, 1)
    with rt:
        rt.step(BATCHES[0])
        orig = rt.handlers[Op.GRAD_DOWN]
        calls = {"n": 0}

        def bad(t, ins, w):
            calls["n"] += 1
            if calls["n"] == 2:
                raise OSError("link down")
            return orig(t, ins, w)

        rt.handlers[Op.GRAD_DOWN] = bad
        with pytest.raises(RuntimeFailure, match=r"G\d\.r\d\.c\d.*link down"):
            rt.step(BATCHES[1])
            rt.flush()
        rt.handlers[Op.GRAD_DOWN] = orig
        rt.step(BATCHES[1])
        rt.flush()


def test_optimizer_fault_reraised_and_next_call_works():
    """An optimizer exception (background, staleness 1) is re-raised by the next call; nothing hangs."""
    g = _graph()
    rt, state = _runtime(g, 1)
    with rt:
        orig = state.step

        def bad(layer):
            if layer == 3:
                raise MemoryError("host OOM in step")
            return orig(layer)

        state.step = bad
        rt.step(BATCHES[0])
        t0 = time.perf_counter()
        with pytest.raises(RuntimeFailure, match=r"h O\.l3.*host OOM"):
            rt.flush()
        assert time.perf_counter() - t0 < 5.0
        state.step = orig
        rt.step(BATCHES[0])
        rt.flush()


def test_hang_is_reported_not_deadlocked():
    """A dependency that never completes becomes a failure after `timeout`, not a hang."""
    g = _graph()
    state = HostState.from_graph(g, optimizer=AdamW(lr=1e-2))
    prog = emit(StagePlan.from_str(PLAN), gpus=GPUS, microbatches=MBS, staleness=0)
    with Runtime(g, prog, state, backend="host", timeout=1.0) as rt:
        orig = rt.handlers[Op.ACT_DOWN]

        def slow(t, ins, w):
            if ins.stage == 0 and ins.mb == 1:
                time.sleep(2.0)
            return orig(t, ins, w)

        rt.handlers[Op.ACT_DOWN] = slow
        with pytest.raises(RuntimeFailure, match="waited"):
            rt.step(BATCHES[0])
        rt.handlers[Op.ACT_DOWN] = orig
        rt.step(BATCHES[0])


def test_an_interrupt_at_the_commit_point_leaves_the_iteration_committed_or_undone_never_both():
    """The optimizer lane is held inside iteration 1's commit point (after its abandoned check, before it
    records the commit) while the caller's interrupt of iteration 1 arrives: the interrupt must wait for the
    commit, then abandon only what follows. Events hold the threads, so the interleaving is the same each run."""
    import threading
    g = _graph()
    rt, state = _runtime(g, staleness=0)
    inside, go, failed = threading.Event(), threading.Event(), threading.Event()
    real = rt.ctx.failure.abandoned

    def abandoned(it):
        at_commit = (it == 1 and threading.current_thread() is rt.lanes["optimizer"] and not inside.is_set()
                     and sys._getframe(1).f_code.co_name == "_step_one")  # its check before recording the commit
        if at_commit:
            inside.set()
            go.wait(10)
        return real(it)
    rt.ctx.failure.abandoned = abandoned
    with rt:
        rt.step(BATCHES[0])
        rt.step(BATCHES[1])  # returns with its loss; iteration 1's commit runs on the optimizer lane
        assert inside.wait(10)
        caller = threading.Thread(target=lambda: (rt.host.fail_caller(1, KeyboardInterrupt()), failed.set()))
        caller.start()
        early = failed.wait(0.3)  # the caller's failure must not slip in while the commit is half done
        go.set()
        caller.join(10)
        with pytest.raises(KeyboardInterrupt):
            rt.flush()
        assert not early
        assert rt.t == rt.host.committed == 2  # iteration 1 committed and kept; only iteration 2 abandoned
        rt.step(BATCHES[2])
        rt.flush()
