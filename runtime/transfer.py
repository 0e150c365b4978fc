"""The runtime's threads and their stop, failures, test delays and the protocol's extra dependencies
(DESIGN.md ideas 5, 6).

- `LaneThread`: a FIFO of work items on one thread. Each worker's issuer and
  each host lane (gradient accumulation, optimizer, copy) is one.
- `RuntimeFailure`: what the caller sees when an instruction failed.
- `make_delay`: the test hook's random per-(worker, lane) delays, slept inside
  the host streams before each item.
- `protocol_deps`: the program's dependencies plus the per-layer rules the
  executor adds (tied parameters, a fixed gradient accumulation order, the
  commit point of an iteration).
- `plan_deadline`: how long a wait may last before it counts as a hang, from
  the plan's costs (never shorter than `DEADLINE_FLOOR_S`).

    >>> f = make_delay(3); 0.0 <= f(0, "compute", "w0 F0.m0") <= 0.002
    True
"""
from __future__ import annotations

import queue
import random
import threading
import zlib
from typing import Any, Callable

import torch

from rpcompile.ir.program import Op, Ref
from rpcompile.runtime.streams.host import DEADLINE_FLOOR_S

__all__ = ["LaneThread", "stop_threads", "check_pinned", "make_delay", "RuntimeFailure", "NonFiniteError",
           "protocol_deps", "plan_deadline", "DEADLINE_FACTOR"]

DEADLINE_FACTOR = 20.0  # a default deadline is at least this multiple of the iteration's predicted serial work
OPTIMIZER_BYTES_PER_S = 1e8  # the CPU optimizer priced (pessimistically) at 100 MB of gradient per second


class RuntimeFailure(RuntimeError):
    """An instruction failed in a worker, a lane or the optimizer; the message names it and shows the grid."""

    def __init__(self, message: str, instr: str, iteration: int) -> None:
        super().__init__(message)
        self.instr, self.iteration = instr, iteration


class NonFiniteError(FloatingPointError):
    """A NaN or inf loss or gradient, caught before the optimizer applied it (the state is the last good step)."""

    def __init__(self, message: str, iteration: int, group: int | None) -> None:
        super().__init__(message)
        self.iteration, self.group = iteration, group


def plan_deadline(costs: Any, microbatches: int, *, floor: float | None = None,
                  factor: float = DEADLINE_FACTOR) -> float:
    """The default deadline of every runtime wait: max(floor, factor * one iteration's work done serially).

    The serial work of an iteration bounds what any one wait of a healthy run waits for (an
    instruction, the issue of its producers, a buffer's release, the optimizer of a layer): every
    microbatch's forward, recompute and backward of every layer on one worker, plus the CPU
    optimizer at `OPTIMIZER_BYTES_PER_S`. The costs are the plan's (measured at compile, or
    predicted for a hardware target), so a big layer on a slow machine gets a longer deadline;
    the floor (`DEADLINE_FLOOR_S`, 10 minutes) covers what no plan predicts, such as a first CUDA
    call that compiles kernels, or a machine that got busier since it was measured.

    Args:
        costs: the plan's CostTable (seconds per layer per microbatch).
        microbatches: per iteration.
        floor: the shortest deadline (None: `DEADLINE_FLOOR_S`).
        factor: the multiple of the serial work.
    Returns:
        Seconds.

    >>> from rpcompile.ir.costs import CostTable
    >>> plan_deadline(CostTable.from_lists(fwd=[1.0, 2.0], bwd=[2.0, 4.0]), 8)   # 20 * 8 * (2*3 + 6)
    1920.0
    >>> plan_deadline(CostTable.from_lists(fwd=[1e-3], bwd=[2e-3]), 8)
    600.0
    """
    work = microbatches * sum(2 * f + b for f, b in zip(costs.fwd, costs.bwd))
    work += sum(costs.grad_bytes) / OPTIMIZER_BYTES_PER_S
    return max(DEADLINE_FLOOR_S if floor is None else floor, factor * work)


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


def stop_threads(ctx: Any, threads: list, workers: list, pin: Any) -> None:
    """Stop a runtime's threads and workers: its `close` once the work is drained, or its finalizer when it was
    dropped unclosed (then nothing waits for its work: its results are unreachable)."""
    ctx.failure.fail(1 << 62, "close", RuntimeError("runtime closed"))  # release any waiter
    for th in threads:
        th.stop()
    for th in threads:
        if th is not threading.current_thread():  # a finalizer may run on one of them (a collection there)
            th.join(timeout=ctx.timeout)
    for w in workers:
        w.close()
    if pin:  # the streams are done with them: unregistered (the memory stays valid, pageable)
        pin.close()


def check_pinned(state: Any, kind: str) -> None:
    """Refuse CUDA workers a HostState whose compute-copy blocks are pageable (their uploads would synchronise).

    `cudaMemcpyAsync` from pageable memory stages through a driver buffer and may block the host, so
    every parameter upload would stall its issuer. `compile` pins; a HostState built by hand needs
    `pin_memory=True`. Unsharded bf16 masters too: at staleness 1 uploads read them every other iteration
    (runtime/host/layout.py `Alternation`).
    """
    if kind != "cuda":
        return
    pageable = [k for k, b in state.blocks.items() if not b.is_pinned()]
    pageable += [(g, "bf16 masters (uploaded in turn with the copies at staleness 1)") for g, m in
                 enumerate(state.flat.masters) if m.dtype == torch.bfloat16 and state.shard is None and m.numel()
                 and not m.is_pinned()]
    if pageable:
        raise ValueError(f"HostState: {len(pageable)} compute-copy block(s) are not pinned (first: layer group "
                         f"{pageable[0][0]}, {pageable[0][1]}); CUDA workers upload from pinned memory only: build "
                         f"it with HostState.from_graph(..., pin_memory=True)")


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
