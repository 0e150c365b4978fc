"""Glue that fails on meta runs for real on zero stand-ins (`props._Prop._run_fresh`): one zero expanded to the
meta value's shape (no memory: mask creation of a 16 x 2048 x 4096 batch allocated 256 MiB here), or dense zeros
when the op writes into its input or returns a view of it."""
from __future__ import annotations

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
