"""Findings of the review of the runtime's CUDA path (issue 22) that the host backend can show.

Each test names its finding; each failed on the code before its fix.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import models  # noqa: E402 - tests/ is on sys.path (pytest rootdir)
import rpcompile


_MLP = models.LossMLP


def _xy(seed: int, nan: bool = False):
    x, y = models.xy(seed)
    if nan:
        x[:, 3] = float("nan")  # every microbatch: the loss step() returns is NaN
    return x, y


@pytest.mark.parametrize("staleness", [0, 1])
def test_1m_a_nan_loss_raises_from_the_step_that_returns_it(staleness):
    with rpcompile.compile(_MLP(), gpus=2, example=_xy(0), microbatches=2, staleness=staleness, backend="host",
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


# -- 1l: a microbatch's loss buffer goes back to the pool when its loss is read, not at the commit ------------
def _llama_runtime_parts():
    import models
    from rpcompile.ir.costs import CostTable
    from rpcompile.ir.plan import StagePlan
    from rpcompile.passes import emit, trace
    graph = trace(models.llama(), models.lm_batch(batch=4, seq=8, seed=0))
    n = len(graph.layers)
    prog = emit(StagePlan.from_sizes([n - 1], 1, [n - 1]), gpus=1, microbatches=2, round_size=2, staleness=1,
                costs=CostTable.from_lists(fwd=[1e-3] * n, bwd=[2e-3] * n))
    return graph, prog  # one round: the round's own gradient staging never waits for the gated accumulate


def test_1l_the_next_steps_loss_does_not_wait_for_this_steps_commit():
    import threading

    import models
    from rpcompile.runtime.executor import Runtime
    from rpcompile.runtime.host.optimizer import HostState
    graph, prog = _llama_runtime_parts()

    def run(gated: bool) -> tuple[list[float], dict]:
        state = HostState.from_graph(graph, optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach"))
        gate, armed = threading.Event(), threading.Event()
        add = state.accumulate_grad

        def held(name, part):  # once armed, the gradients reach the host only after the test lets them
            if armed.is_set():
                assert gate.wait(30)
            add(name, part)

        state.accumulate_grad = held
        batch = lambda s: models.lm_batch(batch=4, seq=8, seed=s)  # noqa: E731
        with Runtime(graph, prog, state, backend="host", timeout=8) as rt:
            losses = [rt.step(batch(0))]  # warm-up: its loss buffers are not yet the persistent ones
            rt.flush()
            if gated:
                armed.set()  # iteration 1 cannot commit until the gate opens
            losses.append(rt.step(batch(1)))
            # staleness 1: step 2 reads the weights of update 0 and needs nothing of iteration 1's commit;
            # its loss downloads reuse iteration 1's loss buffers
            losses.append(rt.step(batch(2)))
            armed.clear(), gate.set()
            losses.append(rt.step(batch(3)))
            rt.flush()
        return losses, state.parameters_fp32()

    gated, free = run(True), run(False)
    assert gated[0] == free[0]
    assert all(torch.equal(gated[1][n], free[1][n]) for n in free[1])


# -- 1h: a worker's device generator is handed only to random ops on its own device --------------------------
class _DeviceGenerator:
    """Stands for a CUDA worker's generator on this CPU machine: a CPU op handed it fails, as torch's does."""

    device = torch.device("cuda", 0)

    def manual_seed(self, seed: int) -> "_DeviceGenerator":
        return self


def test_1h_a_cpu_random_op_in_a_device_workers_layer_gets_a_cpu_generator_seeded_alike():
    from rpcompile.runtime.rng import WorkerRandom
    x = torch.ones(64)

    def drop(seed: int) -> torch.Tensor:
        with WorkerRandom(_DeviceGenerator(), seed):  # before the fix: the fake reached bernoulli_ and raised
            return torch.nn.functional.dropout(x, 0.5) + torch.rand(64) + torch.randn_like(x)

    a, b, c = drop(3), drop(3), drop(4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    with WorkerRandom(torch.Generator(), 3):  # a CPU worker's own generator, seeded alike: the same draws
        assert torch.equal(torch.nn.functional.dropout(x, 0.5) + torch.rand(64) + torch.randn_like(x), a)


class _Dropped(nn.Module):
    """Two blocks, dropout in the first only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)), nn.Sequential(nn.Linear(8, 8))])
        self.head = nn.Linear(8, 1)

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return nn.functional.mse_loss(self.head(x), y)


