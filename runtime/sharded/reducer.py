"""The network lanes of sharded host state: reduce-scatter, statistics, all-gather (issue 49, DESIGN.md 3g).

With `shard_state=True` each of W data-parallel processes keeps one slice of every layer group's
masters and optimizer moments (`rpcompile.ir.host_layout.shard_slices`: 16-element units, the first
ranks one unit more); the gradients and the compute copies stay whole on every rank. A step then
runs, per layer group l:

1. reduce-scatter (the "dist/reduce-scatter" thread, as soon as l's last gradient write is in, in
   the fixed order the all-reduce uses: descending layers, iteration after iteration): the sum of
   the ranks' gradients lands on the slice's owner, in rank order, then one pass averages it and
   takes the statistics of the owned part (`HostState.reduce_scatter_grads`);
2. after the iteration's last group, the same thread all-gathers the ranks' (sum of squares,
   non-finite) in float64 and sums them in rank order: every rank gets the same global norm and
   overflow verdict (`HostState.on_totals`), so clipping and loss scaling agree bit for bit;
3. `step(l)` updates the owned slice with the same kernels and the same rounding keys as one
   process (the element offsets are the group's), and `copy(l)` casts the owned slice;
4. all-gather (the "dist/all-gather" thread, its own gloo group, in a fixed order: descending
   groups, iteration after iteration) sends the owned slice of the new compute copies (the training
   dtype: 2 bytes an element in bf16/fp16) to every other rank. The COPY.l event that uploads wait
   for (R2) is set only when the gather is in: the upload that reads the copy, and nothing else,
   waits for it; the copy lane goes on with its next COPY meanwhile.

Rule R1 holds as without sharding: the gather of iteration t's copy of group l writes the other
ranks' slices into this rank's compute copy only after this rank's COPY.l of t, which the executor
runs only after iteration t's uploads of every reader of l are done (and the other ranks send what
their own COPY.l wrote). Staleness 1 keeps its point: iteration t+1's work waits for group l's
gather only where it uploads group l.

Bytes per step on the wire, all ranks together, for n trainable elements: 4(W-1)n for the
reduce-scatter of the fp32 gradient, 2(W-1)n for the all-gather of 2-byte copies, and 16W(W-1) for
the statistics: 0.75x the 8(W-1)n of the ring all-reduce it replaces. `ShardedReducer.wire` counts
what this rank sent, per step and collective.

Failures: a peer that dies makes the collective raise one line naming it and the layer group; the
reducer is then broken, every later step raises, and all processes restart from a checkpoint.
"""
from __future__ import annotations

import collections
import datetime
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rpcompile.runtime.distributed import DistConfig, GradReducer, init_group
from rpcompile.runtime.host.shard_comm import WireBytes, all_gather_, reduce_scatter_, slices

__all__ = ["ShardedReducer", "sharded_data_parallel", "shard_of"]


