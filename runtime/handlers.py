"""Issue handlers: one per Op, each queues its instruction's work on its worker's stream (DESIGN.md 3a).

A handler runs in the issuing thread of its worker (`runtime/issuer.py`) once
the instruction's producers are issued and its stream waits on their events.
It submits one closure to the stream, records the stream's event after it and
returns the events for the board. Everything a closure reads comes from
`Cell`s and pool `Handle`s (`runtime/streams/values.py`), which are filled when their
producer *runs*: at once on CUDA (submit launches the work), later on a host
stream thread. A buffer's release (`pool.give`) happens at issue time, with
the events of its last users, as the host does with a GPU; the pool makes the
next user's stream wait for them.

This module holds `IssueHandlers` with its tables, the slot helpers and the
transfer handlers (P, U, D, G) and release (E); the compute handlers (F, X, R,
B) are its mixin `ComputeHandlers` (`runtime/compute_handlers.py`).
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from rpcompile.ir.program import Op
from rpcompile.runtime.compute_handlers import ComputeHandlers
from rpcompile.runtime.host.layout import upload_sources
from rpcompile.runtime.streams.devices import tensor_bytes
from rpcompile.runtime.stage.cuts import up_keys
from rpcompile.runtime.streams.pool import poison
from rpcompile.runtime.streams.values import CallerSide, Cell, HostVal, ParamSlot, keep_for

__all__ = ["IssueHandlers", "HANDLER_NAMES"]


class IssueHandlers(ComputeHandlers):
    """The per-Op issue handlers (`table()`: Op -> handler(t, ins, w) returning the events for the board).

    The transfer handlers (P, U, D, G) and the release (E) are here, the compute handlers (F, X, R, B)
    in the `ComputeHandlers` mixin (`runtime/compute_handlers.py`).

    Owns the device side's per-iteration tables, each entry made by one handler and taken by a later one:
        slots: (t, stage, round) -> ParamSlot, from the slot's first user to its release (E).
        inputs: (t, stage, mb, grad) -> device buffers an upload (U) fills, until the compute takes them.
        outs: (t, stage, mb) -> Cell of a compute's outputs, until its download (D) takes it.
        rc: (t, stage, mb) -> (Cell of a recompute's graph, its saved inputs), until the backward (B).
        hostvals: (t, "a" | "g", mb, ...) -> HostVal a batch input or a download leaves for its uploads.
        shapes: host key -> (shape, dtype) a download brought: the device buffers of its uploads are
            bound at issue from then on.
        slots_made: per worker, the parameter slots taken so far (their buffer parity).

    Handed (what it changes there: pool buffers, stream work, the worker stores' byte counts, the
    board's running-statistics chain, the loss downloads via `its.set_loss`, the stats):
        graph, io (stage_io), layouts (stage_layouts), capacity (slot_capacities), tracked (layer ->
        host copies of its running statistics), runners (a LayerRunner per worker), workers, host_pool,
        state (the compute-copy blocks P reads), ctx (StreamContext: stats), drop (test switch),
        board (IssueBoard), its (Iterations), host (HostLanes: the pinned gradient staging ring G fills),
        planned (`runtime.host.buffers.pool_buffers`: host pool key -> (shape, dtype), the buffers D binds),
        arena_readers (the host arena's buffers, `runtime.host.assign`: key -> the reads its live range
        covers), poison (test mode: on host workers an arena buffer is poisoned in the stream of the read
        that ends its live range, so a read past it sees NaN; the pool poisons the other buffers).

    Note: the host pool holds exactly the planned buffers when the batches are shaped as traced (the
    driver traces each batch shape apart; the first batch staged decides). A download binds its key's
    one buffer at issue, at the planned shape and dtype, from the first iteration on (an evaluation
    too: it runs between flushes, when every training buffer is free), so what is allocated does not
    depend on how far the issuing threads run ahead of the streams. A value of another dtype than
    traced (bf16 activations of a model traced in fp32) fills the first bytes of its buffer
    (`BufferPool.recast`); one larger than planned fails, naming the value. With batches shaped unlike
    the trace the shapes are learned instead: a download whose key's shape is not known yet binds an
    unkeyed buffer when it runs (warm-up), later ones the key's buffer at issue, so the warm-up
    buffers depend on the threads' timing and nothing counts them.
    """

    def __init__(self, *, graph: Any, io: Any, layouts: Any, capacity: Any, tracked: dict, runners: list,
                 workers: list, host_pool: Any, state: Any, ctx: Any, drop: frozenset, board: Any, its: Any,
                 host: Any, planned: dict, arena_readers: dict | None = None, poison: bool = False) -> None:
        self.graph, self.io, self.layouts, self.capacity = graph, io, layouts, capacity
        self.tracked, self.runners, self.workers, self.host_pool = tracked, runners, workers, host_pool
        self.state, self.ctx, self.drop, self.board, self.its, self.host = state, ctx, drop, board, its, host
        self.planned: dict | None = planned  # None: learn the shapes (see the Note)
        self.arena_readers = arena_readers or {}
        self.poison = poison
        self._reads = threading.Lock()  # the arena buffers' read counts (poison mode), across act_up streams
        self._checked = False  # whether the first batch staged was compared with the plan
        self.slots: dict[tuple, ParamSlot] = {}
        self.inputs: dict[tuple, dict] = {}
        self.outs: dict[tuple, Cell] = {}
        self.rc: dict[tuple, tuple] = {}
        self.hostvals: dict[tuple, HostVal] = {}
        self.shapes: dict[Any, tuple] = {}
        self._slots_made = [0] * len(workers)

    def table(self) -> dict:
        """The dispatch table: Op -> this object's handler for it."""
        return {op: getattr(self, name) for op, name in HANDLER_NAMES.items()}

    # -- the tables' life, for Runtime and Recovery --------------------------------------------------
    def stage_inputs(self, t: int, info: Any, mbs: list[dict]) -> None:
        """Copy iteration t's microbatch inputs (those an upload reads) into host pool buffers for their uploads.

        The copy is synchronous, on the caller's thread: `step` may return before the uploads run, so
        the caller may change or free its batch at once; a CUDA batch is read in the caller's stream
        order (a blocking device-to-host copy); and uploads read pinned memory where CUDA is (a
        pageable source may make `cudaMemcpyAsync` synchronous). The buffers go back to the pool when
        the last upload reading them has run.
        """
        caller = CallerSide(self.ctx)
        if not self._checked:  # the pool follows the plan only for batches shaped as traced (class Note)
            self._checked = True
            if self.planned is not None and any(("in", 0, j, n, tuple(v.shape), v.dtype) not in self.planned
                                                for j, inputs in enumerate(mbs) for n, v in inputs.items()
                                                if info.readers.get(("a", j, n), 0)):
                self.planned = None
        for j, inputs in enumerate(mbs):
            for n, v in inputs.items():
                readers = info.readers.get(("a", j, n), 0)
                if readers:
                    # two persistent buffers per input, by iteration parity: when t is staged, t-1's last
                    # uploads may still read theirs; t-2's were issued before t-1's losses came back
                    key = ("in", t % 2, j, n, tuple(v.shape), v.dtype)
                    h = self.host_pool.take(tuple(v.shape), v.dtype, caller, t, key=key)
                    h.get().copy_(v)
                    self.hostvals[(t, "a", j, n)] = HostVal(tensor=h.get(), handle=h, readers=readers)

    def slot_counts(self) -> list[int]:
        """The per-worker slot counts (an evaluation saves them: training's parities go on after it)."""
        return list(self._slots_made)

    def restore_slot_counts(self, counts: list[int]) -> None:
        """Set the per-worker slot counts back to `counts` (from `slot_counts`)."""
        self._slots_made = list(counts)

    def forget_from(self, u: int) -> None:
        """Drop every table entry of the abandoned iterations >= u (after a drain: nothing issues)."""
        for d in (self.slots, self.inputs, self.outs, self.rc, self.hostvals):
            for k in [k for k in d if k[0] >= u]:
                del d[k]

    # -- helpers -----------------------------------------------------------------------------------
    def _slot(self, t: int, stage: int, rnd: int, w: int, stream: Any) -> ParamSlot:
        """The slot's parameter buffers, taken from the pool by their first user (on `stream`)."""
        key = (t, stage, rnd)
        slot = self.slots.get(key)
        if slot is not None:
            return slot
        slot, lay, pool = ParamSlot(), self.layouts[stage], self.workers[w].pool
        parity = self._slots_made[w] % 2  # a worker alternates two parameter buffers: running + prefetched;
        self._slots_made[w] += 1          # slot k's upload waits for the release of the worker's slot k - 2N
        for d, n in lay.sizes.items():
            slot.flat[d] = pool.take((n,), d, stream, t, flat=True, key=("param", parity, d),
                                     capacity=self.capacity[0].get((w, parity, d), n))
        for name, s in lay.params.items():
            v = slot.flat[s.dtype].tensor[s.offset:s.offset + s.numel].view(s.shape).detach()
            slot.params[name] = v.requires_grad_(name in lay.grads)
        self.slots[key] = slot
        return slot

    def _grads(self, t: int, ins, w: int, slot: ParamSlot, stream: Any) -> None:
        """Give the slot's trainable parameters zeroed gradient views (first backward of the slot)."""
        if slot.grads_ready:
            return
        lay, pool = self.layouts[ins.stage], self.workers[w].pool
        for d, n in lay.grad_sizes.items():  # one gradient buffer per worker: the next slot's backward reuses it
            slot.grad_flat[d] = pool.take((n,), d, stream, t, flat=True, key=("grad", d),  # after the last downloads
                                          capacity=self.capacity[1].get((w, d), n))
        bufs = [h.tensor for h in slot.grad_flat.values()]
        stream.submit(lambda: [b.zero_() for b in bufs], "zero grads", t)
        for name, s in lay.grads.items():
            slot.params[name].grad = slot.grad_flat[s.dtype].tensor[s.offset:s.offset + s.numel].view(s.shape)
        slot.grads_ready = True

    def _take_inputs(self, t: int, ins, grad: bool = False) -> dict:
        return self.inputs.pop((t, ins.stage, ins.mb, grad))

    def _give(self, pool: Any, handles, events: list) -> None:
        """Release pool handles after `events` (test switch "reader>release" drops the events)."""
        evs = [] if "reader>release" in self.drop else events
        for h in handles:
            pool.give(h, evs)

    # -- the transfer handlers and the release: P, U, D, G, E (F, X, R, B: ComputeHandlers) --------
    def _param_up(self, t: int, ins, w: int) -> tuple:
        """P: copy one chunk of the stage's compute copies (pinned host blocks) into the slot's flat buffers."""
        pu = self.workers[w].streams["param_up"]
        slot = self._slot(t, ins.stage, ins.round, w, pu)
        copies, blocks, flat = self.layouts[ins.stage].uploads[ins.chunk], self.state.blocks, slot.flat
        alt = self.state.upload_alternates(t)  # blocks whose trainable part t reads from the masters' buffer

        def run() -> None:
            for c in copies:
                dst = flat[c.dtype].get()
                for src, lo, hi in upload_sources(blocks[c.src_block], alt.get(c.src_block), c.src, c.src + c.numel):
                    dst[c.dst + lo - c.src:c.dst + hi - c.src].copy_(src[lo:hi], non_blocking=True)
        label = self.its.label(t, ins, w)
        pu.submit(run, label, t)
        ev = pu.record(t, label)
        slot.last["param_up"] = ev
        self.ctx.stats.add(t, "bytes_to_device", sum(c.numel * _size(c.dtype) for c in copies))
        return (ev,)

    def _act_up(self, t: int, ins, w: int) -> tuple:
        """U: upload a microbatch's stage input, a B stage's saved input, or ("g") its output gradient."""
        worker = self.workers[w]
        au, pool = worker.streams["act_up"], worker.pool
        vals = {k[-1]: (k, self.hostvals[(t,) + k]) for k in up_keys(self.io, ins)}
        dst = {n: pool.handle() for n in vals}
        for n, (k, hv) in vals.items():  # bind now when the shape is known (a batch input, or seen before)
            shape = (tuple(hv.tensor.shape), hv.tensor.dtype) if hv.tensor is not None else self.shapes.get(k)
            if shape is not None:
                pool.bind(dst[n], shape[0], shape[1], au, t)

        def run() -> None:
            for n, (k, hv) in vals.items():
                src = hv.get()
                if dst[n].tensor is None:
                    pool.bind(dst[n], tuple(src.shape), src.dtype, au, t)
                dst[n].get().copy_(src, non_blocking=True)
                self.ctx.stats.add(t, "bytes_to_device", tensor_bytes(src))
                if hv.unread is not None:
                    self._read(hv)
        label = self.its.label(t, ins, w)
        au.submit(run, label, t)
        ev = au.record(t, label)
        for k, hv in vals.values():
            hv.left -= 1
            hv.events.append(ev)
            if hv.left == 0:  # the last reader is issued: the host buffer is free once they have all run
                del self.hostvals[(t,) + k]
                if hv.handle is not None:
                    self._give(self.host_pool, [hv.handle], hv.events)
        self.inputs[(t, ins.stage, ins.mb, ins.grad)] = dst
        return (ev,)

    def _act_down(self, t: int, ins, w: int) -> tuple:
        """D: download an F stage's outputs, or a backward's input gradients (and the loss), to host buffers."""
        worker, info, io = self.workers[w], self.its.info_of(t), self.io[ins.stage]
        ad, pool = worker.streams["act_down"], self.host_pool
        cell = self.outs.pop((t, ins.stage, ins.mb))
        if io.kind.value == "F":
            keys = {n: ("a", ins.mb, n) for n in io.down}
        else:
            keys = {} if info.forward_only else {n: ("g", ins.mb, io.layers.start - 1, n) for n in io.grad_out}
        keys = {n: k for n, k in keys.items() if info.readers.get(k, 0)}
        loss = io.kind.value == "FB"
        dst = {k: pool.handle() for k in keys.values()}
        if loss:
            dst[("loss", ins.mb)] = pool.handle()
        for k, h in dst.items():  # one persistent host buffer per value (see the class Note)
            known = self.shapes.get(k) if self.planned is None else self.planned[("t",) + k]
            if known is not None:  # learned shapes are not the arena's: their buffers are the pool's own
                pool.bind(h, *known, ad, t, key=("t" if self.planned is not None else "learned",) + k)

        def run() -> None:
            out = cell.get()
            vals = out.get("vals", out.get("grads", {}))
            items = [(k, vals[n]) for n, k in keys.items()] + ([(("loss", ins.mb), out["loss"])] if loss else [])
            for k, v in items:
                h = dst[k]
                if h.tensor is None:  # learning the shapes: warm-up, not keyed (see BufferPool.bind)
                    pool.bind(h, tuple(v.shape), v.dtype, ad, t)
                elif (h.tensor.shape, h.tensor.dtype) != (v.shape, v.dtype):  # planned at another shape or dtype
                    if pool.recast(h, v.shape, v.dtype) is None:
                        raise ValueError(f"{k[-1]} of microbatch {ins.mb} is {tuple(v.shape)} {v.dtype} here, larger "
                                         f"than its host buffer of {tuple(h.tensor.shape)} {h.tensor.dtype} (as "
                                         f"traced, or first seen): step batches shaped like the traced one")
                self.shapes.setdefault(k, (tuple(v.shape), v.dtype))
                keep_for(v, ad)  # a device value the download still reads (a CPU value needs nothing)
                h.get().copy_(v, non_blocking=True)
                self.ctx.stats.add(t, "bytes_to_host", tensor_bytes(v))
            if "hits" in out:
                self.its.add_hits(t, out["hits"].to("cpu"))  # two ints, evaluation only: a blocking copy is fine
            worker.store.add(-tensor_bytes(out))
        label = self.its.label(t, ins, w)
        ad.submit(run, label, t)
        ev = ad.record(t, label)
        track = self.poison and worker.kind == "host" and not info.forward_only
        for k in keys.values():
            self.hostvals[(t,) + k] = HostVal(handle=dst[k], event=ev, readers=info.readers[k],
                                              unread=self.arena_readers.get(k) if track else None)
        if loss:
            self.its.set_loss(t, ins.mb, (dst[("loss", ins.mb)], ev))
        return (ev,)

    def _read(self, hv: HostVal) -> None:
        """Poison mode: count one read of an arena buffer, in its upload's stream after the copy; the read
        that ends its live range (the assignment's last) poisons it before that upload's event completes,
        so the next buffer placed on its bytes, written after that event, is never hit by the fill."""
        with self._reads:
            hv.unread -= 1
            last = hv.unread == 0
        if last:
            poison(hv.handle.get())

    def _grad_down(self, t: int, ins, w: int) -> tuple:
        """G: download a chunk of the slot's gradient buffers into its unit's pinned ring buffer of the staging."""
        gd = self.workers[w].streams["grad_down"]
        slot = self.slots[(t, ins.stage, ins.round)]
        staging, copies = self.host.staging_for(t, ins, gd)
        grad_flat = slot.grad_flat

        def run() -> None:
            for d, src, dst, n in copies:
                staging[d][dst:dst + n].copy_(grad_flat[d].get()[src:src + n], non_blocking=True)
        label = self.its.label(t, ins, w)
        gd.submit(run, label, t)
        ev = gd.record(t, label)
        slot.last["grad_down"] = ev
        self.ctx.stats.add(t, "bytes_to_host", sum(n * _size(d) for d, _, _, n in copies))
        return (ev,)

    def _release(self, t: int, ins, w: int) -> tuple:
        """E: return the slot's parameter and gradient buffers to the pool, after their last users."""
        slot = self.slots.pop((t, ins.stage, ins.round), None) or ParamSlot()
        pool = self.workers[w].pool
        label = self.its.label(t, ins, w)
        self.workers[w].streams["compute"].submit(lambda: None, label, t)  # its place in the timeline
        self._give(pool, slot.flat.values(), [slot.last.get(k) for k in ("param_up", "compute")])
        self._give(pool, slot.grad_flat.values(), [slot.last.get(k) for k in ("compute", "grad_down")])
        return tuple(e for e in slot.last.values() if e is not None)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


HANDLER_NAMES = {Op.PARAM_UP: "_param_up", Op.ACT_UP: "_act_up", Op.FORWARD: "_forward", Op.FUSED: "_fused",
                 Op.RECOMPUTE: "_recompute", Op.BACKWARD: "_backward", Op.ACT_DOWN: "_act_down",
                 Op.GRAD_DOWN: "_grad_down", Op.RELEASE: "_release"}