def test_1h_only_layers_that_draw_random_numbers_run_under_the_dispatch_mode(monkeypatch):
    from rpcompile.passes import trace
    from rpcompile.runtime import rng, stage_exec
    graph = trace(_Dropped(), _xy(0))
    drawing = stage_exec.random_layers(graph)
    assert drawing == {i for i, lay in enumerate(graph.layers) if lay.name == "blocks.0"}, [l.name for l in graph.layers]
    seen = []
    enter = rng.WorkerRandom.__enter__
    monkeypatch.setattr(rng.WorkerRandom, "__enter__", lambda self: (seen.append(self.seed), enter(self))[1])
    runner = stage_exec.LayerRunner(graph, torch.device("cpu"), 0, torch.Generator())
    params = {n: p.detach() for n, p in _Dropped().named_parameters()}
    env = dict(zip(graph.inputs, _xy(0)))
    for lay in graph.layers:
        runner.run_layer(lay.index, {p: params[p] for p in lay.params}, env, 0, 0)
    assert len(seen) == len(drawing) == 1


# -- 1g: only CUDA values are record_stream'ed on download ----------------------------------------------------
def test_1g_a_cpu_value_from_a_download_is_not_record_streamed():
    from rpcompile.runtime.streams.values import keep_for

    class _Stream:
        stream = None  # a CUDA stream in the runtime; never reached for a CPU value

    with pytest.raises((NotImplementedError, RuntimeError, TypeError)):
        torch.ones(2).record_stream(_Stream.stream)  # what the download did for every value
    keep_for(torch.ones(2), _Stream())  # a CPU value (e.g. a loss kept on the host): nothing to record


# -- 1e / 1c: step() copies its batch: changing it in place after step returns does not change what trains ---
def test_1e_a_batch_changed_in_place_after_step_returns_trains_as_given():
    from rpcompile.ir.costs import CostTable
    from rpcompile.ir.plan import StagePlan
    from rpcompile.passes import emit, trace
    from rpcompile.runtime.executor import Runtime
    from rpcompile.runtime.host.optimizer import HostState
    graph = trace(_MLP(), _xy(0))
    n = len(graph.layers)
    prog = emit(StagePlan.from_sizes([n - 1], 1, [n - 1]), gpus=2, microbatches=2, staleness=1,
                costs=CostTable.from_lists(fwd=[1e-3] * n, bwd=[2e-3] * n))
    slow = lambda w, lane, label: 0.05 if lane == "act_up" else 0.0  # noqa: E731 - uploads run late

    def run(scribble: bool) -> dict:
        state = HostState.from_graph(graph, optimizer=rpcompile.SGD(lr=0.1, impl="foreach"))
        with Runtime(graph, prog, state, backend="host", lane_delay=slow, timeout=20) as rt:
            for s in range(3):
                x, y = _xy(s)
                rt.step((x, y))
                if scribble:  # the caller reuses its batch tensors at once (a data loader's buffer)
                    x.fill_(100.0), y.fill_(-100.0)
            rt.flush()
        return state.parameters_fp32()

    got, want = run(True), run(False)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_1e_cuda_workers_refuse_a_pageable_host_state():
    from rpcompile.passes import trace
    from rpcompile.runtime.executor import check_pinned
    from rpcompile.runtime.host.optimizer import HostState
    state = HostState.from_graph(trace(_MLP(), _xy(0)), optimizer=rpcompile.SGD(lr=0.1))  # pin_memory=False
    check_pinned(state, "host")  # host workers read it in place
    with pytest.raises(ValueError, match=r"not pinned .*pin_memory=True"):
        check_pinned(state, "cuda")
