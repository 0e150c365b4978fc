"""Faults: an exception in a worker, lane or the optimizer reaches the caller fast, state is kept, next call works."""
from __future__ import annotations

import sys
import time

import pytest
import torch
from torch import nn

import models  # noqa: E402
import rpcompile  # noqa: E402
from rpcompile import AdamW, StagePlan  # noqa: E402
from rpcompile.passes import emit, trace  # noqa: E402
from rpcompile.ir.program import Op  # noqa: E402
from rpcompile.runtime.executor import Runtime, RuntimeFailure  # noqa: E402
from rpcompile.runtime.host.buffers import transfer_bytes  # noqa: E402
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


def _runtime(graph, staleness: int, dtype: torch.dtype | None = None, **kw):
    state = HostState.from_graph(graph, optimizer=AdamW(lr=1e-2), dtype=dtype)
    prog = emit(StagePlan.from_str(PLAN), gpus=GPUS, microbatches=MBS, staleness=staleness)
    return Runtime(graph, prog, state, backend="host", timeout=20, **kw), state


BATCHES = [models.lm_batch(batch=4, seq=8, seed=s) for s in range(4)]


def clean_snapshots(rt: Runtime, state) -> tuple[dict, dict]:
    """(`_snapshot` after BATCHES[0:2], after BATCHES[0:4]) of a run that never fails, flushed at each."""
    with rt:
        rt.step(BATCHES[0]), rt.step(BATCHES[1])
        rt.flush()
        want = _snapshot(state)
        rt.step(BATCHES[2]), rt.step(BATCHES[3])
        rt.flush()
        return want, _snapshot(state)


def fail_iteration_2(rt: Runtime) -> tuple[RuntimeFailure, float]:
    """Iterations 0 and 1 (no flush: iteration 1's steps may still be in flight), then 2 with `Boom` armed:
    (the RuntimeFailure it raised, seconds from its start until then)."""
    rt.step(BATCHES[0]), rt.step(BATCHES[1])
    Boom.armed["on"] = True
    t0 = time.perf_counter()
    try:
        with pytest.raises(RuntimeFailure) as err:  # step returns with the loss: the backward tail may
            rt.step(BATCHES[2])                     # fail after it; the next call raises it
            rt.flush()
    finally:
        Boom.armed["on"] = False
    return err.value, time.perf_counter() - t0


@pytest.mark.parametrize("staleness, dtype", [(0, None), (1, None), (1, torch.bfloat16)])
def test_backward_fault_keeps_last_completed_step(staleness, dtype):
    """Layer 2 raises in backward during iteration 2: raised in < 5 s naming the instruction (grid shown);
    masters, optimizer state, compute copies and grad buffers equal those after flush() of step 1; the next
    calls work and the run ends bit-identical to a run that never failed. (Staleness 1: the compute copies
    alternate between two buffers, and iteration 2 wrote neither before it failed; the copy pass with its undo
    copies, what sharded state runs, is tests/runtime/test_host_lanes.py's.)"""
    g = _graph()
    want, final = clean_snapshots(*_runtime(g, staleness, dtype))
    rt, state = _runtime(g, staleness, dtype, lane_delay=5)
    _inject(rt, 2, iteration=2)
    with rt:
        err, took = fail_iteration_2(rt)
        assert took < 5.0
        msg = str(err)
        assert err.iteration == 2 and (" B" in err.instr or " X" in err.instr)
        assert "injected backward fault" in msg and f">>{err.instr.split(' ', 1)[1]}<<" in msg
        _same(_snapshot(state), want)
        rt.step(BATCHES[2]), rt.step(BATCHES[3])
        rt.flush()
        _same(_snapshot(state), final)
        # the host buffers the abandoned work held were given up: the pool owns what admission counts
        assert rt.host_pool.reserved == transfer_bytes(g, rt.program).pool


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


