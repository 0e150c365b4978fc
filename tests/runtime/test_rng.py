"""Per-worker randomness (runtime/stage/rng.py): a worker's generator reaches only the random ops that can use it,
and only layers that draw random numbers run under the dispatch mode (runtime/stage/runner.py)."""
from __future__ import annotations

import torch
from torch import nn

import models  # noqa: E402 - tests/ is on sys.path (pytest rootdir)


# -- a worker's device generator is handed only to random ops on its own device --------------------------
class _DeviceGenerator:
    """Stands for a CUDA worker's generator on this CPU machine: a CPU op handed it fails, as torch's does."""

    device = torch.device("cuda", 0)

    def manual_seed(self, seed: int) -> "_DeviceGenerator":
        return self


def test_a_cpu_random_op_in_a_device_workers_layer_gets_a_cpu_generator_seeded_alike():
    from rpcompile.runtime.stage.rng import WorkerRandom
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


def test_only_layers_that_draw_random_numbers_run_under_the_dispatch_mode(monkeypatch):
    from rpcompile.passes import trace
    from rpcompile.runtime.stage import rng, runner as runner_mod
    graph = trace(_Dropped(), models.xy(0))
    drawing = runner_mod.random_layers(graph)
    assert drawing == {i for i, lay in enumerate(graph.layers) if lay.name == "blocks.0"}, [l.name for l in graph.layers]
    seen = []
    enter = rng.WorkerRandom.__enter__
    monkeypatch.setattr(rng.WorkerRandom, "__enter__", lambda self: (seen.append(self.seed), enter(self))[1])
    runner = runner_mod.LayerRunner(graph, torch.device("cpu"), 0, torch.Generator())
    params = {n: p.detach() for n, p in _Dropped().named_parameters()}
    env = dict(zip(graph.inputs, models.xy(0)))
    for lay in graph.layers:
        runner.run_layer(lay.index, {p: params[p] for p in lay.params}, env, 0, 0)
    assert len(seen) == len(drawing) == 1


