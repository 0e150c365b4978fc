"""What a `Compiled` handle runs: `step`, `evaluate`, and what they report (a mixin; see rpcompile/api.py).

`Training` holds the iteration side of the handle: a training step and a forward-only evaluation, the
per-microbatch loss weights of loss_mean="tokens" and the data-parallel mean of the returned loss,
`flush`, `set_lr`, and what the last step cost (`stats`, `last_timeline`). `Compiled` (api.py) builds
the programs, the runtime and the host state these methods use, and keeps, saves and closes them.
`_one_caller` is the lock every public method of the handle takes.

    >>> loss = c.step(batch); c.flush(); c.stats()["device_allocations"]   # doctest: +SKIP
    0
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from rpcompile.runtime.sim.timeline import Record
from rpcompile.runtime.stage.batch import token_weights, trained_tokens

__all__ = ["Training"]


def _one_caller(method: Callable) -> Callable:
    """Run a `Compiled` method under the handle's lock: calls from several threads run one at a time."""
    @functools.wraps(method)
    def locked(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class Training:
    """`step`, `evaluate`, `stats`, `flush`, `set_lr` and `last_timeline` of `Compiled` (a mixin; see rpcompile/api.py).

    They use what `Compiled` builds: `_lock`, `_runtime`, `_dist`, `state`, `options`, `graph`,
    `microbatches`, `world_size`, `steps`, and its `_prepare` (check a batch, plan it if nothing is planned
    yet, switch programs) and `_check_open`; `_pending` is not None until the first plan (no `example=`).
    """

    def _weights(self, batch: Any, what: str) -> tuple[list[float] | None, tuple[int, int] | None]:
        """loss_mean="tokens": per-microbatch loss weights world * n_m / N and (this rank's tokens, N); else None.

        N is summed over the processes (one int all-reduce) here, before the step's backward runs.
        """
        if self.options.loss_mean != "tokens":
            return None, None
        counts = trained_tokens(self.graph, batch, self.microbatches)
        local = sum(counts)
        total = self._dist.total(local, f"{what} token count") if self._dist else local
        return token_weights(counts, total, self.world_size), (local, total)

    def _result(self, loss: float, counts: tuple[int, int] | None, what: str) -> float:
        """The loss `step` / `evaluate` return: data parallel, the mean over the processes (see DistConfig)."""
        if not self._dist:
            return loss
        if counts is not None and not self._dist.cfg.average_loss:  # this rank's own token mean
            local, total = counts
            return loss * total / (self.world_size * local) if local else 0.0
        return self._dist.average(loss, what)

    @_one_caller
    def step(self, batch: Any) -> float:
        """One training iteration (forward, backward, optimizer); returns the step's loss.

        The loss is the mean microbatch loss, or with loss_mean="tokens" the mean over the step's
        trained tokens (data parallel: over every process's, in both cases).

        The batch's tensors are copied (into pinned host buffers where CUDA is) before `step` returns,
        so the caller may reuse or change them at once, although the iteration's lower backward
        stages and its optimizer steps still run.

        Raises:
            ValueError: the batch does not fit the compiled model (names the value).
            RuntimeFailure: an instruction failed; the state is that before the failed iteration.
            FloatingPointError: a non-finite loss or gradient (on_nonfinite="raise"); nothing applied.
                A non-finite loss raises from the `step` that computed it, a non-finite gradient
                under a finite loss from the next call (with staleness 1 it is found after `step`
                returned).
            RuntimeError: the handle is closed.
        """
        self._prepare(batch)
        if self._dist:
            self._dist.check()  # a failed data-parallel step cannot be re-run in place
        weights, counts = self._weights(batch, "step")  # loss_mean="tokens": n_m / N, N over all processes
        try:
            loss = self._runtime.step(batch, weights)
        except BaseException as exc:
            if self._dist:
                self._dist.fail(exc)
            raise
        return self._result(loss, counts, "loss")  # data parallel: mean over processes

    @_one_caller
    def stats(self, step: int | None = None) -> dict[str, Any]:
        """What the last step cost: host waits, allocations, bytes each way and busy seconds per lane.

        Waits for the step's remaining work first (`flush`), so the numbers are complete. With
        `step` (0-based, one of the last few), the counters of that step as recorded so far, without
        waiting: complete up to what still runs in the background (its staleness-1 update).

        Returns:
            {"host_waits": times the host blocked on device work, "issue_waits": times an issuing
            thread blocked on host work, "host_allocations" / "device_allocations": new buffers
            (not pool hits), "bytes_to_device", "bytes_to_host", "busy_s": {lane: seconds}}.

        Example:
            >>> c.step(batch); c.stats()["device_allocations"]   # doctest: +SKIP
            0
        """
        self._check_open()
        if step is not None:
            return self._runtime.stats(step)
        self._runtime.flush()
        return self._runtime.stats()

    @_one_caller
    def flush(self) -> None:
        """Wait for the work of every step so far (the staleness-1 update in the background too).

        Raises:
            RuntimeFailure: background work (e.g. an optimizer step) failed; as for `step`.

        Example:
            >>> c.step(batch); c.flush(); c.state.norms[c.steps - 1] is not None   # doctest: +SKIP
            True
        """
        self._check_open()
        if self._pending is None:  # before the first plan no step has run
            self._runtime.flush()

    @_one_caller
    def set_lr(self, lr: float) -> None:
        """Set the CPU optimizer's learning rate, from the update made with the next `step`'s gradient on.

        The change is queued on the runtime's optimizer lane behind the updates of
        the iterations already run, so it never races with them: the update of
        iteration `c.steps` (the next `step(batch)`) and every later one use `lr`;
        an earlier one still running in the background keeps its own lr. No wait.
        Before the first plan (`compile` without `example`), it is queued as that plan starts the runtime.

        Note:
            Which weights an lr reaches. With staleness 0, the update from step t's
            gradient gives the weights step t+1 reads. With staleness 1 (RoundPipe),
            it runs on the CPU while step t+1 computes with the weights of step t-1's
            update, so an lr set before step t first shows in what step t+2 reads.

        Example:
            >>> c.set_lr(1e-5); loss = c.step(batch)   # this batch's update uses lr 1e-5   # doctest: +SKIP
        """
        self._check_open()
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 <= lr < float("inf"):
            raise ValueError(f"set_lr: lr must be a finite number >= 0, got {lr!r}")
        if self._pending is not None:  # not planned yet: queued when the first plan starts the runtime
            self._pending.lr = float(lr)
            return
        self._runtime.lanes["optimizer"].submit(lambda: self.state.set_lr(float(lr)))

    @property
    def last_timeline(self) -> list:
        """The measured run of the last step: simulator `Record`s (worker, lane, op, start, end; seconds)."""
        steps = self.steps - 1
        return [Record(name, name, steps, w, lane, name.split(" ", 1)[1][0], start, end)
                for name, w, lane, start, end in self._runtime.last_timeline]

    @_one_caller
    def evaluate(self, batch: Any, *, accuracy: bool = False) -> Any:
        """Forward only, in eval mode, with the weights the next step would read; the loss, weighted as `step`'s.

        Args:
            batch: a batch like `step`'s.
            accuracy: also count the next-token predictions of the loss's cross-entropy: a target
                (not ignore_index) is right where the logits' argmax is it (with a sharded LM head:
                where its logit is the maximum).
        Returns:
            The loss; with `accuracy`, (loss, (right, counted)) summed over every process, or
            (loss, None) if the loss computes no cross-entropy.

        Example:
            >>> loss, (right, counted) = c.evaluate(batch, accuracy=True)   # doctest: +SKIP
        """
        self._prepare(batch)
        weights, counts = self._weights(batch, "evaluate")
        loss, hits = self._runtime.evaluate(batch, weights, hits=True)
        loss = self._result(loss, counts, "evaluate loss")
        if not accuracy:
            return loss
        if hits is not None and self._dist:
            hits = (self._dist.total(hits[0], "right predictions"), self._dist.total(hits[1], "counted targets"))
        return loss, hits