# -- a non-finite loss raises from the step that returns it -------------------------------------------
def _xy(seed: int, nan: bool = False):
    """LossMLP's batch `seed`; with `nan`, every microbatch's loss is NaN."""
    x, y = models.xy(seed)
    if nan:
        x[:, 3] = float("nan")
    return x, y


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_nan_loss_raises_from_the_step_that_returns_it(staleness):
    with rpcompile.compile(models.LossMLP(), gpus=2, example=_xy(0), microbatches=2, staleness=staleness, backend="host",
                           optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach")) as c:
        c.step(_xy(0)), c.step(_xy(1))
        good = c.state_dict()["host"]
        with pytest.raises(FloatingPointError, match=r"step 2 .*last good step"):
            c.step(_xy(2, nan=True))  # no second call: this one raises
        assert c.steps == 2
        now = c.state.state_dict()
        for key in ("master", "compute"):
            assert all(torch.equal(now[key][n], good[key][n]) for n in good[key]), key
        assert torch.isfinite(torch.tensor(c.step(_xy(2))))  # iteration 2 again, with a good batch
        assert c.steps == 3


# -- a NaN gradient under a finite loss -------------------------------------------------------------------
class _Gate(nn.Module):
    """Linear + ReLU plus a term that is 0 where x[:, 0] == 0 but whose gradient there is 0 * inf = NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h, s = self.lin(x), x[:, :1]
        return torch.relu(h) + torch.sqrt(torch.abs(h * s)) * s


class _NanGradMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(_Gate(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 1))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.blocks(x), y)


def _gate_xy(seed: int, nan_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    if nan_grad:
        x[1, 0] = 0.0  # the loss stays finite, the gradient of blocks.0.lin is NaN
    return x, y


def test_the_nan_grad_batch_has_a_finite_loss_and_a_nan_gradient():
    m = _NanGradMLP()
    loss = m(*_gate_xy(2, nan_grad=True))
    loss.backward()
    assert torch.isfinite(loss) and torch.isnan(m.blocks[0].lin.weight.grad).any()


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_nan_gradient_under_a_finite_loss_raises_and_keeps_the_weights(staleness):
    with rpcompile.compile(_NanGradMLP(), gpus=2, example=_gate_xy(0), microbatches=2, staleness=staleness,
                           backend="host", optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach")) as c:
        c.step(_gate_xy(0)), c.step(_gate_xy(1))
        good = c.state_dict()["host"]  # flushed: the last good step applied
        with pytest.raises(FloatingPointError, match=r"step 2 .*non-finite gradient.*layer group 0"):
            loss = c.step(_gate_xy(2, nan_grad=True))  # the loss is finite: the commit check raises from the next call
            assert loss == loss and abs(loss) != float("inf")
            c.model()
        now = c.state.state_dict()
        for key in ("master", "compute"):
            assert all(torch.equal(now[key][n], good[key][n]) for n in good[key]), key
        for n, st in good["optim"].items():
            assert all(torch.equal(now["optim"][n][k], v) for k, v in st.items()), n
        assert c.steps == 2
        c.step(_gate_xy(2))  # a good batch trains on
        assert all(torch.isfinite(p).all() for p in c.model().parameters())


# -- non-finite values never reach the weights ----------------------------------------------------------------
def _xy_row_nan(seed: int, nan: bool = False):
    """LossMLP's batch `seed`; with `nan`, one input row holds a NaN."""
    x, y = models.xy(seed)
    if nan:
        x[1, 3] = float("nan")
    return x, y


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_nan_input_raises_and_keeps_the_last_good_weights(staleness):
    with rpcompile.compile(models.LossMLP(), gpus=2, example=_xy_row_nan(0), microbatches=2, staleness=staleness, backend="host",
                           optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach")) as c:
        c.step(_xy_row_nan(0)), c.step(_xy_row_nan(1))
        good = c.state_dict()["host"]  # flushed: the last good step applied
        with pytest.raises(FloatingPointError, match=r"step 2 .*layer group \d") as err:
            c.step(_xy_row_nan(2, nan=True))
            c.model()  # staleness 1: the check runs after step() returned; the next call raises it
        assert "last good step" in str(err.value)
        now = c.state.state_dict()
        for key in ("master", "compute"):
            assert all(torch.equal(now[key][n], good[key][n]) for n in good[key]), key
        assert c.steps == 2
        c.step(_xy_row_nan(2))  # the next good batch trains on
        assert all(torch.isfinite(p).all() for p in c.model().parameters())


def test_on_nonfinite_skip_skips_and_counts():
    with rpcompile.compile(models.LossMLP(), gpus=2, example=_xy_row_nan(0), microbatches=2, staleness=1, backend="host",
                           on_nonfinite="skip", optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach")) as c:
        c.step(_xy_row_nan(0))
        c.step(_xy_row_nan(1, nan=True))
        c.step(_xy_row_nan(2))
        m = c.model()
        assert c.skipped_steps == [1] and c.steps == 3
        assert all(torch.isfinite(p).all() for p in m.parameters())


def test_fp16_dynamic_loss_scaling_keeps_its_skip_and_lower():
    """With a DynamicLossScale the overflow is the scaler's to handle: it skips and halves, nothing raises."""
    from rpcompile.ir.optim import DynamicLossScale
    from rpcompile.passes import emit, trace
    from rpcompile.runtime.executor import Runtime
    from rpcompile.runtime.host.optimizer import HostState
    graph = trace(models.LossMLP(), _xy_row_nan(0))
    state = HostState.from_graph(graph, optimizer=rpcompile.SGD(lr=1e-2),
                                 loss_scale=DynamicLossScale(init_scale=1024.0, growth_interval=100))
    prog = emit(rpcompile.StagePlan.from_sizes([1] * (len(graph.layers) - 1), 1, [1] * (len(graph.layers) - 1)),
                gpus=2, microbatches=2, staleness=1)
    with Runtime(graph, prog, state, backend="host", timeout=20) as rt:
        rt.step(_xy_row_nan(0))
        rt.step(_xy_row_nan(1, nan=True))
        rt.step(_xy_row_nan(2))
        rt.flush()
    assert state.skipped == [1] and state.loss_scale == 512.0
    assert all(torch.isfinite(state.read(n)).all() for n in graph.params)
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
