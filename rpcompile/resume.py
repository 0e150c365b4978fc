"""load(): a checkpoint written by `Compiled.save` back into a Compiled that continues the run bit for bit.

    >>> c = rpcompile.load("run.ckpt", model)   # doctest: +SKIP
    >>> c.step(batch)                           # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from rpcompile import checkpoint
from rpcompile.api import Compiled
from rpcompile.options import Options, check_timeout
from rpcompile.pipeline import Frozen

__all__ = ["load"]


def load(path: str, model: torch.nn.Module, *, loss_fn: Callable | None = None, dist: Any = False,
         process_group: Any = None, timeout: float | None = None, shard_state: bool = False,
         microbatches: int | None = None, example: Any = None) -> Compiled:
    """Load a checkpoint written by `Compiled.save` and continue training `model` from it.

    The checkpoint records the compile options, the example batch and the
    compiler's measured decisions (head sharding, costs, plan, round size), so
    the same program is rebuilt without measuring anything; only `loss_fn`
    (code, not data) must be passed again if the run used one.

    Args:
        path: the checkpoint file.
        model: a module of the architecture the checkpoint was trained with (its weights are replaced).
        loss_fn: the run's loss_fn, if any.
        dist, process_group, shard_state: as for `compile` (every process loads the same file). A checkpoint of
            sharded state (W ranks' files) loads on any number of processes, sharded or not: each process reads
            the slices one at a time (`checkpoint.other_slices`) and keeps what it owns.
        timeout: as for `compile` (None: from the saved plan's costs); a checkpoint keeps none.
        microbatches, example: this process's microbatches per step and one of its batches, when they differ
            from the saved run's (data parallel over another number of processes, each with its share of the
            same global step): the run is planned afresh for them instead of rebuilding the saved plan.
    Returns:
        A Compiled whose next `step` continues the saved run (bit for bit with the saved microbatches).
    Raises:
        ValueError: the saved run does not fit this machine's host memory (the bytes by category), or
            the state does not match `model`.
    """
    if shard_state and not dist and process_group is None:
        raise ValueError("shard_state=True shards the host state over data-parallel processes: it needs dist=True "
                         "(or a process_group)")
    sd = checkpoint.load(path)
    opts = Options(**{**sd["options"], "loss_fn": loss_fn, "timeout": check_timeout(timeout)})
    frozen = Frozen(**sd["frozen"]) if "frozen" in sd else None  # the saved plan, not a re-measured one
    if microbatches is not None and microbatches != opts.microbatches:  # another share of the step: a new plan
        opts, frozen = dataclasses.replace(opts, microbatches=microbatches), None
    c = Compiled(model, opts, sd["example"] if frozen is not None or example is None else example, dist=dist,
                 process_group=process_group, frozen=frozen, resume=sd, shard_state=shard_state)
    try:
        c.load_state_dict(sd, slices=checkpoint.other_slices(path, sd))
    except BaseException:
        c.close()  # no worker thread outlives a failed load
        raise
    return c
