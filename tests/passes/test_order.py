"""Happens-before (`passes.order.HappensBefore`): its vector clocks against a plain transitive closure, in C and
in Python."""
from __future__ import annotations

import random

import pytest
import torch

from happens import closure
from rpcompile import StagePlan
from rpcompile.ir.program import Lane
from rpcompile.passes import emit
from rpcompile.passes.order import HappensBefore


def _program(seed: int):
    rng = random.Random(seed)
    gpus = rng.choice([1, 2, 3, 4])
    fwd = [rng.randint(1, 3) for _ in range(rng.randint(1, 3))]
    plan = StagePlan.from_str(f"{','.join(map(str, fwd))}|1|{','.join(map(str, fwd[::-1]))}")
    return emit(plan, gpus=gpus, microbatches=gpus * rng.choice([1, 2]), staleness=rng.choice([0, 1]))


@pytest.mark.parametrize("kernel", ["1", "0"])
@pytest.mark.parametrize("seed", range(4))
def test_before_is_the_transitive_closure_of_refs_and_lane_order(seed, kernel, monkeypatch):
    """Every pair of instances in a window of three iterations (from logical iteration 0 and from 1, where Refs
    with `since` 1 apply at once): `before` says exactly what the closure says, with the clocks built in C
    and in Python."""
    monkeypatch.setenv("RPCOMPILE_ORDER_KERNEL", kernel)
    program = _program(seed)
    names = [i.name for i in program.instrs]
    for first in (0, 1):
        hb, before = HappensBefore(program, first=first, iterations=3), closure(program, 3, first)
        for b in before:
            for a in before:
                assert hb.before(a, b) == (a in before[b]), (first, a, b)


@pytest.mark.parametrize("seed", range(3))
def test_the_c_clocks_equal_the_python_ones(seed, monkeypatch):
    """The tensors `runtime.host.assign` reads (clock, lane, step) are the same built in C and in Python, for
    every lane and for the uploads' lanes alone."""
    program = _program(seed + 10)
    for track in (None, frozenset({Lane.ACT_UP})):
        monkeypatch.setenv("RPCOMPILE_ORDER_KERNEL", "1")
        c = HappensBefore(program, iterations=2, track=track)
        monkeypatch.setenv("RPCOMPILE_ORDER_KERNEL", "0")
        py = HappensBefore(program, iterations=2, track=track)
        for name in ("clock", "lane", "step"):
            assert torch.equal(getattr(c, name), getattr(py, name)), name


def test_before_refuses_a_first_instance_on_a_lane_it_does_not_track():
    program = _program(0)
    hb = HappensBefore(program, track=frozenset({Lane.ACT_UP}))
    f = next(i.name for i in program.instrs if i.lane is Lane.COMPUTE)
    with pytest.raises(ValueError, match="does not track"):
        hb.before((0, f), (0, program.instrs[-1].name))
