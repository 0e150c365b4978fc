"""Host-memory admission: refuse a run that does not fit the host before it starts, with the bytes named.

The bytes are counted by the `passes.cost.host_bytes` pass; the limit is the target
hardware's host memory, or this machine's RAM.

    >>> import torch
    >>> check_host_memory(torch.nn.Linear(1024, 1024), microbatches=4, dtype=torch.bfloat16, limit=2**20)
    Traceback (most recent call last):
    ...
    ValueError: host memory: the run needs 20.0 MiB (20992000 bytes: weights 2.0 MiB, fp32 masters 4.0 MiB, ...
"""
from __future__ import annotations

import dataclasses
from typing import Any

from rpcompile.ir import hardware as _hardware
from rpcompile.passes.cost import host_bytes as _pass
from rpcompile.passes.cost.host_bytes import HostBytes, _gib
from rpcompile.runtime.host.buffers import transfer_bytes

__all__ = ["check_host_memory", "HostBytes", "host_bytes"]


def host_bytes(model: Any, costs: Any = None, plan: Any = None, *, program: Any = None, assignment: Any = None,
               **kw: Any) -> HostBytes:
    """`passes.cost.host_bytes.host_bytes` (its arguments), plus with a traced graph and its `program` the
    runtime's transfer buffers (`HostBytes.buffers`: `runtime.host.buffers.transfer_bytes`, pinned with CUDA).

    With a program the saved stage inputs are those the runtime holds: buffers of the host arena, placed
    by the program's buffer assignment (`assignment`, or `runtime.host.assign.assign_buffers`), counted
    in `buffers` and `arena`; `activations` (the estimate without one) is then 0. What is counted is
    what the runtime allocates for that program.

    >>> import torch
    >>> host_bytes(torch.nn.Linear(2, 2), microbatches=1).buffers   # no program: none counted
    0
    """
    need = _pass.host_bytes(model, costs, plan, **kw)
    if program is None or not hasattr(model, "param_owners"):
        return need
    moved = transfer_bytes(model, program, kw.get("dtype"), assignment)
    return dataclasses.replace(need, activations=0, buffers=moved.total, arena=moved.arena)


def check_host_memory(model: Any, costs: Any = None, plan: Any = None, *, microbatches: int, staleness: int = 1,
                      optimizer: Any = None, dtype: Any = None, hardware: Any = None,
                      limit: int | None = None, gpus: int | None = None,
                      round_size: int | None = None, program: Any = None, assignment: Any = None,
                      shard: tuple[int, int] | None = None) -> HostBytes:
    """`host_bytes` of the run, raising unless it fits the host; returns it when it does.

    Args:
        model, costs, plan, microbatches, staleness, optimizer, dtype, gpus, round_size, program, assignment:
            as for `host_bytes` (with `program`, the runtime's transfer buffers count too).
        shard: (rank, world) of a run whose masters and optimizer moments are sharded over `world`
            data-parallel servers: what server `rank` holds is checked against its host (`host_bytes`).
        hardware: the target `Hardware`; its `host_memory` is the limit.
        limit: host bytes available, overriding the hardware's; with neither, this machine's physical RAM.
    Raises:
        ValueError: one line naming the bytes by category, the limit, and what to change.

    >>> import torch
    >>> check_host_memory(torch.nn.Linear(2, 2), microbatches=1, limit=2**20).total  # 6 fp32 elements x 24 B
    144
    """
    need = host_bytes(model, costs, plan, microbatches=microbatches, staleness=staleness, optimizer=optimizer,
                      dtype=dtype, gpus=gpus, round_size=round_size, program=program, assignment=assignment,
                      shard=shard)
    if limit is not None:
        name = "the host memory limit"
    elif hardware is not None:
        limit, name = hardware.host_memory, f"the {hardware.name} host memory"
    else:
        limit, name = _hardware._host_memory(), "this machine's RAM"  # looked up here: tests patch it
    if need.total <= limit:
        return need
    lora = "freeze the base model and train adapters (LoRA; `plan --frozen-base` estimates that)"
    more = ("shard the masters and optimizer state over more servers" if need.servers > 1 else
            "shard the masters and optimizer state over data-parallel servers (`plan --servers W --shard-state`)")
    if need.in_flight:
        fix = f"{lora} or put fewer microbatches in flight (smaller rounds: fewer microbatches per iteration)"
    else:
        fix = f"the parameters' state alone is over, before any saved activations: {lora}, or {more}"
    who = "the run needs" if need.servers == 1 else \
        f"one server's share of the run (server {shard[0]} of {need.servers}, the masters and moments sharded) needs"
    raise ValueError(f"host memory: {who} {need} but {name} is {_gib(limit)} ({limit} bytes); {fix}")
