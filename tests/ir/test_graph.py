"""Tests for the LayerGraph IR (rpcompile/ir/graph.py), built by hand from tiny fx modules."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx
from torch import nn

from rpcompile.ir.graph import Layer, LayerGraph, Value


class _Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h, x * 2


class _Mid(nn.Module):
    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.lin = shared

    def forward(self, a):
        return (torch.tanh(self.lin(a)),)


class _Loss(nn.Module):
    def forward(self, c, b):
        return ((c * b).mean(),)


def _value(name: str, shape: tuple[int, ...], kind: str = "activation", dtype=torch.float32) -> Value:
    numel = 1
    for d in shape:
        numel *= d
    return Value(name, shape, dtype, numel * dtype.itemsize, kind != "input", kind, 0 if shape else None)


@pytest.fixture()
def graph() -> tuple[LayerGraph, nn.Linear]:
    torch.manual_seed(0)
    split = _Split()
    mid = _Mid(split.lin)  # the same Linear in two layers: a shared parameter
    mods = [fx.symbolic_trace(m) for m in (split, mid, _Loss())]
    layers = (Layer(0, "split", ("x",), ("a", "b"), ("lin.weight", "lin.bias"), mods[0]),
              Layer(1, "mid", ("a",), ("c",), ("lin.weight", "lin.bias"), mods[1]),
              Layer(2, "loss", ("c", "b"), ("loss",), (), mods[2]))
    values = {"x": _value("x", (3, 4), "input"), "a": _value("a", (3, 4)), "b": _value("b", (3, 4)),
              "c": _value("c", (3, 4)), "loss": _value("loss", (), "loss")}
    params = {n: Value(n, tuple(p.shape), p.dtype, p.numel() * 4, True, "param") for n, p in split.named_parameters()}
    g = LayerGraph(layers, values, ("x",), "loss", {}, params, "tensor", dict(split.named_parameters()))
    return g, split.lin


def test_value_is_frozen_and_slotted() -> None:
    v = _value("h", (2, 3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.name = "g"  # type: ignore[misc]
    assert not hasattr(v, "__dict__")
    assert v.bytes == 24 and v.batch_dim == 0


def test_live_at_and_cut_bytes(graph) -> None:
    g, _ = graph
    assert [v.name for v in g.live_at(-1)] == ["x"]
    assert [v.name for v in g.live_at(0)] == ["a", "b"]
    assert [v.name for v in g.live_at(1)] == ["b", "c"]
    assert g.live_at(2) == ()
    assert g.cut_bytes(0) == 2 * 3 * 4 * 4
    with pytest.raises(IndexError):
        g.live_at(3)


def test_run_matches_eager_and_is_differentiable(graph) -> None:
    g, lin = graph
    x = torch.randn(3, 4)
    loss = g.run(x)
    ref = (torch.tanh(lin(lin(x))) * (x * 2)).mean()
    assert torch.equal(loss, ref)
    loss.backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


def test_run_other_batch_size(graph) -> None:
    g, lin = graph
    x = torch.randn(5, 4)
    assert torch.equal(g.run(x), (torch.tanh(lin(lin(x))) * (x * 2)).mean())


def test_param_owners_and_parameters(graph) -> None:
    g, lin = graph
    assert g.param_owners() == {"lin.weight": (0, 1), "lin.bias": (0, 1)}
    assert g.parameters()["lin.weight"] is lin.weight


def test_flatten_inputs_errors(graph) -> None:
    g, _ = graph
    with pytest.raises(ValueError, match="expected a tensor"):
        g.flatten_inputs({"x": torch.zeros(1)})
    dict_graph = dataclasses.replace(g, input_kind="dict")
    with pytest.raises(ValueError, match="'x' is missing"):
        dict_graph.flatten_inputs({"y": torch.zeros(1)})
    with pytest.raises(ValueError, match="'x' must be a tensor"):
        dict_graph.flatten_inputs({"x": 3})
    tuple_graph = dataclasses.replace(g, inputs=("arg0",), input_kind="tuple")
    assert set(tuple_graph.flatten_inputs((torch.zeros(1),))) == {"arg0"}


def test_str_is_a_table(graph) -> None:
    g, _ = graph
    text = str(g)
    for word in ("layer", "params", "param bytes", "inputs", "outputs", "split", "mid"):
        assert word in text
    assert "c, b" in text.splitlines()[-1]
