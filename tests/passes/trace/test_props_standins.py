"""Glue that fails on meta runs for real on zero stand-ins (`props._Prop._run_fresh`): one zero expanded to the
meta value's shape (no memory: mask creation of a 16 x 2048 x 4096 batch allocated 256 MiB here), or dense zeros
when the op writes into its input or returns a view of it."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

from rpcompile.passes.trace import props

SEEN: list[tuple] = []  # (function, device and strides of the value it read): a meta try, then stand-ins


def scaled_count(h):
    """Data-dependent (fails on meta): a fresh tensor shaped like `h`'s rows."""
    SEEN.append(("count", h.device.type, h.stride()))
    return torch.full(h.shape[:-1], int((h == 0).sum().item()), dtype=torch.long)


def bumped(h):
    """Writes into its input (fails on an expanded tensor): needs a dense stand-in."""
    SEEN.append(("bump", h.device.type, h.stride()))
    h = h.detach().add_(1)
    assert h.min().item() == 1  # data-dependent: fails on meta
    return h.sum(-1)


def first_row(h):
    """Data-dependent, returns a view of its input (an expanded stand-in's would repeat one element)."""
    SEEN.append(("row", h.device.type, h.stride()))
    assert h.abs().sum().item() == 0
    return h[0]


def _record(glue):
    """The propagated metadata of `glue(block(x))`, block a Linear on meta, x a real (3, 5, 8) input; and what
    the glue saw."""
    with torch.device("meta"):
        root = nn.Module()
        root.block = nn.Linear(8, 8)
    graph = fx.Graph()
    x = graph.placeholder("x")
    out = graph.call_function(glue, (graph.call_module("block", (x,)),))
    graph.output(out)
    SEEN.clear()
    record = props.propagate(root, graph, {"x": torch.zeros(3, 5, 8)}, {}, True)
    return record[out], list(SEEN)


def test_reading_glue_gets_an_expanded_zero() -> None:
    meta, seen = _record(scaled_count)
    assert meta == props.TMeta((3, 5), torch.long, False)
    assert seen == [("count", "meta", (40, 8, 1)), ("count", "cpu", (0, 0, 0))]  # meta fails; no dense call


def test_writing_glue_falls_back_to_dense_zeros() -> None:
    meta, seen = _record(bumped)
    assert meta == props.TMeta((3, 5), torch.float32, False)
    assert seen == [("bump", "meta", (40, 8, 1)), ("bump", "cpu", (0, 0, 0)), ("bump", "cpu", (40, 8, 1))]


def test_a_view_of_the_stand_in_is_redone_dense() -> None:
    meta, seen = _record(first_row)
    assert meta == props.TMeta((5, 8), torch.float32, True)
    assert seen == [("row", "meta", (40, 8, 1)), ("row", "cpu", (0, 0, 0)), ("row", "cpu", (40, 8, 1))]


def head(h, n: int):
    """Data-dependent; the first n elements of h's first row (a view)."""
    SEEN.append(("head", h.device.type, h.stride()))
    assert h.abs().sum().item() == 0
    return h[0, 0, :n]


@pytest.mark.parametrize("n, dense", [(1, False), (2, True)])
def test_only_a_view_that_repeats_an_element_is_redone(n: int, dense: bool) -> None:
    """One element repeats nothing: that view stands; two through a zero stride do (redone on dense zeros)."""
    meta, seen = _record(lambda h: head(h, n))
    assert meta == props.TMeta((n,), torch.float32, True)
    assert seen[1:] == [("head", "cpu", (0, 0, 0))] + ([("head", "cpu", (40, 8, 1))] if dense else [])


def scaled(h, x):
    """Data-dependent on the meta value h, and reads the real input x's values."""
    SEEN.append(("scaled", h.device.type, int(x.sum().item())))
    assert h.abs().sum().item() == 0
    return h[..., 0] * x.sum()


def test_real_values_beside_a_stand_in_stay_real() -> None:
    with torch.device("meta"):
        root = nn.Module()
        root.block = nn.Linear(8, 8)
    graph = fx.Graph()
    x = graph.placeholder("x")
    out = graph.call_function(scaled, (graph.call_module("block", (x,)), x))
    graph.output(out)
    SEEN.clear()
    record = props.propagate(root, graph, {"x": torch.ones(3, 5, 8)}, {}, True)
    assert record[out] == props.TMeta((3, 5), torch.float32, True)
    assert SEEN == [("scaled", "cpu", 120)]  # the meta try fails at .item(); then the input's ones, not zeros


class _Gate(nn.Module):
    """A module with real weights whose forward is data-dependent on its input."""

    def __init__(self, in_place: bool = False, data_dependent: bool = True) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.in_place, self.data_dependent = in_place, data_dependent

    def forward(self, h):
        SEEN.append(("gate", h.device.type, h.stride(), self.scale.device.type))
        if self.data_dependent:
            assert h.abs().sum().item() == 0
        if self.in_place:
            with torch.no_grad():  # the stand-in is a leaf that requires grad
                h.add_(1)  # fails on the expanded stand-in (one memory location written many times)
        return h * self.scale


def _gate_after_meta_block(gate: _Gate) -> props.TMeta:
    """The output metadata of `gate` called on a meta Linear's output (SEEN records its runs)."""
    with torch.device("meta"):
        root = nn.Module()
        root.block = nn.Linear(8, 8)
    root.gate = gate
    graph = fx.Graph()
    x = graph.placeholder("x")
    out = graph.call_module("gate", (graph.call_module("block", (x,)),))
    graph.output(out)
    SEEN.clear()
    return props.propagate(root, graph, {"x": torch.zeros(3, 5, 8)}, {}, True)[out]


def test_a_real_module_first_runs_on_meta_copies_of_its_weights() -> None:
    gate = _Gate(data_dependent=False)
    assert _gate_after_meta_block(gate) == props.TMeta((3, 5, 8), torch.float32, True)
    assert SEEN == [("gate", "meta", (40, 8, 1), "meta")]  # one run, nothing real touched
    assert torch.equal(gate.scale, torch.ones(8))


def test_a_real_module_runs_with_its_own_weights_on_a_stand_in() -> None:
    assert _gate_after_meta_block(_Gate()) == props.TMeta((3, 5, 8), torch.float32, True)
    assert SEEN == [("gate", "meta", (40, 8, 1), "meta"), ("gate", "cpu", (0, 0, 0), "cpu")]  # no dense run


def test_a_real_module_that_writes_into_its_input_runs_dense_with_its_own_weights() -> None:
    assert _gate_after_meta_block(_Gate(in_place=True)) == props.TMeta((3, 5, 8), torch.float32, True)
    assert SEEN == [("gate", "meta", (40, 8, 1), "meta"), ("gate", "cpu", (0, 0, 0), "cpu"),
                    ("gate", "cpu", (40, 8, 1), "cpu")]
