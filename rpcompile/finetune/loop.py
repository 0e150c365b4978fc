"""The steps of a fine-tuning run: schedule, step, metrics, checkpoints, eval, and what stops it.

    >>> losses = Loop(c, cfg, plan, train, held, log, ranks).run(evals, on_step)   # doctest: +SKIP

Per step t: set the scheduled learning rate, step this rank's share of batch t,
update the progress bar, eval every `eval_every` steps (the loss and the token accuracy), checkpoint
every `save_every` steps, and record the step's metrics (`rpcompile.finetune.metrics`).

A checkpoint never covers a line that is not on disk: at a checkpoint step the eval runs
first, then every pending line (that step's eval included) is written, and only then is the
checkpoint saved. A kill before the save leaves the previous checkpoint, whose resume drops the
later lines and runs those steps and evals again; a kill after it loses nothing.

A step's metrics line is written once the next step has returned (or at a
checkpoint, or at the end): its gradient norm and the runtime's counters are
read then, from what the runtime recorded, so logging never makes a step wait
for the staleness-1 update still running behind it. With fp16, a line also waits for its step's
overflow check (known one step later at staleness 1): it carries the loss scale and whether the step
was skipped, and each skipped step prints one line on stderr as its check becomes known,
"step 3: skipped (fp16 overflow), loss scale 32768 -> 16384" (`metrics.skip_line`).

A runtime failure (an instruction that raised, or a wait past its deadline) stops the run with
`StepFailed`: one line naming the step, the instruction, its worker and the wait, and the path of
`OUT/rpcompile-failure.txt`, which holds the whole message (the instruction grid, the worker's traceback).

What stops a run (`StepOutOfMemory`, `StepFailed`, KeyboardInterrupt: Ctrl-C, or SIGTERM from the command line,
whose message becomes one line, "interrupted in step 8 (undone, the checkpoint of step 6 is kept; continue with
--resume)", for the command line to print): the step that failed is
undone by the runtime, the lines of the steps that finished are written, and the
last checkpoint is left as it was (a checkpoint is replaced atomically, never
half-written), so `--resume` continues from it.
"""
from __future__ import annotations

import os
import re
import resource
import traceback
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from rpcompile.finetune.metrics import scale_figures, skip_line
from rpcompile.finetune.schedule import lr_at
from rpcompile.ir.instr import Op
from rpcompile.runtime.streams.host import seconds
from rpcompile.runtime.transfer import RuntimeFailure

__all__ = ["Loop", "StepPlan", "StepOutOfMemory", "StepFailed", "evaluate_loss", "out_of_memory", "step_failure",
           "FAILURE_FILE"]

IGNORE = -100  # the label of an untrained position
_INSTR = re.compile(r"w(\d+) ([A-Za-z]+)(\d+)(?:\.m(\d+))?")  # an instruction name, e.g. "w3 B5.m2"
FAILURE_FILE = "rpcompile-failure.txt"  # in OUT: the last runtime failure's grid and tracebacks


class StepOutOfMemory(MemoryError):
    """A step ran out of device or host memory; the message says where and what to lower."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    """How long the run is and how big its steps are."""

    total: int  # steps in all (a resumed run counts the earlier ones)
    size: int  # sequences per step, every rank together
    lr: float  # peak learning rate
    checkpoint: str  # the checkpoint's path


class StepFailed(RuntimeError):
    """A step failed in the runtime (an instruction raised, or a wait ran past its deadline); one line, the rest in
    `path`."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


