"""Lanes and the completion board: how instructions wait for each other (DESIGN.md ideas 5, 6).

Every (worker, lane) of a Program is a `LaneThread` that runs its instructions
one at a time in program order, iteration t before t+1: per worker a compute
lane, a high-priority activation upload and download lane and a low-priority
parameter upload and gradient download lane (the split into separate lanes is
the priority: a long parameter chunk never queues in front of an activation);
the host has an optimizer and a copy lane. An instruction starts once every
dependency has completed on the `Board` (per-layer events: no global barrier).

    >>> b = Board(timeout=1.0)
    >>> b.finish((0, "w0 F0.m0")); b.wait([(0, "w0 F0.m0")], 0)
    True
"""
from __future__ import annotations

import queue
import random
import threading
import time
import traceback
import zlib
from typing import Any, Callable

__all__ = ["Board", "LaneThread", "make_delay", "RuntimeFailure", "protocol_deps", "sleep_for"]


class RuntimeFailure(RuntimeError):
    """An instruction failed in a worker, a lane or the optimizer; the message names it and shows the grid."""

    def __init__(self, message: str, instr: str, iteration: int) -> None:
        super().__init__(message)
        self.instr, self.iteration = instr, iteration


class _Waiter:
    """One blocked `wait`: how many of its keys are still missing, and the event that wakes it."""

    __slots__ = ("missing", "event")

    def __init__(self, missing: int) -> None:
        self.missing = missing
        self.event = threading.Event()


class Board:
    """Completion events of instruction instances `(iteration, template name)`, and the first failure.

    A waiter is woken only by the completions it waits for (or a failure), not by every
    completion: with many lanes and instructions a shared condition variable would make each
    `finish` wake and re-check every blocked thread.

    Args:
        timeout: seconds an instruction may wait for its dependencies before the board
            declares a hang (a failure naming the instruction and what it waits for).
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._done: set[tuple[int, str]] = set()
        self._waiters: dict[tuple[int, str], list[_Waiter]] = {}  # missing key -> who waits for it
        self._blocked: set[_Waiter] = set()  # every waiter not yet woken (a failure wakes them all)
        self.failed_from: int | None = None  # iterations >= this are abandoned after a failure
        self.error: tuple[BaseException, str, int, str] | None = None  # (exception, instr, iteration, traceback)

    def finish(self, key: tuple[int, str]) -> None:
        """Mark one instruction instance complete and wake whoever waited only for it."""
        with self._lock:
            self._done.add(key)
            for w in self._waiters.pop(key, ()):
                w.missing -= 1
                if w.missing == 0:
                    self._blocked.discard(w)
                    w.event.set()

    def is_done(self, key: tuple[int, str]) -> bool:
        """True if the instance completed."""
        with self._lock:
            return key in self._done

    def abandoned(self, t: int) -> bool:
        """True if iteration t is abandoned (a failure in it or an earlier iteration)."""
        with self._lock:
            return self.failed_from is not None and t >= self.failed_from

    def _block(self, keys: list[tuple[int, str]], timeout: float, give_up: Callable[[], bool]) -> bool:
        """Wait until every key completed (True), or `give_up()` holds (checked under the lock), a
        failure wakes us, or `timeout` passes (False)."""
        with self._lock:
            missing = [k for k in keys if k not in self._done]
            if not missing:
                return True
            if give_up():
                return False
            w = _Waiter(len(missing))
            for k in missing:
                self._waiters.setdefault(k, []).append(w)
            self._blocked.add(w)
        w.event.wait(timeout)
        with self._lock:
            self._blocked.discard(w)
            return all(k in self._done for k in keys)

    def wait(self, keys: list[tuple[int, str]], t: int, what: str = "") -> bool:
        """Block until all `keys` completed (True) or iteration t is abandoned (False).

        Raises:
            TimeoutError: the dependencies did not complete within `timeout` (names the missing ones).
        """
        deadline = time.monotonic() + self.timeout
        while True:
            done = self._block(keys, max(0.0, deadline - time.monotonic()),
                               lambda: self.failed_from is not None and t >= self.failed_from)
            if self.abandoned(t):
                return False
            if done:
                return True
            if time.monotonic() >= deadline:  # else a failure in a later iteration woke us: wait on
                with self._lock:
                    missing = [f"{n} (iteration {i})" for i, n in keys if (i, n) not in self._done]
                raise TimeoutError(f"{what} waited {self.timeout:.0f}s for {', '.join(missing)}")

    def wait_all(self, keys: list[tuple[int, str]], t: int, timeout: float | None = None) -> bool:
        """Like `wait`, for the caller's thread; also returns False when any failure is recorded."""
        done = self._block(keys, self.timeout if timeout is None else timeout, lambda: self.error is not None)
        return done and self.error is None

    def fail(self, t: int, name: str, exc: BaseException) -> None:
        """Record a failure of instance (t, name); abandons iteration t and later (first failure wins)."""
        with self._lock:
            if self.error is None:
                self.error = (exc, name, t, "".join(traceback.format_exception(exc)))
            self.failed_from = t if self.failed_from is None else min(self.failed_from, t)
            for w in self._blocked:
                w.event.set()
            self._blocked.clear()

    def reset(self, keep_below: int) -> None:
        """Forget the failure and every completion (and waiter) of iterations >= keep_below."""
        with self._lock:
            self._done = {k for k in self._done if k[0] < keep_below}
            self._waiters = {k: v for k, v in self._waiters.items() if k[0] < keep_below}
            self.failed_from, self.error = None, None

    def forget_before(self, t: int) -> None:
        """Drop completion records of iterations < t (no Ref can reach them any more)."""
        with self._lock:
            self._done = {k for k in self._done if k[0] >= t}


