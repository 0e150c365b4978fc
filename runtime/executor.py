"""The runtime interpreter: a Program issued onto worker streams, one handler per Op (DESIGN.md ideas 1-7, 3a).

    >>> with Runtime(graph, emit(plan, gpus=2, microbatches=4), HostState.from_graph(graph, optimizer=AdamW())) as rt:
    ...     loss = rt.step(batch)                                   # doctest: +SKIP

`Runtime` composes parts that each own their state and are handed what they
need:

- `Iterations` (`runtime/iterations.py`): the next iteration `t`, what each
  iteration in flight runs, its loss downloads and loss scale;
- `IssueBoard` (`runtime/board.py`): which instruction instances are issued;
- `Issuer` (`runtime/issuer.py`): per worker, an issuing thread that walks the
  program in order, waits on the host only until the instruction's producers
  are *issued*, makes its stream wait on their events and calls the Op's
  handler from the dispatch table;
- `IssueHandlers` (`runtime/handlers.py`): one handler per Op, and the device
  side's per-iteration tables (slots, uploaded inputs, outputs);
- `HostLanes` (`runtime/host_lanes.py`): the threads that accumulate
  gradients, step and copy, with their events, staging and undo backups;
- `Recovery` (`runtime/recovery.py`): drain, prune, undo a failure.

What it reports about its runs (`stats`, `last_timeline`, `peak_memory`) comes
from the `RuntimeReports` mixin (`runtime/reports.py`).

The host blocks on device work only where host code consumes it: the losses
`step` returns, a gradient slot the host adds up, the uploads a copy must not
overwrite (R1).

Note: iterations and staleness. `step` runs iteration t (t counts calls) on the
template's workers shifted by t * program.shift and returns once t's losses
are known; the rest of t (lower backward stages, gradient downloads, the
optimizer) runs on while the next `step` issues t+1, so the rotation continues
without a drain. `flush()` waits for everything.

Note: failures. The first exception in any issuer, stream or host lane (or a
wait longer than `timeout`) abandons its iteration u and every later one. The
next call (`step`, `flush`, `evaluate`) drains every stream, undoes u and
re-raises a `RuntimeFailure` naming the instruction, with the grid. The state
is then that after iteration u-1: none of u's optimizer steps ran (an
iteration's first STEP waits for all its gradients), compute copies u
overwrote are restored, its gradients discarded; `t` goes back to u, so the
next `step` runs iteration u (with the batch it is given). An optimizer failure
leaves groups already stepped stepped (no undo log).
"""
from __future__ import annotations

import atexit
import math
import weakref
from typing import Any

import torch

from rpcompile.ir.program import Op
from rpcompile.runtime.board import IssueBoard
from rpcompile.runtime.streams.devices import make_workers
from rpcompile.runtime.handlers import IssueHandlers
from rpcompile.runtime.host_lanes import HostLanes
from rpcompile.runtime.issuer import Issuer
from rpcompile.runtime.iterations import Iterations
from rpcompile.runtime.host.assign import assign_buffers, check_assignment
from rpcompile.runtime.host.buffers import arena_views, pool_buffers
from rpcompile.runtime.host.layout import slot_capacities, stage_layouts
from rpcompile.runtime.host.pinned import PinnedAllocator, pinned_zeros
from rpcompile.runtime.streams.pool import BufferPool
from rpcompile.runtime.program_info import EVAL_BASE, ProgramInfo, forward_only
from rpcompile.runtime.recovery import Recovery
from rpcompile.runtime.reports import RuntimeReports
from rpcompile.runtime.stage.batch import split_batch
from rpcompile.runtime.stage.cuts import chunk_elements, stage_io
from rpcompile.runtime.stage.routing import RoutingLog
from rpcompile.runtime.stage.runner import LayerRunner, has_random_ops, tracked_buffers
from rpcompile.runtime.streams.host import StreamContext, duration, wait_all
from rpcompile.runtime.transfer import RuntimeFailure, check_pinned, make_delay, protocol_deps, stop_threads

__all__ = ["Runtime", "run", "RuntimeFailure", "DEP_KINDS", "check_pinned"]

DEP_KINDS = ("act_up>compute", "param_up>compute", "compute>act_down", "compute>grad_down", "grad_down>step",
             "copy>param_up", "reader>release", "step>grad_down")  # what `drop` may name (a test switch)