def step_failure(exc: BaseException, step: int, saved: int | None, out: str, rank: int = 0) -> StepFailed | None:
    """The one-line error for a `RuntimeFailure` `exc` in 1-based `step` (None if `exc` is none); the whole failure
    (the instruction grid, the worker's and the caller's tracebacks) is written to OUT/rpcompile-failure.txt.

    Example:
        >>> str(step_failure(failure, 1, None, "out/"))   # doctest: +SKIP
        'step 1 failed: instruction w0 G0.r0.c0 (worker 0) waited 600 s for h C.l3 (iteration 0) (the deadline: ...'
    """
    if not isinstance(exc, RuntimeFailure):
        return None
    name = FAILURE_FILE if rank == 0 else f"rpcompile-failure-rank{rank}.txt"
    path = os.path.join(out, name)
    try:
        os.makedirs(out, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(traceback.format_exception(exc)))
    except OSError as err:
        path = f"(not written: {err})"
    cause = exc.__cause__
    worker, lane = re.match(r"w(\d+)[ /]", exc.instr), re.fullmatch(r"w(\d+)/(\w+)", exc.instr)
    where = f"worker {worker.group(1)}" if worker else "the host" if exc.instr.startswith("h ") else "the caller"
    what = f"the {lane.group(2)} stream of worker {lane.group(1)}" if lane else f"instruction {exc.instr} ({where})"
    if isinstance(cause, TimeoutError) and getattr(cause, "what", None):
        why = (f"waited {seconds(cause.waited)} for {cause.what} (the deadline: raise it with --timeout SECONDS if "
               f"the machine is just slow)")
    else:
        text = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else ""
        why = f"failed: {type(cause).__name__}: {text}" if cause is not None else str(exc).splitlines()[0]
    kept = f"the checkpoint of step {saved} is kept" if saved else "no checkpoint yet"
    return StepFailed(f"step {step} failed: {what} {why}; {kept}; the instruction grid and tracebacks are in {path}",
                      path)


def out_of_memory(exc: BaseException, step: int, saved: int | None) -> StepOutOfMemory | None:
    """The one-line error for an out-of-memory `exc` in 1-based `step`, or None if `exc` is not one.

    The worker and the stage come from the runtime's failure (`RuntimeFailure.instr`) when it has them.
    """
    cause = exc.__cause__ if isinstance(exc, RuntimeFailure) else exc
    if not isinstance(cause, (torch.OutOfMemoryError, MemoryError)):
        return None
    kind = "host" if isinstance(cause, MemoryError) else "device"
    where = ""
    m = _INSTR.match(getattr(exc, "instr", "") or "")
    if m:
        op = next((o.name.lower() for o in Op if o.value == m.group(2)), m.group(2))
        mb = f", microbatch {m.group(4)}" if m.group(4) else ""
        where = f" on worker {m.group(1)}, stage {m.group(3)} ({op}{mb})"
    kept = f"the checkpoint of step {saved} is kept (continue with --resume)" if saved else "no checkpoint yet"
    return StepOutOfMemory(f"out of {kind} memory in step {step}{where}: lower --micro-batch-size, --seq or "
                           f"--microbatches; {kept}")


def evaluate_loss(c: Any, held: Any, size: int, ranks: Any) -> tuple[float, float | None]:
    """The held-out loss and token accuracy, each sequence once, token-weighted.

    Every rank evaluates its share of each batch; `evaluate` all-reduces the token counts.

    Returns:
        (sum NLL / trained tokens, right / trained tokens): a trained token is right where the
        model's most likely next token is it (TRL's mean_token_accuracy); None if the loss has no
        cross-entropy to count.
    """
    batches = held.eval_batches(size, fill="ignore")
    counts = [int((b["labels"][:, 1:] != IGNORE).sum()) for b in batches]
    loss, hits = 0.0, []
    for b, n in zip(batches, counts):
        if n:
            part, h = c.evaluate(ranks.share(b), accuracy=True)
            loss += part * n
            hits.append(h)
    counted = sum(h[1] for h in hits) if None not in hits else 0
    return loss / sum(counts), (sum(h[0] for h in hits) / counted if counted else None)