class LaneThread(threading.Thread):
    """One (worker, lane): runs queued items FIFO with `execute(item)`; `None` stops it.

    Args:
        name: e.g. "w2/act_up".
        execute: called with each queued item in this thread; must not raise.
    """

    def __init__(self, name: str, execute: Callable[[Any], None]) -> None:
        super().__init__(name=f"rpcompile {name}", daemon=True)
        self.lane_name = name
        self._execute = execute
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.busy = threading.Event()  # set while an item is being executed

    def run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            self.busy.set()
            try:
                self._execute(item)
            finally:
                self.busy.clear()

    def submit(self, item: Any) -> None:
        """Queue an item (runs after every item queued before it)."""
        self.queue.put(item)

    def stop(self) -> None:
        """Ask the thread to exit after its queued items."""
        self.queue.put(None)


def make_delay(spec: Any) -> Callable[[int, str, str], float] | None:
    """The lane-delay hook: None, a callable(worker, lane, instr) -> seconds, or an int seed.

    A seed gives random delays of 0-2 ms, drawn from one generator per (worker, lane)
    so the delays do not depend on thread interleaving.

    >>> f = make_delay(3); 0.0 <= f(0, "compute", "w0 F0.m0") <= 0.002
    True
    """
    if spec is None or callable(spec):
        return spec
    if isinstance(spec, bool) or not isinstance(spec, int):
        raise TypeError(f"lane_delay must be None, a callable or an int seed, got {type(spec).__name__}")
    gens: dict[tuple[int, str], random.Random] = {}
    lock = threading.Lock()

    def delay(worker: int, lane: str, instr: str) -> float:
        with lock:
            g = gens.setdefault((worker, lane), random.Random(zlib.crc32(f"{spec}/{worker}/{lane}".encode())))
            return g.random() * 0.002

    return delay


def sleep_for(delay: Callable[[int, str, str], float] | None, worker: int, lane: str, instr: str) -> None:
    """Sleep for the injected delay of this instruction, if any."""
    if delay is not None:
        s = delay(worker, lane, instr)
        if s > 0:
            time.sleep(s)


def protocol_deps(program: Any, touches: dict[int, set[int]]) -> dict[str, tuple[Any, ...]]:
    """The program's dependencies plus those the executor adds (per template instruction name).

    Args:
        program: the Program.
        touches: layer -> optimizer groups (layers) whose parameters the layer uses (tied
            parameters belong to the group of their lowest owner, possibly another layer).
    Returns:
        {instr name: refs}. Added: R1/R2/R4 for tied parameters (a chunk of layer l also waits
        for the copy / step of every group it reads / writes; a copy waits for every upload
        reading its group); a fixed order of the gradient downloads into each group (each G
        waits for the previous G, in program order, writing a common group: host
        accumulation is bit-reproducible); and the commit point: the first optimizer step
        of an iteration waits for all its gradient downloads (steps are all-or-nothing).
    """
    from rpcompile.program import Op, Ref
    deps = {i.name: list(i.deps) for i in program.instrs}
    readers: dict[int, list[str]] = {}
    last_g: dict[int, str] = {}
    g_all: list[str] = []
    top = program.plan.num_layers - 1
    since = 2 if program.staleness == 1 else 0
    for i in program.instrs:
        if i.op in (Op.PARAM_UP, Op.GRAD_DOWN):
            layers = set(program.chunk_of(i).layers)
            groups = {g for l in layers for g in touches.get(l, ())} | layers
            for g in sorted(groups - layers):
                deps[i.name].append(Ref(f"h C.l{g}", 1, since) if i.op is Op.PARAM_UP else Ref(f"h O.l{g}", 1))
            if i.op is Op.PARAM_UP:
                for g in groups:
                    readers.setdefault(g, []).append(i.name)
                continue
            for g in sorted(groups):
                if g in last_g and Ref(last_g[g]) not in deps[i.name]:
                    deps[i.name].append(Ref(last_g[g]))
                last_g[g] = i.name
            g_all.append(i.name)
        elif i.op is Op.COPY:
            deps[i.name] += [Ref(p) for p in readers.get(i.layer, []) if Ref(p) not in deps[i.name]]
        elif i.op is Op.STEP and i.layer == top:
            deps[i.name] += [Ref(g) for g in g_all if Ref(g) not in deps[i.name]]
    return {k: tuple(v) for k, v in deps.items()}
