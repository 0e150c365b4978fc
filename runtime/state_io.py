"""HostState's snapshots: fp32 weights, and a state_dict that resumes a run bit for bit."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["StateIO"]


def _clone(v: Any) -> Any:
    """A detached copy of a tensor; other values unchanged."""
    return v.detach().clone() if isinstance(v, Tensor) else v


class StateIO:
    """`parameters_fp32`, `state_dict` and `load_state_dict` of `HostState` (a mixin; see runtime/optimizer.py)."""

    def parameters_fp32(self) -> dict[str, Tensor]:
        """Current weights in fp32: masters, or compute copies for frozen parameters (fresh tensors)."""
        return {n: self.master[n].detach().clone() if n in self.master else c.to(torch.float32, copy=True)
                for n, c in self.compute.items()}

    def state_dict(self) -> dict[str, Any]:
        """A snapshot (cloned tensors) of compute copies, masters, optimizer state, step counts and loss scale.

        Take it between iterations (no gradient partially accumulated); with
        staleness 1 the masters are one step ahead of the compute copies and
        both are saved, so a resumed run continues bit for bit.
        """
        clone = _clone
        optim = {n: {k: clone(v) for k, v in self._optims[l].state[self.master[n]].items()}
                 for l, g in enumerate(self.groups) for n in g if self.master[n] in self._optims[l].state}
        return {"compute": {n: clone(t) for n, t in self.compute.items()},
                "master": {n: clone(t) for n, t in self.master.items()},
                "optim": optim, "steps": list(self._stepped),
                "loss_scale": {"scale": self.loss_scale, "good": self._good, "skipped": list(self.skipped)}}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore a `state_dict()` in place (same names, shapes and groups), between iterations."""
        for key, ours in (("compute", self.compute), ("master", self.master)):
            if set(sd[key]) != set(ours):
                raise ValueError(f"load_state_dict: {key} names differ: missing {sorted(set(ours) - set(sd[key]))}"
                                 f", unexpected {sorted(set(sd[key]) - set(ours))}")
            for n, t in sd[key].items():
                if t.shape != ours[n].shape:
                    raise ValueError(f"load_state_dict: {key}[{n!r}] has shape {tuple(t.shape)}, "
                                     f"expected {tuple(ours[n].shape)}")
                ours[n].copy_(t)
        if len(sd["steps"]) != len(self.groups):
            raise ValueError(f"load_state_dict: {len(sd['steps'])} groups, expected {len(self.groups)}")
        for l, g in enumerate(self.groups):
            if g:
                opt = self._optims[l]
                opt.state.clear()
                for n in g:
                    if n in sd["optim"]:
                        opt.state[self.master[n]] = {k: _clone(v) for k, v in sd["optim"][n].items()}
        with self._cond:
            self._stepped, self._done = list(sd["steps"]), list(sd["steps"])
            self._stats.clear()
            self._scale_of.clear()
            self._begun = min((s for s, g in zip(self._stepped, self.groups) if g), default=0)
            ls = sd["loss_scale"]
            self.loss_scale, self._good, self.skipped = ls["scale"], ls["good"], list(ls["skipped"])
        for fresh in self._fresh:
            fresh.clear()
