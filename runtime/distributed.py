"""Data parallelism across processes (nodes) on torch.distributed: per-layer gradient all-reduce on the host.

Each process runs the whole RoundPipe schedule on its own workers over its
shard of the global batch. Gradients land in the host's fp32 buffers, so each
layer group's gradient is averaged over the processes (gloo, host tensors, in
place on the group's flat buffer) as soon as its last gradient download is in: a `GradReducer` thread (the host's
"network lane") all-reduces the groups in a fixed order (descending layers,
iteration by iteration, the order the backward completes them) while the
workers still run the backward of lower layers. `HostState` calls two hooks:
`on_grad(l)` after each gradient write (to count them) and `on_complete(l)`
when group l's gradient is declared complete, before the unscale / clipping
statistics and the optimizer step: it waits for that group's reduction.

    >>> c = rpcompile.compile(model, gpus=8, example=local_batch, dist=True)   # doctest: +SKIP
    >>> loss = c.step(shard(global_batch, c.rank, c.world_size))              # doctest: +SKIP

Launch with `torchrun --nproc-per-node 1 --nnodes K ... train.py` (or any
launcher that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): with dist=True
and no process group initialised, `init_group` initialises gloo from the env
with `DistConfig.timeout_s`.

Note: ordering. Collectives on one group must be issued in the same order by
every process. The gradient group is used only by the reducer thread (fixed
order); the main group (initial weight broadcast, loss average) only by the
caller's thread. Every process must run the same model and the same number of
steps (plans may differ: the reduce order depends only on the layer groups).
`GradReducer` calls `dist.new_group`, which every process of the default group
must call, also with a `process_group` that covers only some of them.

Note: failures. A collective that fails (a peer died: gloo sees the closed
connection at once; a peer hung: the group's timeout) makes the waiting STEP
raise "distributed all-reduce of layer group l ... failed", which the executor
re-raises from `step`/`flush` as a RuntimeFailure. Unlike a single-process
failure this is not recoverable in place (the processes disagree on where they
are): the reducer stays broken and every later step raises; restart all
processes from the last checkpoint.
"""
from __future__ import annotations

import datetime
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rpcompile.ir.program import Op

__all__ = ["DistConfig", "GradReducer", "init_group", "ring_allreduce_time", "shard", "data_parallel"]


@dataclass(frozen=True, slots=True)
class DistConfig:
    """Options of data-parallel training (compile(..., dist=DistConfig(...)); dist=True uses the defaults)."""

    timeout_s: float = 300.0   # seconds a collective waits for the other processes before it raises
    average_loss: bool = True  # step()/evaluate() return the mean loss over all processes (one scalar all-reduce);
                               # False: this rank's own (loss_mean="tokens": over its own trained tokens)