class Loop:
    """Steps `c` from `c.steps` to `plan.total` (see the module docstring).

    Args:
        c: the Compiled run (this rank's).
        cfg: the FinetuneConfig.
        plan: the StepPlan.
        train, held: the packed training and held-out data (held may be None).
        log: the MetricsLog (None: this rank writes no metrics).
        ranks: the `finetune_dist.Ranks` of this process.
    """

    def __init__(self, c: Any, cfg: Any, plan: StepPlan, train: Any, held: Any, log: Any, ranks: Any) -> None:
        self.c, self.cfg, self.plan, self.train, self.held, self.log, self.ranks = c, cfg, plan, train, held, \
            log, ranks
        self.pending: list[dict[str, Any]] = []  # records of finished steps, written when the next one returns
        self.saved: int | None = c.steps or None  # the step of the checkpoint on disk (a resume starts at one)
        self.accuracy: dict[int, float | None] = {}  # step -> its eval's token accuracy
        self.checked = c.steps  # fp16: the first 0-based iteration whose loss scale check is not yet read

    def run(self, evals: list, on_step: Callable | None) -> list[float]:
        """The loop; returns this call's losses; evals gets (step, eval loss) appended."""
        from tqdm.auto import tqdm

        c, cfg, plan = self.c, self.cfg, self.plan
        losses: list[float] = []
        if self.held is not None and c.steps == 0:
            print(self.evaluate(evals))  # the model before training
            self._add_eval(evals[-1])
        quiet = not cfg.progress or not self.ranks.writes
        with tqdm(total=plan.total, initial=c.steps, unit="step", disable=quiet, dynamic_ncols=True) as bar:
            t = c.steps
            try:
                while c.steps < plan.total:
                    t = c.steps
                    losses.append(self._step(bar, evals))
                    if on_step is not None:
                        on_step(c.steps, losses[-1])
            except KeyboardInterrupt as exc:  # Ctrl-C, or the command line's SIGTERM (a subclass)
                self._write(complete=True)  # every finished step's line (the counters as recorded)
                done = "finished, " if c.steps > t else "undone, "  # its update may have begun: then it counts
                kept = f"the checkpoint of step {self.saved} is kept" if self.saved else "no checkpoint was written"
                why = str(exc) or "interrupted"
                exc.args = (f"{why} in step {t + 1} ({done}{kept}; continue with --resume)",)  # its one line
                raise
            except Exception as exc:
                self._write(complete=True)
                oom = out_of_memory(exc, t + 1, self.saved)
                if oom is not None:
                    raise oom from None
                failed = step_failure(exc, t + 1, self.saved, cfg.out, self.ranks.rank)
                if failed is None:
                    raise
                raise failed from exc
        return losses

    def _step(self, bar: Any, evals: list) -> float:
        """One step: lr, step, progress, checkpoint, eval, metrics."""
        c, cfg, plan = self.c, self.cfg, self.plan
        t = c.steps
        rate = lr_at(t, lr=plan.lr, total=plan.total, warmup=cfg.warmup, kind=cfg.schedule)
        c.set_lr(rate)  # the lr of the update made from this step's gradient
        rows = self.train.batch_rows(t, plan.size, cfg.seed)
        batch = self.train.rows(rows)
        start = time.perf_counter()
        loss = c.step(self.ranks.share(batch))
        took = time.perf_counter() - start
        tokens = self.train.real_tokens(rows)  # padding left out (--packing none pads every document)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens / took:,.0f}", lr=f"{rate:.2e}", refresh=False)
        bar.update(1)
        self._write(complete=False)  # the previous step's line: its figures are recorded by now
        if c.steps % cfg.logging_steps == 0 or c.steps == plan.total:
            trained = int((batch["labels"][:, 1:] != IGNORE).sum())
            self.pending.append({"step": c.steps, "loss": loss, "lr": rate, "tokens": tokens,
                                 "trained_tokens": trained, "step_s": took, "tokens_per_s": tokens / took,
                                 "trained_tokens_per_s": trained / took,
                                 "padded_tokens_per_s": batch["input_ids"].numel() / took})
        if self.held is not None and cfg.eval_every and c.steps % cfg.eval_every == 0 and c.steps < plan.total:
            bar.write(self.evaluate(evals))
            self._add_eval(evals[-1])
        if cfg.save_every and c.steps % cfg.save_every == 0:
            c.flush()  # the step's work done: every pending line is complete
            self._write(complete=True)  # on disk before the checkpoint that covers them (its eval too)
            c.save(plan.checkpoint)
            self.saved = c.steps
        return loss

    def evaluate(self, evals: list) -> str:
        """Evaluate the held-out data now: (step, loss) goes to `evals`, the token accuracy is kept for the
        step's metrics line; returns the line to print."""
        loss, accuracy = evaluate_loss(self.c, self.held, self.plan.size, self.ranks)
        evals.append((self.c.steps, loss))
        self.accuracy[self.c.steps] = accuracy
        return f"step {self.c.steps}: eval loss {loss:.4f}" + (
            f", token accuracy {accuracy:.4f}" if accuracy is not None else "")

    def _add_eval(self, ev: tuple[int, float]) -> None:
        """Put an eval loss (and token accuracy) on its step's line (a line of its own if that step is not logged)."""
        figures = {"eval_loss": ev[1]}
        if self.accuracy.get(ev[0]) is not None:
            figures["eval_token_accuracy"] = self.accuracy[ev[0]]
        for r in self.pending:
            if r["step"] == ev[0]:
                r.update(figures)
                return
        self.pending.append({"step": ev[0], **figures})

    def finish(self, evals: list) -> None:
        """The end of the run: the final eval on the last line, every pending line written."""
        if evals and evals[-1][0] == self.c.steps:
            self._add_eval(evals[-1])
        self._write(complete=True)

    def _write(self, *, complete: bool) -> None:
        """Write the pending lines: all of them if `complete` (the runtime is quiet, or the run is stopping), else
        all but the last step's."""
        now = self.c.steps
        self._read_checks()
        n = next((i for i, r in enumerate(self.pending)  # in step order: lines wait for the ones before them
                  if not (complete or r["step"] < now and self._checked(r))), len(self.pending))
        ready, self.pending = self.pending[:n], self.pending[n:]
        if self.log is None:
            return
        for r in ready:
            self.log.write(self._figures(r))

    def _read_checks(self) -> None:
        """fp16: read the dynamic loss scale checks made since the last call, in order; print a line per skipped step."""
        if self.c.state.scaler is None:
            return
        from tqdm.auto import tqdm
        known = dict(self.c.state.verdicts)  # the optimizer thread adds to it: a copy
        while self.checked in known or known and self.checked < min(known):  # (one forgotten already: passed)
            v = known.get(self.checked)
            if v is not None and v.skipped and self.ranks.writes:
                tqdm.write(skip_line(self.checked + 1, v), file=sys.stderr)
            self.checked += 1

    def _checked(self, r: dict[str, Any]) -> bool:
        """Whether record `r` can be written: its step's loss scale check is read (fp16), or it needs none."""
        return self.c.state.scaler is None or "loss" not in r or r["step"] - 1 < self.checked

    def _figures(self, r: dict[str, Any]) -> dict[str, Any]:
        """A pending record with the gradient norm, the host peak and the runtime's counters of its step."""
        took = r.get("step_s")
        if "loss" not in r:
            return r
        it = r["step"] - 1  # the runtime's 0-based iteration
        r["grad_norm"] = self.c.state.norms.get(it)
        if it in self.c.state.verdicts:  # fp16: the dynamic loss scale's check of the step
            r.update(scale_figures(self.c.state.verdicts[it]))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        r["peak_host_bytes"] = peak if sys.platform == "darwin" else peak * 1024  # Linux counts KiB
        try:
            s = self.c.stats(step=it)
        except (KeyError, RuntimeError):  # forgotten already, or the run is closed: no counters
            return r
        busy = s.pop("busy_s", {})
        r.update({k: v for k, v in s.items()})
        if took:
            r["busy_share"] = {lane: round(b / took, 4) for lane, b in sorted(busy.items())}
        return r
