"""Compiler passes, in pipeline order; each is a pure function from one IR value to a new one.

    trace -> shard_lm_head -> estimate_costs -> partition (iteration_time, describe_plan) -> emit -> verify
"""
from rpcompile.passes.trace import trace
from rpcompile.passes.shard_head import shard_lm_head
from rpcompile.passes.cost import estimate_costs
from rpcompile.passes.timing import iteration_time
from rpcompile.passes.report import describe_plan, with_report
from rpcompile.passes.partition import partition
from rpcompile.passes.codegen import emit
from rpcompile.passes.verify import verify

__all__ = ["trace", "shard_lm_head", "estimate_costs", "iteration_time", "describe_plan", "with_report", "partition",
           "emit", "verify"]
