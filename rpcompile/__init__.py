"""rpcompile: a torch.fx compiler for RoundPipe-style training on consumer GPUs.

The pipeline: trace -> shard_lm_head -> estimate_costs -> partition -> emit ->
verify -> runtime. Importing the package touches no device.

    >>> import rpcompile
    >>> c = rpcompile.compile(model, gpus=8, example=batch)   # doctest: +SKIP
"""
from rpcompile.costs import CostTable
from rpcompile.graph import Layer, LayerGraph, Value
from rpcompile.hardware import Hardware
from rpcompile.optim import SGD, AdamW
from rpcompile.plan import StagePlan
from rpcompile.program import Instr, Op, Program, ProgramError
from rpcompile.passes.symbolic import SeqLenLimit, max_seq_len  # noqa: E402 - passes import the IR types above
from rpcompile.api import Compiled, compile, load  # noqa: E402
from rpcompile.cli import finetune  # noqa: E402 - the fine-tuning command as a function
from rpcompile import checkpoint, passes, runtime  # noqa: E402,F401 - submodules as attributes

__all__ = ["compile", "load", "Compiled", "LayerGraph", "Layer", "Value", "CostTable", "StagePlan", "Program",
           "Instr", "Op", "ProgramError", "Hardware", "AdamW", "SGD", "max_seq_len", "SeqLenLimit", "finetune"]
