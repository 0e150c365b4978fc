"""A stage's device bytes by term, and why no plan fits a memory budget (the message passes refuse with).

    >>> costs = CostTable.from_lists([1, 1], [1, 1], param_bytes=[4, 4], peak_bytes=[10, 1])
    >>> memory_refusal(costs, 16)[:58]
    "backward stage of layer 0 'L0' needs 18 B (18 bytes) > the"
"""
from __future__ import annotations

from rpcompile.ir.costs import CostTable
from rpcompile.ir.plan import StagePlan

__all__ = ["stage_terms", "memory_refusal"]

_COLUMNS = (("workspace (saved tensors + backward transients)", "peak_bytes"),
            ("parameters (own + prefetched)", "param_bytes"), ("gradients", "grad_bytes"),
            ("saved input (current + next microbatch)", "saved_bytes"),
            ("activations and their gradients in flight", "act_bytes"))


def _gib(n: float) -> str:
    """Bytes in GiB, MiB or KiB with one decimal (B below 1 KiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:.0f} B"



def _only(costs: CostTable, column: str) -> CostTable:
    """`costs` with every memory column but `column` zeroed."""
    lists = costs.to_lists()
    for _, f in _COLUMNS:
        if f != column:
            lists[f] = [0] * costs.num_layers
    return CostTable.from_lists(**lists)


def stage_terms(costs: CostTable, plan: StagePlan, i: int) -> tuple[str, list[tuple[str, int]]]:
    """What stage i of `plan` is ("backward stage of layer 3 'model.layers.2'") and its bytes by term.

    The terms are `StagePlan.stage_memory` of tables holding one memory column each (it is a sum
    of those columns), largest first.

    >>> costs = CostTable.from_lists([1, 1], [1, 1], param_bytes=[4, 4], peak_bytes=[10, 1])
    >>> stage_terms(costs, StagePlan.from_str("1|1|1"), 2)[1][0]
    ('workspace (saved tensors + backward transients)', 10)
    """
    st = plan.stages[i]
    kind = {"F": "forward", "FB": "fused", "B": "backward"}.get(st.kind.value, st.kind.value)
    terms = sorted(((name, plan.stage_memory(_only(costs, f))[i]) for name, f in _COLUMNS), key=lambda t: -t[1])
    return f"{kind} stage of layer {st.layers.start} {costs.names[st.layers.start]!r}", terms


def memory_refusal(costs: CostTable, memory_budget: int) -> str | None:
    """Why no plan fits `memory_budget`: the one-layer stage that does not fit, its bytes by term; None if all fit.

    With one layer per stage every stage holds the least it can, so a stage that does not fit then
    cannot fit in any plan. Meant for the error of a pass that refuses the run.

    >>> costs = CostTable.from_lists([1, 1], [1, 1], param_bytes=[4, 4], peak_bytes=[10, 1])
    >>> memory_refusal(costs, 16)[:58]
    "backward stage of layer 0 'L0' needs 18 B (18 bytes) > the"
    """
    n = costs.num_layers
    plan = StagePlan.from_sizes([1] * (n - 1), 1, [1] * (n - 1))
    need = plan.stage_memory(costs)
    i = max(range(len(need)), key=need.__getitem__)
    if need[i] <= memory_budget:
        return None
    where, terms = stage_terms(costs, plan, i)
    parts = ", ".join(f"{name} {_gib(b)}" for name, b in terms if b)
    return (f"{where} needs {_gib(need[i])} ({need[i]} bytes) > the memory budget {_gib(memory_budget)}: "
            f"{parts}")
