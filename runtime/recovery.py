"""Failure recovery and quiescence for the Runtime: drain every thread, prune old records, undo a failure.

See the module Note of `runtime/executor.py` for the semantics: after a failure
in iteration u the state is that after iteration u-1, the next call raises a
`RuntimeFailure` naming the instruction, and the next `step` runs iteration u.
"""
from __future__ import annotations

import threading
from typing import Any

from rpcompile.runtime.program_info import EVAL_BASE
from rpcompile.runtime.streams.host import Abort, DeadlineExceeded
from rpcompile.runtime.transfer import NonFiniteError, RuntimeFailure

__all__ = ["Recovery"]


class Recovery:
    """Waits for quiescence, forgets unreachable records and undoes a failed iteration.

    Owns no record of its own. It changes the failure record (`ctx.failure`: failing a caller-side
    wait, resetting it after the undo), the workers' and pools' accounting, and the other parts'
    state only through their own calls: `its.forget` / `its.rewind`, `board.forget`,
    `host.forget` / `host.undo_from`, `handlers.forget_from`, `routes.forget_from`, `state.discard_grads`.

    Handed: ctx (StreamContext), threads (groups of LaneThreads in drain order: the issuers, then the
    host lanes), workers, host_pool, board (IssueBoard), its (Iterations), host
    (HostLanes), handlers (IssueHandlers), routes (RoutingLog: MoE routing kept for the recomputes), state
    (HostState), program (the template, for the grid), max_back (how far back, in iterations, the training program's refs reach).
    """

    def __init__(self, *, ctx: Any, threads: tuple[list, ...], workers: list, host_pool: Any, board: Any, its: Any,
                 host: Any, handlers: Any, routes: Any, state: Any, program: Any, max_back: int) -> None:
        self.ctx, self.threads, self.workers, self.host_pool, self.board = ctx, threads, workers, host_pool, board
        self.its, self.host, self.handlers, self.routes, self.state = its, host, handlers, routes, state
        self.program, self.max_back = program, max_back

    def guard(self, fn, t: int) -> Any:
        """Run a caller-side wait; a failure (or the wait's own timeout) is recovered and re-raised."""
        try:
            return fn()
        except Abort:
            pass
        except BaseException as exc:  # noqa: BLE001
            self.host.fail_caller(t, exc)
        self.drain()
        self.recover()

    def drain(self) -> None:
        """Block until the issuers, the host lanes and then every stream have run what they were given.

        Each waits up to `ctx.drain_bound`, not the deadline of a single wait: after a failure the items
        still running finish (every wait inside them is bounded by the deadline, or released by the
        failure), and with a short deadline on a busy machine that takes longer than the deadline that fired.

        Raises:
            RuntimeFailure: a thread or stream did not finish within the bound (a hang: an item that never
                returns), from a DeadlineExceeded naming it; `instr` is its name ("w1/compute", "h/optimizer").
        """
        bound = self.ctx.drain_bound
        for group in self.threads:
            marks = []
            for th in group:
                ev = threading.Event()
                th.submit(ev.set)
                marks.append((th, ev))
            for th, ev in marks:
                if not ev.wait(bound):
                    self._hang(th.lane_name, DeadlineExceeded(bound, f"{th.lane_name} to drain"))
        for w in self.workers:
            for s in w.streams.values():
                try:
                    s.synchronize(bound)
                except TimeoutError as exc:
                    self._hang(s.name, exc)

    def _hang(self, name: str, exc: BaseException) -> None:
        """Raise the RuntimeFailure of a thread or stream `name` that did not drain."""
        raise RuntimeFailure(f"rpcompile runtime: {name} did not drain ({exc}): a hang, the state may be "
                             f"inconsistent", name, self.its.t) from exc

    def prune(self) -> None:
        """Forget records no instruction can reach any more (refs reach back at most one iteration)."""
        back = self.max_back + 2  # a ref reaches max_back iterations back from an unfinished one
        now = self.its.t
        keep = lambda it: it >= now - back  # noqa: E731
        self.board.forget(keep)
        self.host.forget(keep)
        self.its.forget(keep)
        self.ctx.stats.forget({t for t in range(now - back, now + 1)})

    def recover(self) -> None:
        """Drain, undo the abandoned iterations and raise the failure as RuntimeFailure.

        An interrupt (a BaseException that is not an Exception: Ctrl-C's KeyboardInterrupt,
        SystemExit) is re-raised unchanged once the iteration is undone, so `except
        KeyboardInterrupt` and retry loops around `step` see it as such.
        """
        self.drain()
        exc, name, _, tb = self.ctx.failure.error
        u = self.ctx.failure.failed_from
        u = min(u, self.its.t)
        self.host.undo_from(u)  # compute copies restored, events and non-finite records dropped
        self.state.settle()  # alternating copies: masters and compute copies back where their views point
        self.state.discard_grads()  # the abandoned iteration's partial gradients
        self.handlers.forget_from(u)
        self.routes.forget_from(u)  # the abandoned forwards' routing: no recompute will take it
        for w in self.workers:
            w.store.bytes = 0
            w.pool.forget_keys()
        self.host_pool.forget_keys()
        self.board.forget(lambda it: it < u)
        self.ctx.failure.reset()
        self.its.rewind(u)
        grid = self.program.shifted(u if u < EVAL_BASE else 0).grid(
            mark=name if name[:1] in ("w", "h") else None, context=4)
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: undone, and still what it was
            raise exc
        if isinstance(exc, NonFiniteError):  # not a fault of the machine: say what to do, no traceback
            raise NonFiniteError(str(exc), exc.iteration, exc.group) from None
        what = "evaluation" if u >= EVAL_BASE else f"iteration {u}"
        raise RuntimeFailure(f"instruction {name} of {what} failed: {type(exc).__name__}: {exc}\n"
                             f"{grid}\n--- worker traceback ---\n{tb}", name, u) from exc