def ring_allreduce_time(nbytes: float, nodes: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring all-reduce of `nbytes` over `nodes` processes: 2(k-1)/k * bytes / bw + 2(k-1) * latency.

    >>> ring_allreduce_time(1e9, 2, 12.5e9, 5e-6)
    0.08001
    >>> ring_allreduce_time(1e9, 1, 12.5e9, 5e-6)
    0.0
    """
    if nodes <= 1:
        return 0.0
    return 2 * (nodes - 1) / nodes * nbytes / bandwidth + 2 * (nodes - 1) * latency


def shard(batch: Any, rank: int, world: int) -> Any:
    """This process's contiguous share of a global batch (tensor, tuple/list or dict; batch along dim 0)."""
    def part(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if v.shape[0] % world:
            raise ValueError(f"shard: batch size {v.shape[0]} is not divisible by {world} processes")
        n = v.shape[0] // world
        return v[rank * n:(rank + 1) * n]
    if isinstance(batch, dict):
        return {k: part(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(part(v) for v in batch)
    return part(batch)


def init_group(cfg: DistConfig, process_group: Any = None) -> Any:
    """The main process group: `process_group`, the initialised default one, or gloo initialised from the env."""
    if process_group is not None:
        return process_group
    if not dist.is_available():
        raise RuntimeError("dist=True needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"dist=True: no process group is initialised and {missing} are not set; launch "
                             f"with torchrun, set them, or pass process_group=")
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=datetime.timedelta(seconds=cfg.timeout_s))
    return dist.group.WORLD


class GradReducer:
    """Averages every layer group's host gradient over the processes of `group`, in a background thread.

    Args:
        state: the `HostState`; the reducer installs itself as its `on_grad` / `on_complete` hooks.
        group: the main process group (weights broadcast, loss average). Gradients use a new gloo
            group over the same ranks (host tensors; also when `group` is NCCL).
        cfg: a DistConfig.
    """

    def __init__(self, state: Any, group: Any, cfg: DistConfig) -> None:
        self.state, self.group, self.cfg = state, group, cfg
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        timeout = datetime.timedelta(seconds=cfg.timeout_s)
        self.grad_group = dist.new_group(dist.get_process_group_ranks(group), timeout=timeout, backend="gloo")
        n = len(state.groups)
        self.expected = [0] * n   # gradient writes that complete group l in one iteration (from the program)
        self.writes = [0] * n     # writes to group l in the current iteration
        self.reduced = [0] * n    # reductions of group l done
        self.taken = [0] * n      # reductions of group l the optimizer has waited for
        self.iteration = 0        # iterations fully reduced (for messages)
        self.error: BaseException | None = None
        self.broken: str | None = None  # why this reducer can no longer be used
        self.told = False  # whether the caller has had an exception since `broken` was set (else `check` raises it)
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        state.on_grad, state.on_complete = self.wrote, self.wait

    # -- setup ------------------------------------------------------------------------------------
    def broadcast_state(self) -> None:
        """Give every process rank 0's compute copies and fp32 masters (at compile, before any step)."""
        dev = self._device(self.group)
        src = dist.get_global_rank(self.group, 0) if self.group is not dist.group.WORLD else 0
        for table, master in ((self.state.compute, False), (self.state.master, True)):
            for name in sorted(table):
                t = table[name]
                buf = t.detach().to(dev, copy=True)
                self._collective(f"broadcast of {name!r}", dist.broadcast, buf, src=src, group=self.group)
                with torch.no_grad():
                    if master:  # as the master dtype stores it (a split master's value is not a view)
                        self.state.flat.set_master(name, buf.to(t.device))
                    else:
                        t.copy_(buf.to(t.device))
        self.state.masters_changed()  # the alternating copies' own buffers: cast from the masters received

    def attach(self, runtime: Any) -> None:
        """Count, from `runtime`'s program, the gradient writes that complete each group; start the thread.

        Call between iterations (after `flush`): e.g. after a re-plan made a new runtime.
        """
        state, per_stage, rounds = self.state, {}, {}
        for (stage, _), elems in runtime.chunk_elems.items():
            per_stage.setdefault(stage, set()).update(n for n, _, _ in elems if n in state.master)
        for i in runtime.program.instrs:
            if i.op is Op.GRAD_DOWN:
                rounds.setdefault(i.stage, set()).add(i.round)
        expected = [0] * len(state.groups)
        for stage, names in per_stage.items():
            for n in names:
                expected[state.group_of[state.canonical(n)]] += len(rounds.get(stage, ()))
        with self._cond:
            if any(self.writes) or self.reduced != self.taken:
                raise RuntimeError("GradReducer.attach: gradients of an iteration are still in flight")
            self.expected = expected
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dist/allreduce", daemon=True)
            self._thread.start()

    # -- the HostState hooks ----------------------------------------------------------------------
    def wrote(self, layer: int) -> None:
        """on_grad: one gradient write into group `layer` (its last one makes the group ready)."""
        with self._cond:
            self.writes[layer] += 1
            if self.writes[layer] >= self.expected[layer]:
                self._cond.notify_all()

    def wait(self, layer: int) -> None:
        """on_complete: block until this iteration's gradient of group `layer` is averaged over the processes."""
        if not self.expected[layer]:
            return
        with self._cond:
            ok = self._cond.wait_for(lambda: self.reduced[layer] > self.taken[layer] or self.error is not None
                                     or self.broken is not None, timeout=2 * self.cfg.timeout_s)
            if self.reduced[layer] > self.taken[layer]:
                self.taken[layer] += 1
                return
            err, why = self.error, self.broken if ok else f"no result after {2 * self.cfg.timeout_s:.0f} s"
        if err is not None:
            raise RuntimeError(str(err)) from err
        raise RuntimeError(f"distributed all-reduce of layer group {layer} (rank {self.rank} of {self.world}) "
                           f"{'cannot run' if ok else 'timed out'}: {why}")

    # -- the network lane ------------------------------------------------------------------------
    def _run(self) -> None:
        """Reduce the groups in a fixed order: descending layers, iteration after iteration."""
        while True:
            with self._cond:
                order = [l for l in reversed(range(len(self.expected))) if self.expected[l]]
            if not order:
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or any(self.expected))
                    if self._stop:
                        return
                continue
            for l in order:
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or self.writes[l] >= self.expected[l])
                    if self._stop:
                        return
                try:
                    self._reduce(l)
                except BaseException as exc:  # noqa: BLE001 - reported by wait() in the optimizer lane
                    self._failed(f"{self.COLLECTIVE} of layer group {l}", exc)
                    return
                with self._cond:
                    self.writes[l] = 0
                    self.reduced[l] += 1
                    self._cond.notify_all()
            try:
                self._end_iteration()
            except BaseException as exc:  # noqa: BLE001 - reported by the waits of the optimizer lane
                self._failed("exchange of the gradient statistics", exc)
                return
            self.iteration += 1

    COLLECTIVE = "all-reduce"  # what `_reduce` runs, for the failure message

    def _failed(self, what: str, exc: BaseException) -> None:
        """Record a failed collective of the network lane: every later wait raises it (one line)."""
        cause = f"{type(exc).__name__}: {exc}"
        if str(exc).startswith(f"distributed {what} ") and " failed: " in str(exc):  # shard_comm named it already
            cause = str(exc).split(" failed: ", 1)[1]
        with self._cond:
            self.error = RuntimeError(f"distributed {what} in iteration {self.iteration} (rank {self.rank} of "
                                      f"{self.world}) failed: {cause}")
            self.broken = str(self.error)
            self._cond.notify_all()

    def _end_iteration(self) -> None:
        """After the network lane's last group of an iteration (the sharded reducer exchanges its statistics)."""

    def _reduce(self, layer: int) -> None:
        """All-reduce (sum) group `layer`'s flat fp32 gradient buffer in place (bf16 gradients: a float32 copy,
        the average stored back with stochastic rounding), then divide by the world (one pass, which also takes
        the gradient statistics of the average: `HostState.average_grads`)."""
        self.state.average_grads(layer, self.world, lambda flat: dist.all_reduce(flat, group=self.grad_group))

    # -- caller-thread collectives ------------------------------------------------------------------
    def average(self, value: float, what: str = "loss") -> float:
        """The mean of `value` over the processes (the caller's thread, main group)."""
        if not self.cfg.average_loss:
            return value
        buf = torch.tensor([value], dtype=torch.float64, device=self._device(self.group))
        self._collective(f"{what} average", dist.all_reduce, buf, group=self.group)
        return float(buf.item()) / self.world

    def total(self, value: int, what: str = "token count") -> int:
        """The sum of the int `value` over the processes (the caller's thread, main group; always reduced).

        Token weighting uses it for the step's trained-token count, before the step's backward runs.
        """
        buf = torch.tensor([int(value)], dtype=torch.int64, device=self._device(self.group))
        self._collective(f"{what} sum", dist.all_reduce, buf, group=self.group)
        return int(buf.item())

    def check(self) -> None:
        """Raise if a failure broke this data-parallel run (the processes no longer agree on the step).

        A failure the caller has not been told of yet (a background lane's collective failed after the
        last call returned) is raised as it is, its own message first; later calls say the run cannot go on.
        """
        with self._cond:
            if self.broken is None:
                return
            told, self.told = self.told, True
        if not told:
            raise RuntimeError(f"{self.broken}\n(rank {self.rank}: the data-parallel run cannot continue; restart "
                               f"every process from the last checkpoint)")
        raise RuntimeError(f"distributed training cannot continue after a failure on rank {self.rank}; "
                           f"restart every process from the last checkpoint (cause: {self.broken})")

    def fail(self, exc: BaseException) -> None:
        """Mark the run broken after a failure in `step`, which the caller gets (another process may be
        waiting in a collective)."""
        with self._cond:
            self.broken = self.broken or f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            self.told = True
            self._cond.notify_all()

    def _collective(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Run one collective; a failure raises an error naming it."""
        try:
            fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised with the collective's name
            self.fail(exc)
            raise RuntimeError(f"distributed all-reduce/broadcast ({what}, rank {self.rank} of {self.world}) "
                               f"failed: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _device(group: Any) -> torch.device:
        """Where the main group's collectives need their tensors (NCCL: the current CUDA device)."""
        if dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def close(self) -> None:
        """Stop the reducer thread (it is a daemon: one stuck in a collective dies with the process)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=1.0)


def data_parallel(state: Any, dist_opt: Any, process_group: Any = None) -> GradReducer | None:
    """A GradReducer over `process_group` that has broadcast rank 0's weights; None when data parallelism is off.

    Args:
        state: the HostState to average gradients of.
        dist_opt: compile's `dist`: False, True (DistConfig()) or a DistConfig.
        process_group: the group to train over (implies data parallelism; default: the main group).
    """
    if not dist_opt and process_group is None:
        return None
    cfg = dist_opt if isinstance(dist_opt, DistConfig) else DistConfig()
    reducer = GradReducer(state, init_group(cfg, process_group), cfg)
    reducer.broadcast_state()
    return reducer
