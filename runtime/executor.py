"""The runtime interpreter: a Program run on workers, one short handler per Op (DESIGN.md ideas 1-7).

    >>> with Runtime(graph, emit(plan, gpus=2, microbatches=4), HostState.from_graph(graph, optimizer=AdamW())) as rt:
    ...     loss = rt.step(batch)

Note: iterations and staleness. `step` runs iteration t (t counts calls) on the
template's workers shifted by t * program.shift, and returns once every device
instruction of t is done. With staleness 1 the optimizer steps and copies of t
run on in the background (the next `step` continues the rotation); with
staleness 0 `step` also waits for them.

Note: failures. The first exception in any lane or a dependency wait longer
than `timeout` abandons its iteration u and every later one; the caller's
`step`/`flush` drains the lanes (earlier iterations finish), undoes u and
re-raises a `RuntimeFailure` naming the instruction, with the grid. The state
is then that of the LAST COMPLETED STEP (the last `step` that returned), as
`flush()` would leave it: its optimizer steps applied (none of u's ran: an
iteration's first STEP waits for all its gradient downloads), compute copies
u overwrote restored from backups, gradients discarded; the next `step`
re-runs u. An optimizer failure leaves groups already stepped stepped (no undo log).
"""
from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
import time
from typing import Any

import torch

from rpcompile.program import Lane, Op
from rpcompile.runtime.devices import HostStore, make_devices, saved_tensors_bytes, tensor_bytes
from rpcompile.runtime.stage_exec import (LayerRunner, chunk_elements, count_readers, grads_of, has_random_ops,
                                          split_batch, stage_io, up_keys)
from rpcompile.runtime.transfer import Board, LaneThread, RuntimeFailure, make_delay, protocol_deps, sleep_for

__all__ = ["Runtime", "run", "RuntimeFailure"]


