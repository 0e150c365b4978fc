"""The issuers: one thread per worker walks an iteration's device instructions in program order (DESIGN.md 3a).

The interpreter's loop. For each instruction the issuer waits on the host only
until its producers are *issued* (the board), makes the instruction's stream
wait on their events (a parameter upload also waits on the COPY that made
the version it reads, R2), then calls the Op's handler from the dispatch table
and publishes what it returns. A handler's exception is recorded as the
iteration's failure; the rest of that iteration is not issued.
"""
from __future__ import annotations

from typing import Any

from rpcompile.ir.program import Op
from rpcompile.runtime.streams.cuda import thread_device
from rpcompile.runtime.program_info import ProgramInfo, dep_kind
from rpcompile.runtime.streams.host import Abort
from rpcompile.runtime.transfer import LaneThread

__all__ = ["Issuer"]


class Issuer:
    """Issues each iteration's device instructions on the workers' streams.

    Owns:
        threads: one issuing LaneThread per physical worker (it sets its worker's device first: a
            CUDA call from a thread without one would create a context on GPU 0).
        handlers: the dispatch table, Op -> handler(t, ins, w) returning the instance's events (tests
            may replace an entry to inject a fault).

    Handed: ctx (StreamContext: the failure record), workers (their streams), drop (test switch),
    board (IssueBoard: it publishes each issued instance there), its (Iterations: lookups), host
    (HostLanes: the COPY events R2 waits for), table (the handlers' `IssueHandlers.table()`).
    """

    def __init__(self, *, ctx: Any, workers: list, drop: frozenset, board: Any, its: Any, host: Any,
                 table: dict) -> None:
        self.ctx, self.workers, self.drop, self.board, self.its, self.host = ctx, workers, drop, board, its, host
        self.handlers = table
        self.threads = [LaneThread(f"w{w}/issue", thread_device(workers[w].device)) for w in range(len(workers))]

    def submit(self, t: int, info: ProgramInfo) -> None:
        """Queue iteration t's device instructions on the issuer of each template worker's physical worker."""
        for tw in range(info.program.gpus):
            self.threads[self.its.physical(t, tw)].submit(lambda t=t, tw=tw: self._issue_iteration(t, tw))

    def _issue_iteration(self, t: int, tw: int) -> None:
        """Issuer body: every device instruction of template worker `tw` in iteration t, in program order."""
        info = self.its.info_of(t)
        for ins in info.by_worker.get(tw, ()):
            if self.ctx.failure.abandoned(t):
                return
            try:
                self._issue(t, ins, info)
            except Abort:
                return
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                self.ctx.failure.fail(t, self.its.label(t, ins, self.its.worker_of(t, ins)), exc)
                return

    def _issue(self, t: int, ins, info: ProgramInfo) -> None:
        """Wait for the producers to be issued, make the stream wait on their events, run the handler."""
        w = self.its.worker_of(t, ins)
        stream = self.workers[w].streams[ins.lane.value]
        label = self.its.label(t, ins, w)
        for key in self.its.keys(t, ins, info):
            prod = info.by_name[key[1]]
            if prod.is_host:  # R2 (a P reads the new copy) waits here; R4 (a G) waits in the accumulate lane
                if ins.op is Op.PARAM_UP and "copy>param_up" not in self.drop:
                    stream.wait(self.host.event(key), t, label)  # a failed wait names the instruction
                continue
            events = self.board.get(key, t, label)
            if prod.op is Op.RELEASE or ins.op is Op.GRAD_DOWN and prod.op is Op.GRAD_DOWN:
                continue  # buffer reuse is the pool's; G-after-G orders the accumulation lane only
            if dep_kind(prod.op, ins.op) in self.drop:
                continue
            for ev in events:
                stream.wait(ev, t, label)
        self.board.publish((t, ins.name), self.handlers[ins.op](t, ins, w))
