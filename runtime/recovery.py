"""Failure recovery and quiescence for the Runtime: drain every thread, undo an abandoned iteration.

See the module Note of `runtime/executor.py` for the semantics: after a failure
in iteration u the state is that after iteration u-1, the next call raises a
`RuntimeFailure` naming the instruction, and the next `step` runs iteration u.
"""
from __future__ import annotations

import threading
from typing import Any

from rpcompile.runtime.program_info import EVAL_BASE
from rpcompile.runtime.streams import Abort
from rpcompile.runtime.transfer import NonFiniteError, RuntimeFailure

__all__ = ["Recovery"]


class Recovery:
    """Waiting, pruning and failure recovery of `Runtime` (a mixin; see runtime/executor.py for the state)."""

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this runtime is closed (close() or leaving `with`); compile again to train")

    def _guard(self, fn, t: int) -> Any:
        """Run a caller-side wait; a failure (or the wait's own timeout) is recovered and re-raised."""
        try:
            return fn()
        except Abort:
            pass
        except BaseException as exc:  # noqa: BLE001
            self.ctx.failure.fail(t, "step", exc)
        self._drain()
        self._recover()

    def _drain(self) -> None:
        """Block until the issuers, the host lanes and then every stream have run what they were given."""
        for group in (self.issuers, list(self.lanes.values())):
            marks = []
            for th in group:
                ev = threading.Event()
                th.submit(ev.set)
                marks.append(ev)
            for ev in marks:
                if not ev.wait(self.ctx.timeout * 2):
                    raise RuntimeError("rpcompile runtime: a lane did not drain (a hang); state may be inconsistent")
        for w in self.workers:
            w.synchronize()

    def _prune(self) -> None:
        """Forget records no instruction can reach any more (refs reach back at most one iteration)."""
        back = self.train_info.max_back + 2  # a ref reaches max_back iterations back from an unfinished one
        keep = lambda it: it >= self.t - back  # noqa: E731
        self.board.forget(keep)
        with self._lock:
            for d in (self.hev,):
                for k in [k for k in d if not keep(k[0])]:
                    del d[k]
            for t in [t for t in self._info if not keep(t) and t < EVAL_BASE]:
                del self._info[t]
                self.scales.pop(t, None)
        self.ctx.stats.forget({t for t in range(self.t - back, self.t + 1)})

    def _recover(self) -> None:
        """Drain, undo the abandoned iterations and raise the failure as RuntimeFailure."""
        self._drain()
        exc, name, _, tb = self.ctx.failure.error
        u = self.ctx.failure.failed_from
        u = min(u, self.t)
        for t in sorted((t for t in self._backups if t >= u), reverse=True):
            for key, v in self._backups.pop(t).items():
                self.state.blocks[key].copy_(v)
        self.state.discard_grads()  # the abandoned iteration's partial gradients
        with self._lock:
            for d in (self.slots, self.inputs, self.outs, self.rc, self.hostvals, self.hev):
                for k in [k for k in d if k[0] >= u]:
                    del d[k]
            for d in (self.losses, self._info, self._bad):
                for t in [t for t in d if t >= u]:
                    del d[t]
        for w in self.workers:
            w.store.bytes = 0
            w.pool.forget_keys()
        self.host_pool.forget_keys()
        self.board.forget(lambda it: it < u)
        self.ctx.failure.reset()
        if u < EVAL_BASE:
            self.t = u
        grid = self.program.shifted(u if u < EVAL_BASE else 0).grid(
            mark=name if name[:1] in ("w", "h") else None, context=4)
        if isinstance(exc, NonFiniteError):  # not a fault of the machine: say what to do, no traceback
            raise NonFiniteError(str(exc), exc.iteration, exc.group) from None
        what = "evaluation" if u >= EVAL_BASE else f"iteration {u}"
        raise RuntimeFailure(f"instruction {name} of {what} failed: {type(exc).__name__}: {exc}\n"
                             f"{grid}\n--- worker traceback ---\n{tb}", name, u) from exc
