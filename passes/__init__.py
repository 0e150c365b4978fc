"""Compiler passes, in pipeline order; each is a pure function from one IR value to a new one.

    trace -> shard_lm_head -> estimate_costs -> partition (iteration_time, describe_plan) -> emit -> verify

The second layer of the package (ir < passes < runtime < driver < models, finetune < cli): passes
import only the IR and each other. One folder (or file) per pass, in pipeline order, each holding
its pass and the helpers only it uses:

    trace/       nn.Module + example -> LayerGraph (torch.fx)
    shard_head/  the LM head + loss as vocabulary shards, run in token chunks
    cost/        LayerGraph -> CostTable (measured or predicted), symbolic costs, max_seq_len, host bytes
    partition/   CostTable -> StagePlan: the search, its exact timing (`iteration_time`), its report
    codegen.py   StagePlan -> Program (`emit`)
    verify.py    Program -> Program, checked against the schedule's rules
    meta/        what trace, shard_head and cost share to run layers on the `meta` device
"""
from rpcompile.passes.trace import trace
from rpcompile.passes.shard_head import shard_lm_head
from rpcompile.passes.cost import estimate_costs
from rpcompile.passes.partition.timing import iteration_time
from rpcompile.passes.partition.report import describe_plan, with_report
from rpcompile.passes.partition import partition
from rpcompile.passes.codegen import emit
from rpcompile.passes.verify import verify

__all__ = ["trace", "shard_lm_head", "estimate_costs", "iteration_time", "describe_plan", "with_report", "partition",
           "emit", "verify"]