class Runtime(RuntimeReports):
    """Runs a Program on N workers (CUDA devices or host workers) against a HostState.

    Args:
        graph: the traced LayerGraph the program's plan covers.
        program: from `rpcompile.passes.emit`.
        state: `rpcompile.runtime.host.optimizer.HostState` of the graph's parameters.
        backend: "auto" (CUDA if available), "host" or "cuda".
        devices: CUDA devices per worker (cycled); default all visible.
        seed: base seed of the per-(iteration, microbatch, layer) RNG (dropout).
        lane_delay: test hook: callable(worker, lane, label) -> seconds, or an int seed for random
            0-2 ms delays, slept inside the host streams before each item.
        timeout: seconds any wait may last before it counts as a hang (a `DeadlineExceeded`, raised as a
            RuntimeFailure naming the instruction); None: `DEADLINE_FLOOR_S` (10 minutes). `compile`
            passes one derived from the plan's costs (`rpcompile.runtime.transfer.plan_deadline`).
        drain_timeout: the least seconds a drain (after a failure, `flush`, `close`) or a committed iteration's host
            work waits for work in flight (`StreamContext.drain_bound`); None: `DEADLINE_FLOOR_S` (compile: the plan's).
        start_iteration: the iteration number of the first `step` (resuming a checkpoint: earlier
            iterations count as complete, so their refs are satisfied).
        poison: test mode: pool buffers are NaN when handed out, host buffers when released.
        drop: test switch: dependency kinds (names in DEP_KINDS) the runtime does NOT wait for.
        on_nonfinite: a NaN/inf loss or gradient, caught at an iteration's commit point (before any
            of its optimizer steps): "raise" (NonFiniteError, a FloatingPointError, from the `step`
            whose loss is non-finite, else from the next call; the iteration is undone) or "skip" (its
            steps apply nothing; listed in `skipped`).
            Not checked with fp16 dynamic loss scaling, which skips such iterations itself.
        fp16_accumulation: CUDA workers run their compute launches with fp16 GEMM accumulation
            (`torch.backends.cuda.matmul.allow_fp16_accumulation`, restored after each; see
            `streams.cuda.Fp16Accumulation`). No effect on host workers.
        pinned: what pins the runtime's host buffers (gradient staging, the host pool's downloads, step
            inputs and losses) at their exact size: None, a new `runtime.host.pinned.PinnedAllocator`
            with CUDA workers and no pinning with host workers; or a PinnedAllocator to use (a test's,
            with a registrar that records the bytes), on either backend. `close` unregisters them all;
            `runtime.host.buffers.transfer_bytes` counts them before the run.
        assignment: the program's host `BufferAssignment` (`runtime.host.assign`), checked against it;
            None: made here. Its arena is allocated once, at its exact size (pinned as above), and each
            downloaded value's host buffer is a view of it.

    Note: what it owns. The pieces derived once from the program and the graph (workers, host
    pool, stage layouts, runners, ...) are built here and handed to the parts, which own the
    changing state (see the module docstring); `Runtime` itself changes only `closed` and the
    evaluation count. `t`, `first` and `skipped` read the parts' records; `handlers` (the
    dispatch table), `issuers` and `lanes` (the threads) are the parts' own objects.
    """

    def __init__(self, graph, program, state, *, backend: str = "auto", devices=None, seed: int = 0,
                 lane_delay=None, timeout: float | None = None, start_iteration: int = 0, poison: bool = False,
                 drop: tuple[str, ...] = (), on_nonfinite: str = "raise", fp16_accumulation: bool = False,
                 pinned: PinnedAllocator | None = None, drain_timeout: float | None = None,
                 assignment: Any = None) -> None:
        bad = set(drop) - set(DEP_KINDS)
        if bad:
            raise ValueError(f"drop: unknown dependency kinds {sorted(bad)}; choose from {DEP_KINDS}")
        self.graph, self.program, self.state, self.seed = graph, program, state, seed
        self.poison, self.drop = poison, frozenset(drop)
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
        self.on_nonfinite = on_nonfinite
        self.ctx = StreamContext(timeout=duration("timeout", timeout), delay=make_delay(lane_delay),
                                 drain=duration("drain_timeout", drain_timeout))
        self.workers = make_workers(program.gpus, self.ctx, backend, devices, poison, fp16_accumulation)
        cuda = self.workers[0].kind == "cuda"
        self.pin = pinned if pinned is not None else PinnedAllocator() if cuda else False  # exact-size host pins
        check_pinned(state, self.workers[0].kind)
        dtype = getattr(state, "dtype", None)
        self.assignment = check_assignment(assignment, graph, program, dtype) if assignment is not None \
            else assign_buffers(graph, program, dtype)
        self.arena = pinned_zeros(self.assignment.arena, torch.uint8, self.pin)  # once, at its exact size
        self.ctx.stats.add(None, "host_allocations")
        planned = pool_buffers(graph, program, dtype)
        self.host_pool = BufferPool("host", self.ctx, pin=self.pin, poison="release" if poison else None,
                                    counter="host_allocations", views=arena_views(self.assignment, self.arena, planned))
        self.io = stage_io(graph, program.plan)
        self.tracked = {l: {n: state.buffers[n] for n in bufs}  # layer -> host copies of its running statistics
                        for l, bufs in tracked_buffers(graph).items()}
        random = has_random_ops(graph)
        self.routes = RoutingLog(timeout)  # MoE routing of the forwards, for their recomputes
        self.runners = [LayerRunner(graph, w.device, seed, w.generator if random else None, self.routes)
                        for w in self.workers]
        touches = {l.index: {state.group_of[state.canonical(p)] for p in l.params
                             if state.canonical(p) in state.group_of} for l in graph.layers}
        self.train_info = ProgramInfo.of(program, protocol_deps(program, touches), self.io)
        self.eval_info: ProgramInfo | None = None
        self.chunk_elems, _ = chunk_elements(program, self.io, state)
        self.layouts = stage_layouts(program, self.io, state, self.chunk_elems)
        self.capacity = slot_capacities(program, self.layouts)  # buffer sizes over a rotation period
        # the parts, each owning its state (docstrings of their classes), in the order they need each other
        self.iterations = Iterations(program, start_iteration)
        self.board = IssueBoard(self.ctx)
        self.host = HostLanes(ctx=self.ctx, state=state, graph=graph, layouts=self.layouts, its=self.iterations,
                              board=self.board, host_pool=self.host_pool, drop=self.drop, poison=poison,
                              pin=self.pin, on_nonfinite=on_nonfinite)
        self.issue = IssueHandlers(graph=graph, io=self.io, layouts=self.layouts, capacity=self.capacity,
                                   tracked=self.tracked, runners=self.runners, workers=self.workers,
                                   host_pool=self.host_pool, state=state, ctx=self.ctx, drop=self.drop,
                                   board=self.board, its=self.iterations, host=self.host,
                                   planned=planned, poison=poison,
                                   arena_readers={b.key: len(b.readers) for b in self.assignment.buffers})
        self.issuer = Issuer(ctx=self.ctx, workers=self.workers, drop=self.drop, board=self.board,
                             its=self.iterations, host=self.host, table=self.issue.table())
        self.handlers, self.issuers, self.lanes = self.issuer.handlers, self.issuer.threads, self.host.lanes
        self.recovery = Recovery(ctx=self.ctx, threads=(self.issuers, list(self.lanes.values())),
                                 workers=self.workers, host_pool=self.host_pool, board=self.board,
                                 its=self.iterations, host=self.host, handlers=self.issue, routes=self.routes,
                                 state=state,
                                 program=program, max_back=self.train_info.max_back)
        self._evals = 0
        self.closed = False
        for th in self.issuers + list(self.lanes.values()):
            th.start()
        me = weakref.ref(self)
        self._at_exit = lambda: me() is not None and me().close()  # threads must not outlive torch
        atexit.register(self._at_exit)
        # dropped without close() (a handle made in a function that returns): its threads would outlive it and
        # torch, and the interpreter's exit abort ("terminate called without an active exception")
        self._reaper = weakref.finalize(self, stop_threads, self.ctx, self.issuers + list(self.lanes.values()),
                                        self.workers, self.pin)
        self._reaper.atexit = False  # at exit `_at_exit` closes a live runtime, draining its work first

    @property
    def t(self) -> int:
        """The next training iteration `step` runs."""
        return self.iterations.t

    @property
    def first(self) -> int:
        """The first iteration this runtime runs (earlier ones count as complete)."""
        return self.iterations.first

    @property
    def timeout(self) -> float:
        """Seconds any wait may last before it fails as a hang (the deadline); settable (for the waits from then on)."""
        return self.ctx.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.ctx.timeout = self.ctx.stats.timeout = self.routes.timeout = duration("timeout", seconds)

    @property
    def skipped(self) -> list[int]:
        """Iterations skipped for a non-finite loss or gradient (on_nonfinite="skip")."""
        return self.host.skipped

    # -- one iteration's submission and losses ---------------------------------------------------------
    def _submit(self, t: int, info: ProgramInfo, mbs: list[dict], weights: list[float] | None = None) -> list:
        """Stage iteration t's microbatch inputs and queue its work on every issuer (and host lane).

        `weights`: each microbatch's factor in the iteration's loss (None: 1 / M each); set before
        anything is issued, so the fused stage's backward uses them.

        Returns:
            The list the loss downloads fill with (host buffer, event) per microbatch.
        """
        losses = self.iterations.begin(t, info, len(mbs), weights)
        self.issue.stage_inputs(t, info, mbs)
        if not info.forward_only:
            self.host.make_events(t, info)
            self.iterations.fix_scale(t, lambda: self._loss_scale(t, info.program.staleness))
        self.issuer.submit(t, info)
        if not info.forward_only:
            self.host.submit(t)
        return losses

    def _loss_scale(self, t: int, lag: int) -> float:
        """Iteration t's loss scale (`HostState.begin_iteration`). A dynamic one is left by the overflow check of
        iteration t - 1 - lag (lag = staleness), which that iteration's first STEP makes: waited for here, where a
        failure aborts the wait, before the state reads it."""
        u = t - 1 - lag
        info = self.iterations.info.get(u)
        if self.state.scaler is not None and info is not None and info.host[Op.STEP]:
            wait_all([self.host.events.get((u, info.host[Op.STEP][0].name))], self.ctx, t)
        return self.state.begin_iteration(lag)

    def _losses(self, t: int, info: ProgramInfo, pairs: list) -> float:
        """Wait (one host wait) for iteration t's microbatch losses; their mean (weighted if t has weights).

        In training the commit check (`HostLanes._check_finite`) reads them too (`Iterations.read_losses`:
        the first reader hands the buffers back, so t+1's loss downloads never wait for t's commit).
        """
        for name in info.loss_downs:
            self.board.get((t, name), t, "step")
        values = self.iterations.read_losses(t, self.ctx, lambda h: self.host_pool.give(h, []))
        return self.iterations.mean(t, values)

    def _check_open(self) -> None:
        """Raise RuntimeError if the runtime is closed."""
        if self.closed:
            raise RuntimeError("this runtime is closed (close() or leaving `with`); compile again to train")

    # -- the public calls -------------------------------------------------------------------------------
    def step(self, batch: Any, weights: list[float] | None = None) -> float:
        """Run one training iteration on `batch` (one global batch); returns the mean microbatch loss.

        Args:
            batch: the iteration's batch.
            weights: optional, per microbatch, the factor its loss counts with (token weighting:
                n_m / N, see `stage.batch.token_weights`); the loss returned is then the weighted
                sum, and the gradient that of the weighted sum. A weight-0 microbatch is left out of
                both (no backward, its loss counts as 0).

        Raises:
            ValueError: the batch does not split into the program's microbatches.
            RuntimeFailure: an instruction failed (see the module Note; the next call works).
            NonFiniteError: (a FloatingPointError) the loss it would return is NaN/inf, with
                on_nonfinite="raise" and no dynamic loss scale: the iteration is undone first. A
                non-finite gradient under a finite loss raises from the next call.
            RuntimeError: the runtime is closed.
        """
        self._check_open()
        if self.ctx.failure.error is not None:
            self.recovery.recover()
        t = self.t
        mbs = split_batch(self.graph, batch, self.program.microbatches)  # a bad batch raises before anything runs
        # an earlier iteration may fail while t is being staged (its inputs' buffers then wait on aborted
        # events): recovered and raised as that failure, like a failure seen while waiting for the losses
        pairs = self.recovery.guard(lambda: self._submit(t, self.train_info, mbs, weights), t)
        self.iterations.advance()
        loss = self.recovery.guard(lambda: self._losses(t, self.train_info, pairs), t)
        self._stock_pools(t)
        self.recovery.prune()
        if not math.isfinite(loss) and self.on_nonfinite == "raise" and self.state.scaler is None:
            self._raise_from_commit(t)
        return loss

    def _raise_from_commit(self, t: int) -> None:
        """A non-finite loss to return: let iteration t reach its commit check, which fails it; raise that here.

        The check (`HostLanes._check_finite`, before any of t's optimizer steps) records the failure;
        draining waits for it, and `recover` undoes t and raises the NonFiniteError from this `step`
        instead of from the next call.
        """
        self.recovery.drain()
        if self.ctx.failure.error is not None:
            self.recovery.recover()

    def _stock_pools(self, t: int) -> None:
        """Stock each worker's pool with as many buffers of each shape as any worker's holds (`BufferPool.stock`).

        Worker w plays template worker w - t * shift in iteration t, so a part that needs an extra
        activation buffer reaches a given worker only some iterations in; without this, a 7-stage plan
        on 4 workers still allocated in its third step.
        """
        if len(self.workers) < 2:
            return
        most: dict[tuple, int] = {}
        for w in self.workers:
            for k, n in w.pool.made().items():
                most[k] = max(most.get(k, 0), n)
        for w in self.workers:
            w.pool.stock(most, t)

    def evaluate(self, batch: Any, weights: list[float] | None = None, *, hits: bool = False) -> Any:
        """Forward only with the weights the next step reads, streamed through the workers; no state change.

        `weights`: as for `step` (per-microbatch loss factors; None: the mean). The layers run in
        eval mode (`LayerRunner.run_layer`).

        Returns:
            The mean microbatch loss (the weighted sum with `weights`); with `hits`, (that loss,
            (targets predicted right, targets counted)) of the loss's cross-entropy, or (loss, None)
            when the loss computes none.
        """
        self.flush()
        if self.eval_info is None:
            prog = forward_only(self.program)
            self.eval_info = ProgramInfo.of(prog, {i.name: i.deps for i in prog.instrs}, self.io)
        mbs = split_batch(self.graph, batch, self.program.microbatches)
        t = EVAL_BASE + self._evals
        self._evals += 1
        made = self.issue.slot_counts()  # training's buffer parities go on after the evaluation's slots
        pairs = self.recovery.guard(lambda: self._submit(t, self.eval_info, mbs, weights), t)
        loss = self.recovery.guard(lambda: self._losses(t, self.eval_info, pairs), t)
        self.flush()
        right = self.iterations.take_hits(t)
        self.iterations.end(t)
        self.issue.restore_slot_counts(made)
        return (loss, right) if hits else loss

    def flush(self) -> None:
        """Wait for all issued work (optimizer steps included); afterwards the HostState is quiescent.

        Raises:
            RuntimeFailure: a background instruction (e.g. an optimizer step) failed.
        """
        self._check_open()
        self.recovery.drain()
        self.state.on_settle()  # sharded state: the last compute copies gathered from the other ranks too
        self.state.settle()  # alternating copies: masters and compute copies back where their views point
        if self.ctx.failure.error is not None:
            self.recovery.recover()
        self.recovery.prune()

    def close(self) -> None:
        """Finish queued work and stop every thread; later calls raise RuntimeError at once."""
        if self.closed:
            return
        atexit.unregister(self._at_exit)
        try:
            self.recovery.drain()
        finally:
            self.closed = True
            self._reaper()  # stops the threads (once: a finalizer runs at most once)

    def __enter__(self) -> "Runtime":  # noqa: D105
        return self

    def __exit__(self, *exc: Any) -> None:  # noqa: D105
        self.close()


def run(graph, program, state, batches, **kwargs: Any) -> list[float]:
    """Train on `batches` (one per iteration) and return the losses; `kwargs` go to `Runtime`."""
    with Runtime(graph, program, state, **kwargs) as rt:
        losses = [rt.step(b) for b in batches]
        rt.flush()
    return losses
