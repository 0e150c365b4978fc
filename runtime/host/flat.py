"""Flat per-group optimizer buffers: masters, gradients and moments, one buffer each per layer group.

The moments are float32, or bf16 with `AdamW(state_dtype=torch.bfloat16)`; the masters float32, or bf16
with `master_dtype=torch.bfloat16` (both rounded stochastically with the keys of
`rpcompile.runtime.host.lean`: `FlatGroups.seed`, the group and the step count); the gradients float32, or
bf16 with `grad_dtype=torch.bfloat16` (written by `HostState.accumulate_grad`, runtime/host/grad_stats.py).
Float32 masters beside bf16 moments are split (`split`, runtime/host/lean.py): `masters` holds their bf16
halves and `lows` the other halves, and `master` gives their float32 values.

Each trainable parameter's master, gradient and moments are views into its group's flat
buffers, at the offsets `rpcompile.ir.host_layout.host_layout` gives, so one kernel call steps a whole
group and one more writes its compute copies (`FlatGroups.step`, `FlatGroups.cast`). The torch
optimizers of `impl="foreach"/"single"` (and the fallback without a C++ compiler) step the same views.

    >>> import torch
    >>> from rpcompile.ir.host_layout import host_layout
    >>> lay = host_layout([("w", 3, torch.float32, 0, True)], groups=1)
    >>> fg = FlatGroups(lay, {"w": torch.ones(3)}, ("exp_avg", "exp_avg_sq"))
    >>> fg.master["w"].data_ptr() == fg.masters[0].data_ptr(), sorted(fg.moment["w"])
    (True, ['exp_avg', 'exp_avg_sq'])
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from rpcompile.ir.host_layout import HostLayout, shard_slices
from rpcompile.ir.optim import SGD, AdamW, grad_dtype, master_dtype
from rpcompile.runtime.host.kernels import Kernels
from rpcompile.runtime.host.lean import SplitMasters, TorchLean, join, rounding_key
from rpcompile.runtime.host.pinned import host_buffers, pinned_buffers

__all__ = ["FlatGroups", "moment_names", "state_dtype", "master_dtype", "grad_dtype"]


def state_dtype(config: AdamW | SGD) -> torch.dtype:
    """The dtype of `config`'s optimizer state buffers (SGD's momentum: float32)."""
    return getattr(config, "state_dtype", torch.float32)


def moment_names(config: AdamW | SGD) -> tuple[str, ...]:
    """The optimizer state buffers of `config`, named as torch's optimizer state names them."""
    if isinstance(config, AdamW):
        return ("exp_avg", "exp_avg_sq")
    return ("momentum_buffer",) if config.momentum > 0 else ()


def _part(flat: Tensor, a: int, b: int) -> Tensor:
    """flat[a:b]; flat itself when that is all of it (no new view: a step's calls run cold, between passes over
    memory, where each torch operation costs tens of microseconds)."""
    return flat if a == 0 and b == len(flat) else flat[a:b]


