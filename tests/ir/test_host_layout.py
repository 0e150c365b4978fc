"""`shard_slices`: how a flat buffer is cut among the ranks that shard it (issue 49), against its docstring."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpcompile.ir.host_layout import shard_slices


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3000), st.integers(1, 9), st.integers(1, 40))
def test_the_slices_own_every_element_once_in_aligned_runs_of_near_equal_units(numel, world, align):
    got = shard_slices(numel, world, align=align)
    assert len(got) == world
    assert got[0][0] == 0 and got[-1][1] == numel  # in rank order, contiguous: every element owned once
    assert all(a[1] == b[0] for a, b in zip(got, got[1:])) and all(lo <= hi for lo, hi in got)
    assert all(lo % align == 0 for lo, hi in got if hi > lo)
    units = -(-numel // align)
    per, extra = divmod(units, world)
    for r, (lo, hi) in enumerate(got):  # the first units % world ranks one unit more; the last unit may be short
        first = r * per + min(r, extra)
        assert (lo, hi) == (min(numel, first * align), min(numel, (first + per + (r < extra)) * align)), (r, got)
    sizes = [hi - lo for lo, hi in got]
    assert max(sizes) - min(sizes) < 2 * align  # one unit, and the short last unit's shortfall


def test_one_rank_owns_everything_and_ranks_past_the_last_unit_own_nothing():
    assert shard_slices(40, 1) == [(0, 40)]
    assert shard_slices(3, 4, align=1) == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert shard_slices(0, 3) == [(0, 0)] * 3


@pytest.mark.parametrize("numel, world, align", [(10, 0, 16), (10, 2, 0), (-1, 2, 16)])
def test_bad_arguments_are_refused_naming_them(numel, world, align):
    with pytest.raises(ValueError, match=rf"got {numel}, {world}, {align}"):
        shard_slices(numel, world, align=align)
