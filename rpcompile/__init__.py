"""rpcompile: a torch.fx compiler for RoundPipe-style training on consumer GPUs.

The pipeline (see docs and DESIGN): trace -> shard_lm_head -> estimate_costs ->
partition -> emit -> verify -> runtime. Importing the package touches no device.
"""
from rpcompile.costs import CostTable
from rpcompile.plan import StagePlan

__all__ = ["CostTable", "StagePlan"]
