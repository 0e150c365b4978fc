"""The host's lanes: gradient accumulation, optimizer steps and copies, in program order (DESIGN.md idea 6).

Three threads per runtime, each walking one iteration's host work in the
program's order (which makes the fp32 gradient sums bit-reproducible):

- accumulate: unit by unit in program order (`runtime.host.staging`), once the
  unit's gradient downloads (G chunks) are done (one host wait per unit), add
  its ring buffer into the fp32 gradients, once per parameter, and free the
  buffer for the unit K later;
- optimizer: STEP.l after every gradient of group l is accumulated (R3, the
  first step of an iteration after all of them: its commit point); with
  staleness 0 it also writes the compute copies in the update's pass, so it
  waits for COPY.l's dependencies too (R1) and COPY.l only marks the copy done;
- copy: COPY.l after the uploads that read the old version (R1, one host wait)
  and the step that made the new one; with staleness 1 the overwritten copy
  is backed up until the iteration commits, so a failure can be undone.
  Unless the masters are sharded, the compute copies alternate between two
  buffers at staleness 1 (runtime/host/layout.py `Alternation`): STEP.l writes
  the new copies (a bf16 master with bf16 copies: the new master) into the
  buffer the iteration uploaded from, in the update's pass, after COPY.l's
  event (its R1 wait), and COPY.l only marks that the version the next
  iteration reads is made: no copy pass, no undo copy.

`HostLanes` owns these threads and everything they keep between iterations;
the issuers reach it only for a host event (R2) and a G chunk's staging buffer.
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Iterator

import torch

from rpcompile.ir.program import Op
from rpcompile.runtime.host.pinned import pinned_zeros
from rpcompile.runtime.host.staging import StagingPlan
from rpcompile.runtime.streams.pool import poison as fill_poison
from rpcompile.runtime.program_info import EVAL_BASE
from rpcompile.runtime.stage.cuts import chunk_elements, stage_io
from rpcompile.runtime.streams.host import Abort, DeadlineExceeded, HostEvent, wait_all
from rpcompile.runtime.transfer import LaneThread, NonFiniteError

__all__ = ["HostLanes", "naming"]


@contextlib.contextmanager
def naming(name: str) -> Iterator[None]:
    """Tag an exception raised in the block with the instruction it happened in (for RuntimeFailure)."""
    try:
        yield
    except Abort:
        raise
    except BaseException as exc:
        if getattr(exc, "rp_instr", None) is None:
            try:
                exc.rp_instr = name
            except AttributeError:  # exceptions without a __dict__
                pass
        raise


class HostLanes:
    """The host lanes: gradient accumulation, optimizer steps and copies of each training iteration.

    Owns:
        lanes: "accumulate", "optimizer", "copy" -> its LaneThread (the caller may queue work on one,
            e.g. a learning-rate change between optimizer steps).
        events: (t, name) -> HostEvent of each STEP, COPY, G accumulation and staging unit's release
            ("free u{j}").
        plan: the StagingPlan (`runtime.host.staging`): the accumulation units and the ring's K.
        staging: ring buffer -> its gradient staging buffers (per dtype), allocated here once, pinned at
            their exact size by `pin` (a PinnedAllocator) where the workers are CUDA (`runtime.host.buffers`
            counts them).
        committed: iterations < this have passed their commit point (their first STEP): no undo.
        skipped: iterations skipped for a non-finite loss or gradient (on_nonfinite="skip").
        backups: iteration -> the compute-copy regions its COPYs overwrote before it committed (staleness 1:
            each group's trainable parameters' copies, `copied_regions`), in buffers allocated once, one per
            region (`_backup_bufs`; `host_bytes` counts them as `undo`); bad: iteration -> lowest group with a
            non-finite gradient.

    Handed: ctx (StreamContext), state (HostState: its gradients, steps and copies are this object's to
    run), graph (layer names for messages), layouts (stage_layouts), its (Iterations: lookups, and the
    loss downloads the commit check takes), board (IssueBoard: the device events of G), host_pool
    (the loss buffers it frees), drop (test switch), poison, pin (False or the runtime's PinnedAllocator),
    on_nonfinite ("raise" | "skip").
    """

    def __init__(self, *, ctx: Any, state: Any, graph: Any, layouts: Any, its: Any, board: Any, host_pool: Any,
                 drop: frozenset, poison: bool, pin: Any, on_nonfinite: str) -> None:
        self.ctx, self.state, self.graph, self.layouts, self.its, self.board = ctx, state, graph, layouts, its, board
        self.host_pool, self.drop, self.poison, self.pin = host_pool, drop, poison, pin
        self.on_nonfinite = on_nonfinite
        self.lanes = {name: LaneThread(f"h/{name}", lambda f: f()) for name in ("accumulate", "optimizer", "copy")}
        self.events: dict[tuple, HostEvent] = {}
        self.plan = _staging_plan(graph, its.program, state, layouts)
        self.staging = {b: {d: pinned_zeros(n, d, pin) for d, n in self.plan.sizes.items()}  # once, exact sizes
                        for b in range(self.plan.k)}
        ctx.stats.add(None, "host_allocations", self.plan.k * len(self.plan.sizes))
        if poison:
            for bufs in self.staging.values():
                for buf in bufs.values():
                    fill_poison(buf)
        self._copies = _copies(self.plan, layouts)
        self.committed = its.first
        self.skipped: list[int] = []
        self._backups: dict[int, dict] = {}
        self.alternating = state.alternate(its.first if its.program.staleness == 1 else None)
        self._backup_bufs = undo_buffers(state) if its.program.staleness == 1 and not self.alternating else {}
        ctx.stats.add(None, "host_allocations", len(self._backup_bufs))
        self._bad: dict[int, int] = {}
        self._lock = threading.Lock()

    # -- for Runtime, the issuers and Recovery ---------------------------------------------------------
    def make_events(self, t: int, info: Any) -> None:
        """Create iteration t's host events: each STEP and COPY, each G's accumulation, each staging unit."""
        for i in info.program.instrs:
            if i.is_host or i.op is Op.GRAD_DOWN:
                self.events[(t, i.name)] = HostEvent(self.ctx, t, f"{i.name} (iteration {t})")
        if info.grads:
            for j, u in enumerate(self.plan.units):
                self.events[(t, f"free u{j}")] = HostEvent(self.ctx, t, f"staging unit {j} (stage {u.stage} "
                                                                        f"round {u.round}, iteration {t})")

    def submit(self, t: int) -> None:
        """Queue iteration t's body on each lane (after `make_events`)."""
        for name, body in (("accumulate", self._lane_accumulate), ("optimizer", self._lane_optimizer),
                           ("copy", self._lane_copy)):
            self.lanes[name].submit(lambda t=t, body=body: self._run_lane(body, t))

    def event(self, key: tuple) -> HostEvent:
        """The HostEvent of host work `key` = (iteration, name)."""
        return self.events[key]

    def forget(self, keep) -> None:
        """Drop the host events whose iteration fails `keep(iteration)`."""
        with self._lock:
            for k in [k for k in self.events if not keep(k[0])]:
                del self.events[k]

    def undo_from(self, u: int) -> None:
        """Undo the abandoned iterations >= u (after a drain): restore the compute copies they overwrote,
        forget their events and non-finite records."""
        for t in sorted((t for t in self._backups if t >= u), reverse=True):
            for key, v in self._backups.pop(t).items():
                self.state.blocks[key][:v.numel()].copy_(v)
        with self._lock:
            for k in [k for k in self.events if k[0] >= u]:
                del self.events[k]
            for t in [t for t in self._bad if t >= u]:
                del self._bad[t]

    def fail_caller(self, t: int, exc: BaseException) -> None:
        """Record a failure of the caller's own wait for iteration t (an interrupt, a timeout).

        An iteration that has committed (its optimizer steps run, nothing can undo them) is
        finished, not abandoned: the failure then abandons only the iterations after it.
        """
        with self._lock:
            self.ctx.failure.fail(t + 1 if t < EVAL_BASE and self.committed > t else t, "step", exc)

    def staging_for(self, t: int, ins, stream: Any) -> tuple[dict, tuple]:
        """A G chunk's ring buffer (per dtype) and its copies (dtype, from, to, elements): from the slot's
        gradient buffer to the buffer. The first chunk of a unit makes `stream` wait until the buffer's
        previous unit (K units earlier) is accumulated (test switch "step>grad_down" drops that wait)."""
        j = self.plan.unit_of[ins.name]
        if ins.name == self.plan.units[j].chunks[0] and "step>grad_down" not in self.drop:
            prev = self.plan.waits_for(t, j)
            ev = self.events.get((prev[0], f"free u{prev[1]}")) if prev[0] >= self.its.first else None
            stream.wait(ev, t)
        return self.staging[self.plan.buffer(t, j)], self._copies[ins.name]

    # -- the lanes' work ---------------------------------------------------------------------------------
    def _lane_accumulate(self, t: int) -> None:
        """Accumulate iteration t's gradients into the fp32 buffers: unit by unit, in program order.

        One host wait per unit: for its gradient downloads (test switch "grad_down>step" drops it).
        """
        info = self.its.info_of(t)
        for j, u in enumerate(self.plan.units):
            events = []
            for name in u.chunks:
                g = info.by_name[name]
                with naming(self.its.label(t, g, self.its.worker_of(t, g))):
                    events += list(self.board.get((t, g.name), t, f"h accumulate {g.short}"))
                    for key in self.its.keys(t, g, info):
                        if info.by_name[key[1]].is_host:  # R4: the optimizer took the last iteration's gradient
                            self.events[key].wait()
            if "grad_down>step" not in self.drop:
                wait_all(events, self.ctx, t)
            with naming(self.its.label(t, g, self.its.worker_of(t, g))):
                self._accumulate_unit(t, j, u)

    def _accumulate_unit(self, t: int, j: int, u) -> None:
        """Add unit j's ring buffer into the fp32 gradients; free the buffer for the unit K later."""
        bufs, shapes = self.staging[self.plan.buffer(t, j)], self.layouts[u.stage].grads
        check = self.state.scaler is None  # fp16 dynamic loss scaling handles inf/nan itself
        for name, (d, off, n) in u.grads.items():
            part = bufs[d][off:off + n].view(shapes[name].shape)
            finite = self.state.accumulate_grad(name, part)  # the finite check is in the pass that adds it
            if check and not finite:
                grp = self.state.group_of[self.state.canonical(name)]
                self._bad[t] = min(self._bad.get(t, grp), grp)
        if self.poison:
            for b in bufs.values():
                fill_poison(b)
        self.events[(t, f"free u{j}")]._set()
        for name in u.chunks:
            self.events[(t, name)]._set()

    def _lane_optimizer(self, t: int) -> None:
        """Run iteration t's optimizer steps (layers descending)."""
        info = self.its.info_of(t)
        for o in info.host[Op.STEP]:
            with naming(o.name):
                self._step_one(t, o, info)

    def _step_one(self, t: int, o, info: Any) -> None:
        """One STEP of the optimizer lane (staleness 0: with the compute copy, `HostState.step(copy=True)`)."""
        self._host_deps(t, o, info)
        fuse = info.program.staleness == 0  # the copy follows the step at once: write it in the update's pass
        if fuse:  # R1 for the copy: also after COPY.l's uploads (implied by the gradients; `verify` checks it)
            self._host_deps(t, info.by_name[f"h C.l{o.layer}"], info, skip=(t, o.name))
        elif self.alternating:  # R1: the step writes the buffer iteration t uploaded from, once COPY.l has seen
            self._until_done(t, o.name, self.events[(t, f"h C.l{o.layer}")].wait)  # those uploads done
        if self.committed <= t:  # the first step: every gradient of t is in, t can no longer fail
            self._check_finite(t)
            with self._lock:  # atomic with `fail_caller`: t commits, or it is abandoned, never both
                if self.ctx.failure.abandoned(t):
                    raise Abort(f"{o.name}: iteration {t} abandoned before its commit")
                self.committed = t + 1
                self._backups.pop(t, None)
            if self.state.needs_global:  # clipping / dynamic loss scale: the global statistics need every
                self.state.grads_complete_all()  # group; only here, where they are all in (a later call
                # would complete iteration t+1 while it still accumulates)
        if fuse:
            self.state.step(o.layer, copy=True)
        else:
            self.state.step(o.layer)
        self.events[(t, o.name)]._set()

    def _check_finite(self, t: int) -> None:
        """The commit point's check: a NaN/inf loss or gradient of iteration t raises or skips the iteration."""
        losses = self.its.read_losses(t, self.ctx, lambda h: self.host_pool.give(h, []))
        bad, group = self._bad.pop(t, None), None
        if self.state.scaler is not None or (bad is None and all(map(math.isfinite, losses))):
            return
        if bad is not None:
            group = bad
            what = f"a non-finite gradient, first in layer group {bad} ({self.graph.layers[bad].name})"
        else:
            what = f"a non-finite loss ({[x for x in losses if not math.isfinite(x)][0]})"
        if self.on_nonfinite == "skip":
            self.state.skip_iteration()
            self.skipped.append(t)
            return
        raise NonFiniteError(f"step {t} (iteration {t}) has {what}; the update was not applied: weights and "
                             f"optimizer state are those of the last good step. Check the batch for NaN/inf, "
                             f"lower the learning rate, or compile with on_nonfinite='skip'", t, group)

    def _lane_copy(self, t: int) -> None:
        """Run iteration t's master -> compute copies."""
        info = self.its.info_of(t)
        for c in info.host[Op.COPY]:
            with naming(c.name):
                self._copy_one(t, c, info)

    def _copy_one(self, t: int, c, info: Any) -> None:
        """One COPY of the copy lane."""
        self._host_deps(t, c, info)
        if self.alternating:  # the step before wrote the version the next iteration reads
            self.events[(t, c.name)]._set()
            return
        with self._lock:
            if info.program.staleness == 1 and t >= self.committed:
                bak = self._backups.setdefault(t, {})
                for key, region in copied_regions(self.state, c.layer).items():
                    if key not in bak:
                        bak[key] = self._backup_buffer(key, region, t)
        self.state.copy(c.layer)
        self.state.on_copied(c.layer, self.events[(t, c.name)]._set)  # sharded state: set once gathered

    def _backup_buffer(self, key: tuple, region: torch.Tensor, t: int) -> torch.Tensor:
        """A copy of a compute block's region that COPY overwrites, in the persistent buffer allocated for it.

        One per region is enough: iteration t + 1's COPY of a group follows iteration t's STEP of it (R5),
        which commits t and drops its backups. Should a second be needed, it is allocated here, and
        `stats()` shows the allocation after warm-up (the tests check there is none).
        """
        bufs = self._backup_bufs.setdefault(key, [])
        used = {id(b) for bak in self._backups.values() for b in bak.values()}
        free = [b for b in bufs if id(b) not in used]
        if not free:
            free = [torch.empty_like(region)]
            bufs.append(free[0])
            self.ctx.stats.add(t, "host_allocations")
        back_up(self.state, region, free[0])
        return free[0]

    def _host_deps(self, t: int, ins, info: Any, skip: tuple | None = None) -> None:
        """Wait for a host instruction's dependencies (but `skip`): host events, accumulations, device events
        (one wait)."""
        device = []
        for key in self.its.keys(t, ins, info):
            if key == skip:
                continue
            prod = info.by_name[key[1]]
            if prod.is_host or prod.op is Op.GRAD_DOWN:
                self._until_done(t, ins.name, self.events[key].wait)
            else:
                device += list(self.board.get(key, t, ins.name))
        self._until_done(t, ins.name, lambda timeout: wait_all(device, self.ctx, t, timeout))

    def _until_done(self, t: int, name: str, wait) -> None:
        """`wait(timeout)` with the deadline while iteration t can still fail, with `ctx.drain_bound` once committed.

        A committed iteration's update cannot be undone, so its rest (later steps, copies) is waited
        for as the drain waits; a deadline that fires first fails t, atomically with the commit
        (as `fail_caller`), so t commits or is abandoned, never both.
        """
        if t < self.committed:
            wait(self.ctx.drain_bound)
            return
        try:
            wait(None)
        except DeadlineExceeded as exc:
            with self._lock:
                if t >= self.committed:
                    self.ctx.failure.fail(t, name, exc)
                    raise
            wait(self.ctx.drain_bound)

    def _run_lane(self, body, t: int) -> None:
        """Run one lane body for iteration t; a failure is recorded, an abandoned iteration skipped."""
        if self.ctx.failure.abandoned(t):
            return
        try:
            body(t)
        except Abort:
            pass
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self.ctx.failure.fail(t, getattr(exc, "rp_instr", None) or body.__name__.replace("_lane_", "h "), exc)


def _staging_plan(graph: Any, program: Any, state: Any, layouts: Any) -> StagingPlan:
    """The StagingPlan of `program` (`runtime.host.buffers.transfer_bytes` counts the same from the graph)."""
    elems, _ = chunk_elements(program, stage_io(graph, program.plan), state)
    grads = {s: {n: (g.dtype, g.numel) for n, g in lay.grads.items()} for s, lay in layouts.items()}
    return StagingPlan.of(program, elems, grads)


def _copies(plan: StagingPlan, layouts: Any) -> dict[str, tuple]:
    """G name -> its copies (dtype, offset in the slot's gradient buffer, offset in the ring buffer, elements):
    the chunk's ranges of the stage layout, each parameter's part moved to its unit's place."""
    out = {}
    for u in plan.units:
        grads = layouts[u.stage].grads
        for name, chunk in zip(u.chunks, u.indices):
            copies: list[tuple] = []
            for d, lo, hi in layouts[u.stage].downloads[chunk]:
                for p, (pd, off, n) in u.grads.items():
                    g = grads[p]
                    a, b = max(lo, g.offset), min(hi, g.offset + g.numel)
                    if pd == d and a < b:
                        src, dst, k = a, off + a - g.offset, b - a
                        if copies and copies[-1][0] == d and copies[-1][1] + copies[-1][3] == src \
                                and copies[-1][2] + copies[-1][3] == dst:
                            c = copies.pop()
                            src, dst, k = c[1], c[2], c[3] + k
                        copies.append((d, src, dst, k))
            out[name] = tuple(copies)
    return out


def copied_regions(state: Any, layer: int) -> dict[tuple, torch.Tensor]:
    """(layer, dtype) -> the region of that compute block that COPY `layer` writes: the group's trainable
    parameters' copies, [0, stop - start) of each of its segments (frozen parameters' copies never change)."""
    return {(layer, s.dtype): state.blocks[(layer, s.dtype)][:s.stop - s.start] for s in state.layout.segments[layer]}


def undo_buffers(state: Any) -> dict[tuple, list]:
    """One buffer per region a COPY overwrites (`copied_regions`), allocated once (staleness 1's undo)."""
    return {key: [torch.empty_like(region)] for layer in range(len(state.groups))
            for key, region in copied_regions(state, layer).items()}


def back_up(state: Any, region: torch.Tensor, into: torch.Tensor) -> None:
    """into = region (an undo copy): by the kernels for bf16 (streamed: written whole, read only to undo)."""
    if state.kernels is not None and region.dtype == torch.bfloat16:
        state.kernels.cast(region, into)
    else:
        into.copy_(region)
