"""CostTable: from_lists/to_lists round trip, validation, text view, totals."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpcompile import CostTable

times = st.floats(min_value=0, max_value=1e3, allow_nan=False, allow_infinity=False)
sizes = st.integers(min_value=0, max_value=2 ** 40)


@st.composite
def tables(draw):
    n = draw(st.integers(min_value=1, max_value=8))
    lists = {k: draw(st.lists(times, min_size=n, max_size=n)) for k in ("fwd", "bwd")}
    for k in ("param_bytes", "grad_bytes", "act_bytes", "saved_bytes", "peak_bytes"):
        lists[k] = draw(st.lists(sizes, min_size=n, max_size=n))
    if draw(st.booleans()):
        lists["fwd_flops"] = draw(st.lists(times, min_size=n, max_size=n))
        lists["bwd_flops"] = draw(st.lists(times, min_size=n, max_size=n))
    lists["names"] = [f"layer{i}" for i in range(n)]
    return lists


@settings(max_examples=50, deadline=None)
@given(tables())
def test_from_lists_round_trips_through_to_lists(lists):
    t = CostTable.from_lists(**lists)
    back = t.to_lists()
    assert CostTable.from_lists(**back) == t
    for k, v in lists.items():
        assert back[k] == list(v)


def test_missing_lists_are_zeros_and_names_default():
    t = CostTable.from_lists(fwd=[1.0, 2.0], bwd=[2.0, 4.0])
    assert t.names == ("L0", "L1") and t.param_bytes == (0, 0) and t.fwd_flops is None
    assert t.num_layers == len(t) == 2


@pytest.mark.parametrize("bad", [dict(fwd=[1.0], bwd=[1.0, 2.0]), dict(fwd=[-1.0], bwd=[1.0]),
                                 dict(fwd=[math.nan], bwd=[1.0]), dict(fwd=[1.0], bwd=[1.0], param_bytes=[1, 2])])
def test_bad_lists_raise_naming_the_field(bad):
    with pytest.raises(ValueError, match="CostTable"):
        CostTable.from_lists(**bad)


def test_str_is_a_table_with_totals_and_flops():
    t = CostTable.from_lists([1e-3, 2e-3], [2e-3, 4e-3], param_bytes=[1024, 2048], names=["emb", "head"],
                             fwd_flops=[1e9, 3e9], bwd_flops=[2e9, 6e9])
    text = str(t)
    assert "emb" in text and "head" in text and "total" in text
    assert "3.000 ms" in text and "6.000 ms" in text and "3.0 KiB" in text and "4.00 G" in text


def test_totals_sums_every_known_column():
    t = CostTable.from_lists([1, 2], [3, 4], act_bytes=[5, 6])
    tot = t.totals()
    assert tot["fwd"] == 3 and tot["bwd"] == 7 and tot["act_bytes"] == 11 and "fwd_flops" not in tot
