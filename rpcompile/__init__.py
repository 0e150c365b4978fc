"""rpcompile: a torch.fx compiler for RoundPipe-style training on consumer GPUs.

The pipeline: trace -> shard_lm_head -> estimate_costs -> partition -> emit ->
verify -> runtime. Importing the package touches no device.

    >>> import rpcompile
    >>> c = rpcompile.compile(model, gpus=8)   # checks the arguments   # doctest: +SKIP
    >>> loss = c.step(batch)                    # plans for this batch, then trains   # doctest: +SKIP
"""
from rpcompile.ir.costs import CostTable
from rpcompile.ir.graph import Layer, LayerGraph, Value
from rpcompile.ir.hardware import Hardware
from rpcompile.ir.optim import SGD, AdamW, DynamicLossScale
from rpcompile.ir.plan import StagePlan
from rpcompile.ir.program import Instr, Op, Program, ProgramError
from rpcompile.passes.cost.seqlen import SeqLenLimit, max_seq_len
from rpcompile.api import Compiled, compile  # noqa: E402
from rpcompile.machine import measure_hardware  # noqa: E402
from rpcompile.resume import load  # noqa: E402
from rpcompile import finetune  # noqa: E402 - the fine-tuning library; callable: rpcompile.finetune(config)
from rpcompile import checkpoint, passes, runtime  # noqa: E402,F401 - submodules as attributes

__all__ = ["compile", "load", "Compiled", "LayerGraph", "Layer", "Value", "CostTable", "StagePlan", "Program",
           "Instr", "Op", "ProgramError", "Hardware", "measure_hardware", "AdamW", "SGD", "DynamicLossScale", "max_seq_len", "SeqLenLimit",
           "finetune"]
