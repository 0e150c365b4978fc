"""What a `Compiled` handle keeps: its state as a dict, a checkpoint file, the model, its host bytes (a mixin).

`Snapshots` holds the state side of the handle (rpcompile/api.py builds what it reads): `state_dict` /
`load_state_dict` (a pending update included, so a resumed run continues bit for bit), `save` (atomic;
with `shard_state` every rank writes its own slice), `model()` (the user's module with the current
weights) and `host_bytes()` (what this process allocated, as the admission counted it).

    >>> c.save("run.ckpt"); c2 = rpcompile.load("run.ckpt", model)   # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rpcompile import checkpoint
from rpcompile.hostmem import HostBytes
from rpcompile.pipeline import frozen_of, host_need
from rpcompile.training import _one_caller

__all__ = ["Snapshots"]


class Snapshots:
    """`state_dict`, `load_state_dict`, `save`, `model` and `host_bytes` of `Compiled` (a mixin; see api.py).

    They use what `Compiled` builds: `_lock`, `_runtime`, `_dist`, `state`, `options`, `graph`, `costs`,
    `plan`, `program`, `assignment`, `_units`, `_example`, `_model`, `rank`, `world_size`, `steps`, and its
    `_check_open` and `_new_runtime`; `_pending` is not None until the first plan.
    """

    def host_bytes(self) -> HostBytes:
        """This process's host bytes by category, as the admission counted them: what its host state and runtime
        allocated (with `shard_state`: its share of the masters and moments)."""
        return host_need(self.graph, self.costs, self.plan, dataclasses.replace(self.options, shard=self.state.shard),
                         self.program, self.assignment)

    # -- state ------------------------------------------------------------------------------
    @_one_caller
    def state_dict(self) -> dict[str, Any]:
        """Full training state: weights, masters, optimizer state (incl. a pending update), step, RNG."""
        self._check_open()
        self._runtime.flush()
        opts = {k: v for k, v in dataclasses.asdict(self.options).items()
                if k not in ("loss_fn", "timeout")}  # the deadline belongs to the machine: `load` takes its own
        opts["optimizer"], opts["hardware"] = self.options.optimizer, self.options.hardware
        opts["loss_scale"] = self.options.loss_scale  # asdict would turn a DynamicLossScale into a dict
        return {"format": checkpoint.FORMAT, "steps": self.steps, "plan": self.plan.to_str(),
                "frozen": dataclasses.asdict(frozen_of(self.graph, self.costs, self.program, self._units)),
                "host": self.state.state_dict(), "options": opts, "example": self._example,
                "rng": torch.get_rng_state()}

    @_one_caller
    def load_state_dict(self, sd: dict[str, Any], slices: Any = ()) -> None:
        """Resume from `state_dict()`: the next step continues the run bit for bit.

        Everything is checked before anything changes: a state dict of another model or plan raises
        ValueError and leaves this handle as it was. A state dict of sharded state (one rank's slice)
        needs the other ranks' host state dicts in `slices` (`checkpoint.other_slices`).
        """
        self._check_open()
        checkpoint.check(sd)
        self._runtime.flush()
        self.state.check_state_dict(sd["host"], sliced=bool(slices))
        self._runtime.close()
        self.state.load_state_dict(sd["host"], slices)
        torch.set_rng_state(sd["rng"])
        self._runtime = self._new_runtime(int(sd["steps"]))

    @_one_caller
    def save(self, path: str) -> None:
        """Write `state_dict()` atomically (temporary file in the same folder, then rename).

        Data parallel: rank 0 writes (every rank holds the same state); the others wait for their own
        work, so after `save` returns on every rank no collective of the saved steps is outstanding.
        With `shard_state` every rank writes its own slice (`checkpoint.shard_path`: rank r > 0 to
        `path.shard{r}-of-{W}`); `rpcompile.load` joins them, on any number of processes.
        """
        if self.state.shard is not None:
            checkpoint.save(self.state_dict(), checkpoint.shard_path(path, self.rank, self.world_size))
        elif self.rank == 0:
            checkpoint.save(self.state_dict(), path)
        else:
            self._runtime.flush()

    @_one_caller
    def model(self) -> torch.nn.Module:
        """The user's module with the current weights (every update applied, a pending one too).

        Before the first plan (compiled without `example`), the module as given: nothing has trained.
        """
        self._check_open()
        if self._pending is not None:
            return self._model
        self._runtime.flush()
        masters = self.state.parameters_fp32()
        with torch.no_grad():
            for name, p in self.graph.parameters().items():
                p.copy_(masters[name].to(p.dtype))
            buffers = dict(self._model.named_buffers())
            for name, b in self.state.buffers.items():  # running statistics, updated once per microbatch
                if name in buffers:
                    buffers[name].copy_(b)
        return self._model

