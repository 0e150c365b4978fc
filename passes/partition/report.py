"""A plan's report: its stage times and memory, t_max, iteration time and bubble under one cost table.

The report is IR (`rpcompile.ir.plan.PlanReport`, plain data that prints as a
table); making one times the plan with `iteration_time`, so it is a pass.

    >>> from rpcompile.ir.costs import CostTable
    >>> c = CostTable.from_lists([1.0] * 4, [2.0] * 4)
    >>> r = describe_plan(StagePlan.from_str("3|1|3"), c, gpus=1, microbatches=2)
    >>> r.t_max, r.iteration_time
    (9.0, 30.0)
"""
from __future__ import annotations

from dataclasses import replace

from rpcompile.ir.costs import CostTable
from rpcompile.ir.plan import PlanReport, StagePlan
from rpcompile.passes.partition.timing import iteration_time

__all__ = ["describe_plan", "with_report"]


def describe_plan(plan: StagePlan, costs: CostTable, *, gpus: int, microbatches: int, round_size: int | None = None,
                  staleness: int = 0, memory_budget: int | None = None, note: str = "") -> PlanReport:
    """Evaluate `plan` under `costs`: stage times and memory, t_max, iteration time, bubble.

    Args:
        plan: the stage plan.
        costs: the cost table.
        gpus, microbatches, round_size, staleness: as for `iteration_time`.
        memory_budget: device bytes per worker, shown in the table (None: no limit).
        note: a line printed under the table (why this plan was chosen, where it is not the partitioner's).
    Returns:
        A PlanReport; `str()` of it is the table.
    """
    times = plan.stage_times(costs)
    t = iteration_time(plan, costs, gpus=gpus, microbatches=microbatches, round_size=round_size,
                       staleness=staleness)
    bubble = 1.0 - microbatches * sum(times) / (gpus * t) if t > 0 else 0.0  # as `bubble_ratio`
    return PlanReport(
        stages=plan.stages, times=times, memory=plan.stage_memory(costs, gpus=gpus), t_max=max(times),
        iteration_time=t, bubble_ratio=bubble,
        gpus=gpus, microbatches=microbatches, staleness=staleness, memory_budget=memory_budget, note=note)


def with_report(plan: StagePlan, costs: CostTable, **kwargs) -> StagePlan:
    """A copy of `plan` carrying `describe_plan(plan, costs, **kwargs)`, so that `print(plan)` shows the table."""
    return replace(plan, report=describe_plan(plan, costs, **kwargs))
