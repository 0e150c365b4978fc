"""Hypothesis strategies shared by the schedule tests."""
from hypothesis import strategies as st

from rpcompile import StagePlan


@st.composite
def compositions(draw, n):
    """A random composition of n into positive parts (stage sizes)."""
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    edges = [0] + cuts + [n]
    return [b - a for a, b in zip(edges, edges[1:])]


@st.composite
def plans(draw, layers):
    """Any valid StagePlan over `layers` layers: forward grouping x fused tail x backward grouping."""
    fused = draw(st.integers(1, layers))
    rest = layers - fused
    return StagePlan.from_sizes(draw(compositions(rest)) if rest else [], fused,
                                draw(compositions(rest)) if rest else [])