class ShardedReducer(GradReducer):
    """A `GradReducer` for sharded host state: reduce-scatter, global statistics and all-gather lanes.

    Args:
        state: a `HostState` built with `shard=(rank, world)` of `group`; the reducer installs its hooks.
        group: the main process group.
        cfg: a DistConfig.
    """

    COLLECTIVE = "reduce-scatter"

    def __init__(self, state: Any, group: Any, cfg: DistConfig) -> None:
        super().__init__(state, group, cfg)
        if state.shard != (self.rank, self.world):
            raise ValueError(f"ShardedReducer: the host state holds shard {state.shard}, but this process is rank "
                             f"{self.rank} of {self.world}")
        timeout = datetime.timedelta(seconds=cfg.timeout_s)
        ranks = dist.get_process_group_ranks(group)
        self.gather_group = dist.new_group(ranks, timeout=timeout, backend="gloo")  # the all-gather lane's
        self.state_group = dist.new_group(ranks, timeout=timeout, backend="gloo")  # the caller's (masters gathered)
        self.timeout = timeout
        self.wire = WireBytes()  # bytes this rank sent, per collective; `step()` closes each step
        n = len(state.groups)
        self._partial: list[float] = []  # the iteration's parts of the sum of squares (network lane)
        self._partial_bad = False
        self._totals: collections.deque[tuple[float, bool]] = collections.deque()  # iterations' global statistics
        self._copies = [0] * n  # copy(l) calls whose gather is queued or done
        self._gathered = [0] * n  # gathers done
        self._after: list[collections.deque[Callable[[], None]]] = [collections.deque() for _ in range(n)]
        self._gather_thread: threading.Thread | None = None
        state.on_copied, state.on_totals, state.gather = self.copied, self.totals, self.gather_flat
        state.on_settle = self.settle

    # -- setup ------------------------------------------------------------------------------------
    def broadcast_state(self, params: Mapping[str, Tensor] | None = None) -> None:
        """Give every process rank 0's compute copies and, of rank 0's `params` (the model's parameters, whole),
        its own slice of the masters (one group's whole fp32 buffer on the wire at a time)."""
        state, dev = self.state, self._device(self.group)
        src = dist.get_global_rank(self.group, 0) if self.group is not dist.group.WORLD else 0
        for name in sorted(state.compute):
            buf = state.compute[name].detach().to(dev, copy=True)
            self._collective(f"broadcast of {name!r}", dist.broadcast, buf, src=src, group=self.group)
            with torch.no_grad():
                state.compute[name].copy_(buf.to(state.compute[name].device))
        if params is None:
            raise ValueError("ShardedReducer.broadcast_state: rank 0's whole parameters are needed (params=)")
        for g, names in enumerate(state.groups):
            if not names:
                continue
            whole = torch.zeros(state.layout.flat[g], dtype=torch.float32)
            if self.rank == 0:
                for n in names:
                    off = state.layout.master[n]
                    whole[off:off + params[n].numel()] = params[n].detach().reshape(-1)
            buf = whole.to(dev)
            self._collective(f"broadcast of layer group {g}'s weights", dist.broadcast, buf, src=src,
                             group=self.group)
            whole = buf.to("cpu")
            for n in names:
                a, b = state.flat.part(n)
                off = state.layout.master[n]
                state.master[n].copy_(whole[off + a:off + b])

    def attach(self, runtime: Any) -> None:
        """As `GradReducer.attach`, and start the all-gather lane."""
        super().attach(runtime)
        if self._gather_thread is None:
            self._gather_thread = threading.Thread(target=self._gather_run, name="dist/all-gather", daemon=True)
            self._gather_thread.start()

    # -- the reduce-scatter lane --------------------------------------------------------------------
    def _reduce(self, layer: int) -> None:
        """Reduce-scatter group `layer`'s gradient; keep this rank's part of the statistics."""
        def scatter(flat: Tensor) -> None:
            reduce_scatter_(flat, self.grad_group, what=f"layer group {layer}", counter=self.wire,
                            timeout=self.timeout)
        sq, bad = self.state.reduce_scatter_grads(layer, self.world, scatter)
        self._partial.append(sq)
        self._partial_bad = self._partial_bad or bad

    def _end_iteration(self) -> None:
        """Sum the ranks' statistics of the iteration (in rank order: the same bits on every rank)."""
        part = torch.tensor([math.fsum(self._partial), float(self._partial_bad)], dtype=torch.float64)
        self._partial, self._partial_bad = [], False
        if not self.state.needs_global:
            return
        rows = [torch.empty_like(part) for _ in range(self.world)]
        dist.all_gather(rows, part, group=self.grad_group)
        self.wire.add("statistics", (self.world - 1) * part.numel() * part.element_size())
        total, bad = math.fsum(float(r[0]) for r in rows), any(bool(r[1]) for r in rows)
        with self._cond:
            self._totals.append((total, bad))
            self._cond.notify_all()

    def totals(self, iteration: int) -> tuple[float, bool]:
        """on_totals: the next iteration's (sum of squares, non-finite) over every rank (they come in order)."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._totals or self.broken is not None, timeout=2 * self.cfg.timeout_s)
            if self._totals:
                return self._totals.popleft()
        raise RuntimeError(self.broken if ok else f"distributed gradient statistics of iteration {iteration} (rank "
                           f"{self.rank} of {self.world}): no result after {2 * self.cfg.timeout_s:.0f} s")

    # -- the all-gather lane ----------------------------------------------------------------------
    def copied(self, layer: int, done: Callable[[], None]) -> None:
        """on_copied: group `layer`'s owned slice is in its compute copy; `done` runs once the others' are too."""
        if not self.state.groups[layer]:
            done()
            return
        with self._cond:
            self._copies[layer] += 1
            self._after[layer].append(done)
            self._cond.notify_all()

    def settle(self) -> None:
        """on_settle (the runtime's flush): wait until every copy made so far is gathered (then the compute copies
        are whole, e.g. for a checkpoint); raises if the all-gather lane failed."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._gathered == self._copies or self.broken is not None,
                                     timeout=2 * self.cfg.timeout_s)
            if self._gathered == self._copies:
                return
        raise RuntimeError(self.broken if ok else f"distributed all-gather of the compute copies (rank {self.rank} "
                           f"of {self.world}): not done after {2 * self.cfg.timeout_s:.0f} s")

    def _gather_run(self) -> None:
        """All-gather the groups' compute copies in a fixed order: descending groups, iteration after iteration."""
        order = [l for l in reversed(range(len(self.state.groups))) if self.state.groups[l]]
        while order:
            for l in order:
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or self._copies[l] > self._gathered[l])
                    if self._stop:
                        return
                try:
                    self._gather(l)
                except BaseException as exc:  # noqa: BLE001 - reported by the waits of the optimizer lane
                    self._failed(f"all-gather of layer group {l}", exc)
                    return
                with self._cond:
                    done = self._after[l].popleft()
                done()
                with self._cond:
                    self._gathered[l] += 1
                    self._cond.notify_all()

    def _gather(self, layer: int) -> None:
        """Every rank's slice of group `layer`'s compute copies, segment by segment."""
        state = self.state
        owned = slices(state.layout.flat[layer], self.world)
        for s in state.layout.segments[layer]:
            view = state.blocks[(layer, s.dtype)][:s.stop - s.start]
            parts = [(min(max(lo, s.start), s.stop) - s.start, min(max(hi, s.start), s.stop) - s.start)
                     for lo, hi in owned]
            all_gather_(view, self.gather_group, what=f"layer group {layer}", counter=self.wire, parts=parts,
                        timeout=self.timeout)

    # -- the caller's collectives -----------------------------------------------------------------
    def gather_flat(self, group: int, owned: Tensor) -> Tensor:
        """The whole flat buffer of layer group `group` from every rank's `owned` slice of it (the caller's
        thread: every rank calls it, in the same order)."""
        lo, hi = self.state.flat.owned[group]
        whole = torch.zeros(self.state.layout.flat[group], dtype=owned.dtype)
        whole[lo:hi] = owned
        try:
            all_gather_(whole, self.state_group, what=f"layer group {group}'s masters", timeout=self.timeout)
        except BaseException as exc:  # noqa: BLE001 - the run is broken: the ranks disagree on where they are
            self.fail(exc)
            raise
        return whole

    def close(self) -> None:
        """Stop both lanes (daemon threads: one stuck in a collective dies with the process)."""
        super().close()
        if self._gather_thread is not None:
            self._gather_thread.join(timeout=1.0)

    def step_bytes(self) -> dict[str, int]:
        """Close the wire counter's step: the bytes this rank sent since the last call, per collective."""
        return self.wire.step()


def sharded_data_parallel(state: Any, dist_opt: Any, process_group: Any, params: Mapping[str, Tensor]) -> ShardedReducer:
    """A ShardedReducer over the main group that has given every rank rank 0's weights (its slice of the masters).

    Args:
        state: the HostState, built with `shard=(rank, world)` (`shard_of`).
        dist_opt: compile's `dist` (True or a DistConfig).
        process_group: the group to train over (default: the main group).
        params: the model's parameters by canonical name (rank 0's are broadcast).
    """
    cfg = dist_opt if isinstance(dist_opt, DistConfig) else DistConfig()
    reducer = ShardedReducer(state, init_group(cfg, process_group), cfg)
    reducer.broadcast_state(params)
    return reducer


def shard_of(dist_opt: Any, process_group: Any) -> tuple[int, int]:
    """(rank, world) of this process in the group sharded state is split over (initialising gloo if needed)."""
    cfg = dist_opt if isinstance(dist_opt, DistConfig) else DistConfig()
    group = init_group(cfg, process_group)
    return dist.get_rank(group), dist.get_world_size(group)