class FlatGroups:
    """The flat buffers of every layer group (masters, gradients, moments), and views of them per parameter.

    Args:
        layout: the run's HostLayout (offsets and sizes).
        params: trainable name -> its initial value (any shape; copied in as the master dtype, to nearest).
        moments: the optimizer state buffer names (`moment_names`).
        dtype: the moments' dtype (`state_dtype`): float32, or bfloat16 (AdamW only).
        seed: the stochastic rounding's seed (bf16 moments or masters; part of the checkpointed state).
        master: the masters' dtype (`master_dtype`): float32, or bfloat16.
        grad: the gradients' dtype (`grad_dtype`): float32, or bfloat16.
        shard: (rank, world) to keep only this rank's slice of each group's masters and moments
            (`shard_slices`: `owned[g]` = [lo, hi) of the group's elements, the buffers hold those; the
            gradients stay whole). A parameter's `master` / `moment` views are then 1-D: the part of it
            this rank owns (possibly empty). `step` and `cast` cover the owned part only, at the same
            element offsets (so the same rounding bits) as one process.
        pin: pin the bf16 masters (or split masters' bf16 halves) of an unsharded state (`pinned_buffers`'s `pin`):
            at staleness 1 they alternate with the compute copies as what uploads read (runtime/host/layout.py
            `Alternation`).
        split: keep float32 masters split (`rpcompile.ir.optim.split_masters`; unsharded, float32 `master`).
    """

    def __init__(self, layout: HostLayout, params: Mapping[str, Tensor], moments: Sequence[str],
                 dtype: torch.dtype = torch.float32, seed: int = 0, master: torch.dtype = torch.float32,
                 grad: torch.dtype = torch.float32, shard: tuple[int, int] | None = None, pin: Any = False,
                 split: bool = False) -> None:
        self.layout = layout
        self.seed = seed  # the stochastic rounding's seed (runtime/host/lean.py)
        self.shard = shard if shard and shard[1] > 1 else None  # (rank, world) when sharded; None: whole
        if split and (self.shard is not None or master != torch.float32):
            raise ValueError("FlatGroups: split masters are float32 masters of an unsharded state")
        self.split = split  # masters: bf16 halves, `lows` the others (runtime/host/lean.py)
        self.master_dtype = master  # the masters' values' dtype (split: float32)
        rank, world = shard or (0, 1)
        self.owned = [shard_slices(n, world)[rank] for n in layout.flat]  # group -> [lo, hi) held here
        stored = torch.bfloat16 if split else master  # what `masters` holds
        pin = pin if stored == torch.bfloat16 and self.shard is None else False
        held = [hi - lo for lo, hi in self.owned]  # group -> elements held here
        self.masters = pinned_buffers([(n, stored) for n in held], pin)  # group -> flat masters (of the owned
        # slice; gaps: zeros)
        self.lows = host_buffers(held, torch.int16) if split else [None] * len(held)  # group -> split masters'
        # low halves (None: not split)
        self.grads = host_buffers(layout.flat, grad)  # group -> flat gradients (fp32 or bf16)
        by_name = {k: host_buffers(held, dtype) for k in moments}
        self.moments = [{k: by_name[k][g] for k in moments} for g in range(len(held))]  # group -> name -> flat
        self.order = [[(layout.master[n], n, next(i for i, s in enumerate(segs) if s.start <= layout.master[n] < s.stop))
                       for n in names] for names, segs in zip(layout.members, layout.segments)]  # group -> (offset,
        # name, segment index) in offset order
        self.group = {n: g for g, names in enumerate(layout.members) for n in names}  # trainable name -> group
        self.numel = {n: p.numel() for n, p in params.items()}  # trainable name -> elements
        # name -> master view (split: name -> its float32 value, read from the halves' views)
        self.master: dict[str, Tensor] | SplitMasters = {n: self._owned(self.masters, n, p.shape)
                                                          for n, p in params.items()}
        if split:
            self.master = SplitMasters(self.master, {n: self._view(self.lows, n, p.shape) for n, p in params.items()})
        self.grad = {n: self._view(self.grads, n, p.shape) for n, p in params.items()}
        self.moment = {n: {k: self._owned([m[k] for m in self.moments], n, p.shape) for k in moments}
                       for n, p in params.items()}
        for n, p in params.items():
            a, b = self.part(n)
            self.set_master(n, p.detach() if self.shard is None else p.detach().reshape(-1)[a:b])

    def set_master(self, name: str, value: Tensor) -> None:
        """Write `value` (the master's shape; sharded: its owned part) into `name`'s master, as the master dtype
        stores it (to nearest into bf16; split into its halves)."""
        if self.split:
            self.master.set(name, value)
        else:
            self.master[name].copy_(value)

    def _view(self, flats: list[Tensor], name: str, shape: torch.Size) -> Tensor:
        """The view of `name` in its group's buffer of `flats`."""
        off = self.layout.master[name]
        return flats[self.group[name]][off:off + shape.numel()].view(shape)

    def part(self, name: str, shard: tuple[int, int] | None = None) -> tuple[int, int]:
        """The elements [a, b) of parameter `name` (in its own flat order) that this rank owns (all when whole), or
        that rank r of W owns with `shard=(r, W)` (a == b: none)."""
        g = self.group[name]
        lo, hi = self.owned[g] if shard is None else shard_slices(self.layout.flat[g], shard[1])[shard[0]]
        off, n = self.layout.master[name], self.numel[name]
        a = min(n, max(0, lo - off))
        return a, max(a, min(n, hi - off))

    def _owned(self, flats: list[Tensor], name: str, shape: torch.Size) -> Tensor:
        """The view of `name` in its group's buffer of `flats` (sharded: of its owned part, 1-D)."""
        if self.shard is None:
            return self._view(flats, name, shape)
        a, b = self.part(name)
        base = self.layout.master[name] - self.owned[self.group[name]][0]
        return flats[self.group[name]][base + a:base + b]

    def runs(self, group: int, names: Sequence[str], key: Mapping[str, tuple]) -> list[tuple[int, int, int, tuple]]:
        """Maximal element ranges of `names` that are contiguous in the group's order and share a segment and
        `key[name]` (step count, decayed).

        Returns:
            [(start, stop, segment index, key)], covering every name of `names` and no other parameter.
        """
        chosen, out, prev = set(names), [], None
        for off, n, seg in self.order[group]:
            if n not in chosen:
                prev = None
                continue
            stop = off + self.grad[n].numel()
            if prev == (seg, key[n]):
                out[-1] = (out[-1][0], stop, seg, key[n])
            else:
                out.append((off, stop, seg, key[n]))
            prev = (seg, key[n])
        return out

    def step(self, kernels: Kernels | TorchLean, config: AdamW | SGD, group: int, names: Sequence[str],
             counts: dict[str, int], decayed: frozenset[str], *, factor: float, lr: float,
             out: Mapping[torch.dtype, Tensor] | None, alt: tuple[Mapping, Mapping] | None = None) -> None:
        """One kernel call per run of `names`: the update with gradient * factor; counts += 1 for each name.

        Args:
            kernels: the C++ kernels, or `TorchLean` (bf16 moments, masters or gradients without them).
            decayed: the names weight decay applies to (`config.decay` resolved).
            out: compute dtype -> the group's compute block to write the new masters into (None: no copy).
            alt: (read, write), segment index -> the buffer the masters are read from and the one the new
                masters are written to, out of place (`Alternation.sources`, unsharded); None: in place.
        """
        p, g, mom = self.masters[group], self.grads[group], self.moments[group]
        own_lo, own_hi = self.owned[group]
        for lo, hi, seg, (done, decay) in self.runs(group, names, {n: (counts[n], n in decayed) for n in names}):
            lo, hi = max(lo, own_lo), min(hi, own_hi)  # sharded: the owned part of the run
            if lo >= hi:
                continue
            s, a, b = self.layout.segments[group][seg], lo - own_lo, hi - own_lo  # a, b: in the owned buffers
            o = None if out is None else _part(out[s.dtype], lo - s.start, hi - s.start)
            dst, src = (_part(p, a, b), None) if alt is None else (_part(alt[1][seg], lo - s.start, hi - s.start),
                                                                   _part(alt[0][seg], lo - s.start, hi - s.start))
            wd = config.weight_decay if decay else 0.0
            key = rounding_key(self.seed, group, done + 1)
            if isinstance(config, AdamW):
                low = None if self.lows[group] is None else _part(self.lows[group], a, b)  # a split master's lo halves
                kernels.adamw(dst, _part(g, lo, hi), _part(mom["exp_avg"], a, b), _part(mom["exp_avg_sq"], a, b), o,
                              factor=factor, lr=lr, betas=config.betas, eps=config.eps, weight_decay=wd, step=done + 1,
                              key=key, offset=lo, src=src, low=low)
            else:
                buf = _part(mom["momentum_buffer"], a, b) if "momentum_buffer" in mom else None
                kernels.sgd(dst, _part(g, lo, hi), buf, o, factor=factor, lr=lr, momentum=config.momentum,
                            weight_decay=wd, nesterov=config.nesterov, first=done == 0, key=key, offset=lo, src=src)
        for n in names:
            counts[n] += 1

    def cast(self, kernels: Kernels | None, group: int, out: Mapping[torch.dtype, Tensor]) -> None:
        """Write every master of `group` (sharded: its owned slice) into its compute copy (`out`: dtype -> the
        group's block), one call a segment (the kernels' cast, also of a bf16 master into a bf16 copy; else
        torch's copy, a plain copy into bf16 and exact into float32). A split master's bf16 copy is its bf16
        half; another dtype's is cast from its float32 value."""
        own_lo, own_hi = self.owned[group]
        for s in self.layout.segments[group]:
            lo, hi = max(s.start, own_lo), min(s.stop, own_hi)
            if lo >= hi:
                continue
            src, dst = self.masters[group][lo - own_lo:hi - own_lo], out[s.dtype][lo - s.start:hi - s.start]
            if self.split and dst.dtype != torch.bfloat16:
                src = join(src, self.lows[group][lo - own_lo:hi - own_lo])  # the float32 values
            if kernels is not None and (src.dtype == torch.float32 or src.dtype == dst.dtype == torch.bfloat16):
                kernels.cast(src, dst)
            else:
                dst.copy_(src)
