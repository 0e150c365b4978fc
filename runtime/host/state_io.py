"""HostState's snapshots: fp32 weights, and a state_dict that resumes a run bit for bit.

The optimizer's moments and the masters are saved in their own dtype (bf16 as bf16, not widened), with
the stochastic rounding's seed (`"rounding"`); a state dict whose moments (masters) have another dtype than
this state's `state_dtype=...` (`master_dtype=...`) is refused in one line naming both.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from rpcompile.ir.optim import STATE_DTYPES, dtype_name
from rpcompile.runtime.host.grad_stats import ScaleVerdict

__all__ = ["StateIO"]


def _clone(v: Any) -> Any:
    """A detached copy of a tensor; other values unchanged."""
    return v.detach().clone() if isinstance(v, Tensor) else v


def _saved_state_dtype(sd: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype of a state dict's optimizer moments: as recorded, else as saved (None: no record and no moments)."""
    name = sd.get("rounding", {}).get("state_dtype")
    if name in STATE_DTYPES:
        return STATE_DTYPES[name]
    for saved in sd["optim"].values():
        for k, t in saved.items():
            if k != "step" and isinstance(t, torch.Tensor):
                return t.dtype
    return None


def _saved_master_dtype(sd: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype of a state dict's masters, as saved (they always are, in their own dtype; None: no masters)."""
    return next((t.dtype for t in sd["master"].values() if isinstance(t, torch.Tensor)), None)


def _shard_of(sd: Mapping[str, Any]) -> tuple[int, int] | None:
    """(rank, world) of a state dict holding one rank's slice of sharded masters and moments; None: whole."""
    shard = sd.get("shard")
    return (int(shard[0]), int(shard[1])) if shard and int(shard[1]) > 1 else None


def _refuse_other(what: str, field: str, flag: str, theirs: torch.dtype, ours: torch.dtype) -> None:
    """Raise the one-line refusal of a checkpoint whose `what` have dtype `theirs`, not this run's `ours`."""
    raise ValueError(f"load_state_dict: the checkpoint's {what} are {dtype_name(theirs)} ({field}={theirs}) but "
                     f"this run's are {dtype_name(ours)} ({field}={ours}); resume with {field}={theirs} "
                     f"(finetune/plan: {flag} {dtype_name(theirs)})")


class StateIO:
    """`parameters_fp32`, `state_dict` and `load_state_dict` of `HostState` (a mixin; see runtime/host/optimizer.py)."""

    def _state_dtype(self) -> torch.dtype:
        """The dtype of this state's optimizer moments."""
        return next((t.dtype for m in self.flat.moments for t in m.values()), getattr(
            self.config, "state_dtype", torch.float32))

    def _master_dtype(self) -> torch.dtype:
        """The dtype of this state's masters."""
        return self.flat.master_dtype

    def parameters_fp32(self) -> dict[str, Tensor]:
        """Current weights in fp32: masters (bf16 ones widened), or compute copies for frozen parameters (fresh
        tensors).

        Sharded state (`shard=`): the masters are gathered from every rank, group by group, through the
        data-parallel reducer's `gather` hook: a collective, so every rank must call it at the same point.
        """
        if self.shard is None:
            return {n: (self.master.get(n, c)).to(torch.float32, copy=True) for n, c in self.compute.items()}
        if self.gather is None:
            raise RuntimeError("parameters_fp32: this state's masters are sharded over data-parallel ranks and no "
                               "reducer is attached to gather them (runtime.sharded.ShardedReducer)")
        out = {n: c.to(torch.float32, copy=True) for n, c in self.compute.items() if n not in self.master}
        for g, names in enumerate(self.groups):
            if names:
                whole = self.gather(g, self.flat.masters[g].float())
                for n in names:
                    off = self.layout.master[n]
                    out[n] = whole[off:off + self.grad[n].numel()].view(self.grad[n].shape).clone()
        return {n: out[n] for n in self.compute}

    def state_dict(self) -> dict[str, Any]:
        """A snapshot (cloned tensors) of compute copies, masters, optimizer state (in its dtype), step counts, the
        rounding seed and loss scale (with the last two overflow checks, which fix the dynamic scale of the next
        two iterations).

        Take it between iterations (no gradient partially accumulated); with
        staleness 1 the masters are one step ahead of the compute copies and
        both are saved, so a resumed run continues bit for bit. Under a runtime that means after
        `Runtime.flush()` (`Compiled.state_dict` and `save` flush first): at either staleness an
        iteration's updates may still be running on the optimizer lane when its `step` has returned,
        and nothing here waits for them.
        """
        clone = _clone
        optim = {n: {**self._step_entry(n), **{k: clone(v) for k, v in self.flat.moment[n].items()}}
                 for n in self.master if self.counts[n] and (self.flat.moment[n] or self._step_entry(n))}
        return {"compute": {n: clone(t) for n, t in self.compute.items()},
                "master": {n: clone(t) for n, t in self.master.items()},
                "buffers": {n: clone(t) for n, t in self.buffers.items()},
                "optim": optim, "steps": list(self._stepped),
                "rounding": {"seed": self.flat.seed, "state_dtype": dtype_name(self._state_dtype())},
                "shard": list(self.shard) if self.shard is not None else None,  # masters and moments: this slice
                "loss_scale": {"scale": self.loss_scale, "good": self._good, "skipped": list(self.skipped),
                               "verdicts": [[u, v.used, v.skipped, v.after] for u, v in sorted(self.verdicts.items())
                                            if u >= min(self._stepped, default=0) - 2]}}  # what the next two use

    def check_state_dict(self, sd: Mapping[str, Any], sliced: bool = False) -> None:
        """Raise ValueError (naming what differs) unless `sd` fits this state: names, shapes, groups, dtypes; one
        rank's slice of sharded state only if `sliced` (the other ranks' slices come with it)."""
        for key in ("compute", "master", "optim", "steps", "loss_scale"):
            if key not in sd:
                raise ValueError(f"load_state_dict: the state dict has no {key!r} entry")
        shard = _shard_of(sd)
        if shard is not None and not sliced:
            raise ValueError(f"load_state_dict: the state dict holds rank {shard[0]} of {shard[1]}'s slice of the "
                             f"masters and moments; the other ranks' slices are needed too (rpcompile.load reads "
                             f"them: checkpoint.other_slices)")
        for key, ours in (("compute", self.compute), ("master", self.master)):
            if set(sd[key]) != set(ours):
                raise ValueError(f"load_state_dict: {key} names differ: missing {sorted(set(ours) - set(sd[key]))}"
                                 f", unexpected {sorted(set(sd[key]) - set(ours))}")
            for n, t in sd[key].items():
                want = tuple(ours[n].shape) if key == "compute" else self._saved_shape(n, shard)
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                    got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"load_state_dict: {key}[{n!r}] has shape {got}, expected {want}")
        if len(sd["steps"]) != len(self.groups):
            raise ValueError(f"load_state_dict: {len(sd['steps'])} layer groups, expected {len(self.groups)} (the "
                             f"checkpoint was planned with another LM-head sharding or layer split)")
        if set(sd.get("buffers", {})) != set(self.buffers):
            raise ValueError(f"load_state_dict: buffer names differ: {sorted(set(sd.get('buffers', {})))} vs "
                             f"{sorted(self.buffers)}")
        ours, theirs = self._state_dtype(), _saved_state_dtype(sd)
        if theirs is not None and theirs != ours:
            _refuse_other("optimizer moments", "state_dtype", "--state-dtype", theirs, ours)
        ours, theirs = self._master_dtype(), _saved_master_dtype(sd)
        if theirs is not None and theirs != ours:
            _refuse_other("masters", "master_dtype", "--master-dtype", theirs, ours)
        unknown = set(sd["optim"]) - set(self.master)
        if unknown:
            raise ValueError(f"load_state_dict: optimizer state for unknown parameters {sorted(unknown)[:5]}")
        for n, saved in sd["optim"].items():
            for k, t in self.flat.moment[n].items():
                want = self._saved_shape(n, shard)
                if k in saved and (not isinstance(saved[k], torch.Tensor) or tuple(saved[k].shape) != want
                                   or saved[k].dtype != t.dtype):
                    raise ValueError(f"load_state_dict: optim[{n!r}][{k!r}] is not a {t.dtype} tensor of shape "
                                     f"{want}")

    def _saved_shape(self, n: str, shard: tuple[int, int] | None) -> tuple[int, ...]:
        """The shape of parameter `n`'s master and moments in a state dict of `shard`: whole, or its 1-D part."""
        if shard is None:
            return tuple(self.grad[n].shape)
        a, b = self.flat.part(n, shard)
        return (b - a,)

    def _load_slice(self, sd: Mapping[str, Any]) -> None:
        """Copy what this state owns of the masters and moments that `sd` holds (whole, or one rank's slice)."""
        shard = _shard_of(sd)
        for n in self.master:
            a, b = self.flat.part(n)  # held here
            c, d = self.flat.part(n, shard) if shard is not None else (0, self.flat.numel[n])  # held in sd
            lo, hi = max(a, c), min(b, d)
            if lo >= hi:
                continue
            if self.flat.split:  # unsharded: whole
                self.flat.set_master(n, sd["master"][n])
            else:
                self.master[n].view(-1)[lo - a:hi - a] = sd["master"][n].reshape(-1)[lo - c:hi - c]
            saved = sd["optim"].get(n, {})
            for k, t in self.flat.moment[n].items():
                if k in saved:
                    t.view(-1)[lo - a:hi - a] = saved[k].reshape(-1)[lo - c:hi - c]

    def load_state_dict(self, sd: Mapping[str, Any], slices: Iterable[Mapping[str, Any]] = ()) -> None:
        """Restore a `state_dict()` in place (same names, shapes and groups), between iterations.

        Checks everything first (`check_state_dict`): a bad state dict changes nothing. A state dict of
        sharded state (one rank's slice of the masters and moments, `shard`) needs the other ranks' in
        `slices` (each is checked, then read, one at a time: a checkpoint loads on any number of ranks,
        and this one keeps only its own slice, whichever ranks wrote it).
        """
        self.check_state_dict(sd, sliced=bool(slices))
        for n, t in sd["compute"].items():
            self.compute[n].copy_(t)
        for n, t in sd.get("buffers", {}).items():
            self.buffers[n].copy_(t)
        self.flat.seed = sd.get("rounding", {}).get("seed", self.flat.seed)  # absent before bf16 moments
        for n, moments in self.flat.moment.items():  # zero what a parameter that never stepped has
            for k, t in moments.items():
                if k not in sd["optim"].get(n, {}):
                    t.zero_()
        self._load_slice(sd)
        shard, seen = _shard_of(sd), set()
        for part in slices:
            self.check_state_dict(part, sliced=True)
            other = _shard_of(part)
            if shard is None or other is None or other[1] != shard[1] or list(part["steps"]) != list(sd["steps"]):
                raise ValueError(f"load_state_dict: a slice of rank {other and other[0]} of {other and other[1]} at "
                                 f"steps {part['steps'][:1]}... does not belong to a checkpoint of "
                                 f"{shard and shard[1]} ranks at steps {sd['steps'][:1]}...")
            seen.add(other[0])
            self._load_slice(part)
        if shard is not None and seen | {shard[0]} != set(range(shard[1])):
            missing = sorted(set(range(shard[1])) - seen - {shard[0]})
            raise ValueError(f"load_state_dict: the state dict holds rank {shard[0]} of {shard[1]}'s slice of the "
                             f"masters and moments; the slices of ranks {missing} are missing")
        for n, moments in self.flat.moment.items():  # torch's state names; a parameter not in it never stepped
            saved = sd["optim"].get(n, {})
            self.counts[n] = int(saved["step"]) if "step" in saved else 1 if saved else 0
            opt = self._optims[self.group_of[n]]
            if opt is not None and moments:  # torch's optimizer: the same views, its step count
                opt.state[self.master[n]] = {**self._step_entry(n), **moments}
        with self._cond:
            self._stepped, self._done = list(sd["steps"]), list(sd["steps"])
            self._stats.clear()
            self._scale_of.clear()
            self._begun = min((s for s, g in zip(self._stepped, self.groups) if g), default=0)
            ls = sd["loss_scale"]
            self.loss_scale, self._good, self.skipped = ls["scale"], ls["good"], list(ls["skipped"])
            self.verdicts = {int(u): ScaleVerdict(used, bool(skip), after)  # absent in checkpoints before them
                             for u, used, skip, after in ls.get("verdicts", [])}
            self._base, self._base_scale = self._begun, self.loss_scale
        for fresh in self._fresh:
            fresh.clear()
