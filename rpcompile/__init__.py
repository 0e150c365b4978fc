"""rpcompile: a torch.fx compiler for RoundPipe-style training on consumer GPUs.

The pipeline: trace -> shard_lm_head -> estimate_costs -> partition -> emit ->
verify -> runtime. Importing the package touches no device.

    >>> import rpcompile
    >>> c = rpcompile.compile(model, gpus=8)   # checks the arguments   # doctest: +SKIP
    >>> loss = c.step(batch)                    # plans for this batch, then trains   # doctest: +SKIP
"""
import gc as _gc
import sys as _sys


def _short_command(argv: list[str]) -> bool:
    """Whether `argv` (an interpreter's `sys.orig_argv`) runs `python [options] -m rpcompile plan|simulate ...`."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-m"):  # `-m rpcompile` or `-mrpcompile`
            rest = ([arg[2:]] if len(arg) > 2 else []) + argv[i + 1:]
            return rest[:1] == ["rpcompile"] and rest[1:2] in (["plan"], ["simulate"])
        if arg in ("-X", "-W", "--check-hash-based-pycs"):  # an option whose value is the next argument
            i += 2
            continue
        if arg == "-" or arg.startswith("-c") or not arg.startswith("-"):  # `-c`, stdin or a script runs instead
            return False
        i += 1
    return False


# `python -m rpcompile plan` / `simulate` run without cyclic garbage collection (`__main__` says why). `-m` imports
# this package, and with it torch, before `__main__` runs: decided here, that import is ~0.3 s shorter too
if _short_command(getattr(_sys, "orig_argv", [])):
    _gc.disable()

from rpcompile.ir.costs import CostTable  # noqa: E402
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