class Runtime:
    """Runs a Program on N workers (CUDA devices or host threads) against a HostState.

    Args:
        graph: the traced LayerGraph the program's plan covers.
        program: from `rpcompile.passes.emit`.
        state: `rpcompile.runtime.optimizer.HostState` of the graph's parameters.
        backend: "auto" (CUDA if available), "host" or "cuda".
        devices: CUDA devices per worker (cycled); default all visible.
        seed: base seed of the per-(iteration, microbatch, layer) RNG (dropout).
        lane_delay: test hook: callable(worker, lane, instr_name) -> seconds, or an int seed
            for random 0-2 ms delays before each instruction.
        timeout: seconds an instruction may wait for a dependency before it counts as hung.
        start_iteration: the iteration number of the first `step` (resuming a checkpoint: earlier
            iterations count as complete, so their refs are satisfied).
    """

    def __init__(self, graph, program, state, *, backend: str = "auto", devices=None, seed: int = 0,
                 lane_delay=None, timeout: float = 60.0, start_iteration: int = 0) -> None:
        self.graph, self.program, self.state = graph, program, state
        self.devices = make_devices(program.gpus, backend, devices)
        self.io = stage_io(graph, program.plan)
        self.seed, self.delay, self.timeout = seed, make_delay(lane_delay), timeout
        rng_lock = threading.Lock() if has_random_ops(graph) else None
        self.runners = [LayerRunner(graph, d.device, seed, rng_lock) for d in self.devices]
        self.host = HostStore("host")  # activations and gradients between stages, model inputs
        touches = {l.index: {state.group_of[state.canonical(p)] for p in l.params
                             if state.canonical(p) in state.group_of} for l in graph.layers}
        self.deps = protocol_deps(program, touches)
        self.maxback = max((r.back for v in self.deps.values() for r in v), default=0)
        self.readers = count_readers(program, self.io)
        self.chunk_elems, self.pieces = chunk_elements(program, self.io, state)
        self.handlers = {Op.PARAM_UP: self._param_up, Op.ACT_UP: self._act_up, Op.FORWARD: self._forward,
                         Op.FUSED: self._fused, Op.RECOMPUTE: self._recompute, Op.BACKWARD: self._backward,
                         Op.ACT_DOWN: self._act_down, Op.GRAD_DOWN: self._grad_down, Op.RELEASE: self._release,
                         Op.STEP: self._step, Op.COPY: self._copy}
        self.board = Board(timeout)
        self.t = self.first = start_iteration  # the next iteration; the first this runtime runs
        self.last_timeline: list[tuple[str, int, str, float, float]] = []
        self._lock = threading.Lock()  # guards the per-iteration dicts below
        self._losses: dict[int, list] = {}
        self._records: dict[int, list] = {}
        self._t0: dict[int, float] = {}
        self._scales: dict[int, float] = {}
        self._staging: dict[tuple, list] = {}  # (t, stage, round, name) -> [flat host grad, pieces left]
        self._backups: dict[int, dict[str, torch.Tensor]] = {}  # t -> compute copies before t's COPYs
        self._pending: dict[int, list[tuple[int, str]]] = {}  # t -> instances step/flush must see done
        self._committed = start_iteration  # iterations < this have returned from step()
        self._evaluator: LayerRunner | None = None
        self.lanes: dict[tuple[int, Lane], LaneThread] = {}
        me = weakref.ref(self)
        self._at_exit = lambda: me() is not None and me().close()  # lane threads must not outlive torch
        atexit.register(self._at_exit)
        for w in range(-1, program.gpus):
            for lane in ((Lane.OPTIMIZER, Lane.COPY) if w < 0 else
                         (Lane.COMPUTE, Lane.ACT_UP, Lane.PARAM_UP, Lane.ACT_DOWN, Lane.GRAD_DOWN)):
                th = LaneThread(f"{'h' if w < 0 else f'w{w}'}/{lane.value}", self._execute)
                self.lanes[(w, lane)] = th
                th.start()

    # -- the interpreter --------------------------------------------------------------------------
    def _worker(self, t: int, w: int) -> int:
        """Physical worker of template worker w in iteration t."""
        return w if w < 0 else (w + t * self.program.shift) % self.program.gpus

    def _execute(self, item: Any) -> None:
        """Lane-thread body: wait for the dependencies, run the handler, record, signal (or fail)."""
        if isinstance(item, threading.Event):
            item.set()
            return
        t, ins = item
        w = self._worker(t, ins.worker)
        name = ins.name if w < 0 else f"w{w} {ins.short}"
        keys = [(t - r.back, r.name) for r in self.deps[ins.name] if t - r.back >= self.first and t >= r.since]
        try:
            if not self.board.wait(keys, t, f"{name} (iteration {t})"):
                return
            sleep_for(self.delay, w, ins.lane.value, name)
            dev = self.devices[w] if w >= 0 else None
            start = time.perf_counter()
            with dev.lane(ins.lane.value) if dev else contextlib.nullcontext():
                keep = self.handlers[ins.op](t, ins, dev)  # noqa: F841 - alive until the lane synced
                if dev is not None:
                    dev.sync(ins.lane.value)
            end = time.perf_counter()
            with self._lock:
                t0 = self._t0.get(t, start)
                self._records.setdefault(t, []).append((name, w, ins.lane.value, start - t0, end - t0))
            self.board.finish((t, ins.name))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self.board.fail(t, name, exc)

    def _params(self, dev, t: int, ins, grad: bool) -> dict[str, torch.Tensor]:
        """The slot's device parameters; trainable ones become leaves that collect gradients."""
        params = dev.store.get(("p", t, ins.stage, ins.mb // self.program.round_size))
        if grad:
            for n, p in params.items():
                if n in self.state.master and not p.requires_grad:
                    p.requires_grad_(True)
        return params

    # -- handlers: one per Op ---------------------------------------------------------------------
    def _param_up(self, t: int, ins, dev) -> None:
        """P: copy one chunk of the stage's compute copies into the worker's parameter buffers."""
        key = ("p", t, ins.stage, ins.round)
        if not dev.store.has(key):
            dev.store.put(key, {n: dev.empty(self.state.read(n).shape, self.state.read(n).dtype)
                                for n in self.io[ins.stage].params})
        params = dev.store.get(key)
        for n, a, b in self.chunk_elems[(ins.stage, ins.chunk)]:
            with torch.no_grad():
                dev.copy_in(params[n].view(-1)[a:b], self.state.read(n).reshape(-1)[a:b], "param_up")

    def _act_up(self, t: int, ins, dev) -> None:
        """U: upload a microbatch's stage input, a B stage's saved input, or ("g") its output gradient."""
        vals = {k[-1]: dev.to_device(self.host.take((t,) + k), "act_up") for k in up_keys(self.io, ins)}
        dev.store.put(("gin" if ins.grad else "in", t, ins.stage, ins.mb), vals)

    def _forward(self, t: int, ins, dev) -> dict:
        """F: forward of the stage's layers (no autograd); keep what the download sends."""
        io, inputs = self.io[ins.stage], dev.store.pop(("in", t, ins.stage, ins.mb))
        with torch.no_grad():
            env = self.runners[dev.index].forward(io.layers, self._params(dev, t, ins, False), inputs, t, ins.mb)
        dev.store.put(("out", t, ins.stage, ins.mb), {n: env[n] for n in io.down})
        return inputs

    def _fused(self, t: int, ins, dev) -> dict:
        """X: forward through the loss and backward (grad_output = scale / M); keep loss and input grads."""
        io, inputs = self.io[ins.stage], dev.store.pop(("in", t, ins.stage, ins.mb))
        params = self._params(dev, t, ins, True)
        with torch.enable_grad(), saved_tensors_bytes(dev.store, ("ws", t, ins.stage, ins.mb), params, inputs):
            env = self.runners[dev.index].forward(io.layers, params, inputs, t, ins.mb, grad_of=io.grad_out)
            loss = env[self.graph.loss]
            loss.backward(torch.full_like(loss, self._scales[t] / self.program.microbatches))
        self._count_grads(dev, t, ins, params)
        dev.store.put(("out", t, ins.stage, ins.mb), {"grads": grads_of(env, io.grad_out, {}), "loss": loss.detach()})
        return inputs

    def _recompute(self, t: int, ins, dev) -> None:
        """R: forward again from the saved input, same RNG seeds as the forward; keep the autograd graph."""
        io, inputs = self.io[ins.stage], dev.store.pop(("in", t, ins.stage, ins.mb))
        params = self._params(dev, t, ins, True)
        key = ("ws", t, ins.stage, ins.mb)
        with torch.enable_grad(), saved_tensors_bytes(dev.store, key, params, inputs, keep=True):
            env = self.runners[dev.index].forward(io.layers, params, inputs, t, ins.mb, grad_of=io.grad_out)
        dev.store.put(("rc", t, ins.stage, ins.mb), env, nbytes=tensor_bytes(inputs))

    def _backward(self, t: int, ins, dev) -> tuple:
        """B: backward from the received output gradients; param grads accumulate on the device."""
        io = self.io[ins.stage]
        env, gin = dev.store.pop(("rc", t, ins.stage, ins.mb)), dev.store.pop(("gin", t, ins.stage, ins.mb))
        outs = [(env[n], gin[n]) for n in io.grad_in if n in env and env[n].requires_grad]
        if outs:
            torch.autograd.backward([o for o, _ in outs], [g for _, g in outs])
        dev.store.pop(("ws", t, ins.stage, ins.mb), None)
        self._count_grads(dev, t, ins, self._params(dev, t, ins, True))
        dev.store.put(("out", t, ins.stage, ins.mb), {"grads": grads_of(env, io.grad_out, gin)})
        return env, gin

    def _act_down(self, t: int, ins, dev) -> dict:
        """D: download an F stage's outputs and saved inputs, or a backward's input gradients (and loss)."""
        io, out = self.io[ins.stage], dev.store.pop(("out", t, ins.stage, ins.mb))
        if "grads" in out:
            cut = io.layers.start - 1
            items = {("g", ins.mb, cut, n): g for n, g in out["grads"].items()}
        else:
            items = {("a", ins.mb, n): v for n, v in out.items()}
        for k, v in items.items():
            if self.readers.get(k, 0):
                self.host.put_for((t,) + k, dev.to_host(v, "act_down"), self.readers[k])
        if "loss" in out:
            self._losses[t][ins.mb] = dev.to_host(out["loss"], "act_down")
        return out

    def _grad_down(self, t: int, ins, dev) -> None:
        """G: download a chunk of the slot's accumulated gradients; add complete ones to the host buffers."""
        params = dev.store.get(("p", t, ins.stage, ins.round))
        parts = []
        for n, a, b in self.chunk_elems[(ins.stage, ins.chunk)]:
            g = params[n].grad if n in self.state.master else None
            parts.append((n, a, b, None if g is None else dev.to_host(g.reshape(-1)[a:b], "grad_down")))
        dev.sync("grad_down")
        for n, a, b, part in parts:
            if n not in self.state.master:
                continue
            key = (t, ins.stage, ins.round, n)
            with self._lock:
                buf = self._staging.setdefault(key, [torch.zeros(params[n].numel(), dtype=torch.float32),
                                                     self.pieces[(ins.stage, n)]])
                if part is not None:
                    buf[0][a:b] = part
                buf[1] -= 1
                done = buf[1] == 0 and self._staging.pop(key)
            if done:
                self.state.accumulate_grad(n, done[0].view(params[n].shape))

    def _release(self, t: int, ins, dev) -> dict:
        """E: free the slot's parameters and gradients on the worker."""
        dev.store.pop(("pg", t, ins.stage, ins.round), None)
        return dev.store.pop(("p", t, ins.stage, ins.round))

    def _step(self, t: int, ins, dev) -> None:
        """O: the optimizer step of one layer group (host); R3 holds, so every gradient is complete."""
        if self.state.needs_global:  # clipping / dynamic loss scale: the global statistics need all groups
            self.state.grads_complete_all()
        self.state.step(ins.layer)

    def _copy(self, t: int, ins, dev) -> None:
        """C: master -> compute copy of one layer group (staleness 1: backed up until t commits)."""
        with self._lock:
            if self.program.staleness == 1 and t >= self._committed:
                bak = self._backups.setdefault(t, {})
                for n in self.state.groups[ins.layer]:
                    bak.setdefault(n, self.state.read(n).clone())
        self.state.copy(ins.layer)

    def _count_grads(self, dev, t: int, ins, params: dict) -> None:
        """Handler helper: account the slot's parameter gradients once they exist."""
        key = ("pg", t, ins.stage, ins.mb // self.program.round_size)
        if not dev.store.has(key):
            dev.store.put(key, None, nbytes=sum(tensor_bytes(p) for n, p in params.items() if n in self.state.master))

    # -- the public calls -------------------------------------------------------------------------
    def step(self, batch: Any) -> float:
        """Run one training iteration on `batch` (one global batch); returns the mean microbatch loss.

        Raises:
            ValueError: the batch does not split into the program's microbatches.
            RuntimeFailure: an instruction failed (see the module Note; the next call works).
        """
        if self.board.error is not None:
            self._recover()
        t, m = self.t, self.program.microbatches
        mbs = split_batch(self.graph, batch, m)
        with self._lock:
            self._t0[t] = time.perf_counter()
            self._losses[t] = [None] * m
            if t not in self._scales:
                self._scales[t] = self.state.begin_iteration()
        for j, inputs in enumerate(mbs):
            for n, v in inputs.items():
                if self.readers.get(("a", j, n), 0):
                    self.host.put_for((t, "a", j, n), v, self.readers[("a", j, n)])
        host_wait = self.program.staleness == 0
        self._pending[t] = [(t, i.name) for i in self.program.instrs]
        for i in self.program.instrs:
            self.lanes[(self._worker(t, i.worker), i.lane)].submit((t, i))
        self._wait([(t, i.name) for i in self.program.instrs if host_wait or not i.is_host])
        with self._lock:
            self._committed = t + 1
            self._backups.pop(t, None)
            self.last_timeline = sorted(self._records.pop(t, []), key=lambda r: (r[3], r[0]))
            losses = self._losses.pop(t)
            self._t0.pop(t, None)
            self._scales.pop(t, None)
        self.t = t + 1
        self._prune()
        return float(sum(float(x) for x in losses) / m)

    def evaluate(self, batch: Any) -> float:
        """Forward only with the weights the next step reads; mean microbatch loss; no state change."""
        self.flush()
        if self._evaluator is None:
            self._evaluator = LayerRunner(self.graph, self.devices[0].device, self.seed, self.runners[0].rng_lock)
        dev = self.devices[0].device
        params = {n: self.state.read(n).to(dev) for n in self.state.compute}
        losses = []
        with torch.no_grad():
            for j, inputs in enumerate(split_batch(self.graph, batch, self.program.microbatches)):
                env = self._evaluator.forward(range(len(self.graph.layers)), params,
                                              {n: v.to(dev) for n, v in inputs.items()}, -1, j)
                losses.append(float(env[self.graph.loss]))
        return sum(losses) / len(losses)

    def flush(self) -> None:
        """Wait for all pending optimizer work; afterwards the HostState is quiescent.

        Raises:
            RuntimeFailure: a background instruction (e.g. an optimizer step) failed.
        """
        self._wait([k for t in sorted(self._pending) for k in self._pending[t]])
        self._prune()

    def close(self) -> None:
        """Finish queued work and stop the lane threads (also run at interpreter exit if forgotten)."""
        atexit.unregister(self._at_exit)
        for th in self.lanes.values():
            th.stop()
        for th in self.lanes.values():
            th.join(timeout=self.timeout)

    def __enter__(self) -> "Runtime":  # noqa: D105
        return self

    def __exit__(self, *exc: Any) -> None:  # noqa: D105
        self.close()

    def peak_memory(self) -> list[int]:
        """Peak accounted bytes of each worker since construction (or `reset_peaks`)."""
        return [d.store.peak for d in self.devices]

    def reset_peaks(self) -> None:
        """Start new per-worker peak measurements."""
        for d in self.devices:
            d.store.reset_peak()

    # -- waiting and failure recovery ------------------------------------------------------------
    def _wait(self, keys: list[tuple[int, str]]) -> None:
        """Block until `keys` completed; on any failure recover and raise."""
        t = keys[0][0] if keys else self.t
        while not self.board.wait_all(keys, t, timeout=1.0):
            if self.board.error is not None:
                self._recover()

    def _prune(self) -> None:
        """Forget completed pending iterations and completion records no Ref can reach."""
        for t in list(self._pending):
            if all(self.board.is_done(k) for k in self._pending[t]):
                del self._pending[t]
        keep = min([self.t] + list(self._pending)) - self.maxback  # refs of unfinished instances reach back
        self.board.forget_before(keep)

    def _recover(self) -> None:
        """Drain the lanes, undo the abandoned iterations and raise the failure as RuntimeFailure."""
        exc, name, _, tb = self.board.error
        u = self.board.failed_from
        done = []
        for th in self.lanes.values():
            ev = threading.Event()
            th.submit(ev)
            done.append(ev)
        for ev in done:
            ev.wait()
        for t in sorted((t for t in self._backups if t >= u), reverse=True):
            for n, v in self._backups.pop(t).items():
                self.state.compute[n].copy_(v)
        self.state.discard_grads()  # iteration u's partial gradients
        for store in [self.host] + [d.store for d in self.devices]:
            store.drop_where(lambda k: isinstance(k[0], int) and k[0] >= u or len(k) > 1 and isinstance(k[1], int)
                             and k[0] in ("p", "pg", "in", "gin", "out", "rc", "ws") and k[1] >= u)
        with self._lock:
            for d in (self._losses, self._records, self._t0, self._pending):
                for t in [t for t in d if t >= u]:
                    del d[t]
            self._staging = {k: v for k, v in self._staging.items() if k[0] < u}
        self.board.reset(keep_below=u)
        self.t = u
        grid = self.program.shifted(u).grid(mark=name if name.startswith("w") or name.startswith("h") else None,
                                            context=4)
        raise RuntimeFailure(f"instruction {name} of iteration {u} failed: {type(exc).__name__}: {exc}\n"
                             f"{grid}\n--- worker traceback ---\n{tb}", name, u) from exc


def run(graph, program, state, batches, **kwargs: Any) -> list[float]:
    """Train on `batches` (one per iteration) and return the losses; `kwargs` go to `Runtime`."""
    with Runtime(graph, program, state, **kwargs) as rt:
        losses = [rt.step(b) for b in batches]
        rt.flush()
    return losses
