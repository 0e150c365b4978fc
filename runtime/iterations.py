"""The iterations in flight: what each one runs, on which workers, and what its caller collects.

The runtime's parts share these per-iteration records: `Runtime` begins an
iteration here, the issuers and handlers look up its ProgramInfo and rotation,
the loss downloads (D handlers) leave their buffers, the commit check (host
lanes) or an evaluation takes them, and `Recovery` rewinds to a failed one.

    >>> from rpcompile.ir.plan import StagePlan
    >>> from rpcompile.passes import emit
    >>> its = Iterations(emit(StagePlan.from_str("1|1|1"), gpus=2, microbatches=2), first=0)
    >>> its.t, its.physical(1, 0) == its.program.shift % 2
    (0, True)
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from rpcompile.runtime.program_info import EVAL_BASE, ProgramInfo
from rpcompile.runtime.streams.host import wait_all

__all__ = ["Iterations"]


class Iterations:
    """The one owner of the per-iteration records (iteration numbers: training t >= first, evaluations >= EVAL_BASE).

    Owns:
        t: the next training iteration `step` runs (`advance`, `rewind`).
        first: the first iteration this runtime runs; earlier ones count as complete.
        info: iteration -> the ProgramInfo it runs (the training template's, or the evaluation's).
        losses: iteration -> per microbatch (host buffer, event) of its loss download, or None until
            its D instruction is issued (`set_loss`; read once by `read_losses`).
        values: iteration -> its microbatch losses as floats, once read (the buffers are then back
            in the pool: the next iteration's loss downloads reuse them without waiting for a commit).
        scales: iteration -> the factor its loss is multiplied by (fixed once; a rewound iteration keeps it).
        weights: iteration -> per microbatch, the factor its loss counts with in the iteration's loss
            (token weighting: n_m / N; 0 for a microbatch with nothing to train), given with its batch;
            absent: the plain mean, 1 / M each.
        hits: evaluation -> (targets predicted right, targets counted) summed over its microbatches
            (`add_hits`, `take_hits`).

    Handed:
        program: the template Program (its rotation: `gpus`, `shift`).
    """

    def __init__(self, program: Any, first: int) -> None:
        self.program = program
        self.t = self.first = first
        self.info: dict[int, ProgramInfo] = {}
        self.losses: dict[int, list] = {}
        self.values: dict[int, list[float]] = {}
        self.scales: dict[int, float] = {}
        self.weights: dict[int, list[float]] = {}
        self.hits: dict[int, Any] = {}
        self._lock = threading.Lock()

    # -- lookups ------------------------------------------------------------------------------------
    def info_of(self, t: int) -> ProgramInfo:
        """The ProgramInfo iteration t runs."""
        return self.info[t]

    def program_of(self, t: int) -> Any:
        """The Program iteration t runs."""
        return self.info[t].program

    def physical(self, t: int, w: int) -> int:
        """Physical worker of template worker w in iteration t (host: -1; evaluation runs are not rotated)."""
        if w < 0 or t >= EVAL_BASE:
            return w
        return (w + t * self.program.shift) % self.program.gpus

    def worker_of(self, t: int, ins: Any) -> int:
        """Physical worker of instruction `ins` in iteration t (host instructions: -1)."""
        return self.physical(t, ins.worker)

    def label(self, t: int, ins: Any, w: int) -> str:
        """The name of instruction `ins` on physical worker w, as failures and timelines show it."""
        return ins.name if w < 0 else f"w{w} {ins.short}"

    def keys(self, t: int, ins: Any, info: ProgramInfo) -> list[tuple[int, str]]:
        """The (iteration, name) instances `ins` of iteration t depends on (vacuous refs dropped)."""
        return [(t - r.back, r.name) for r in info.deps[ins.name] if t - r.back >= self.first and t >= r.since]

    # -- the records' life ------------------------------------------------------------------------------
    def begin(self, t: int, info: ProgramInfo, microbatches: int, weights: list[float] | None = None) -> list:
        """Record that iteration t runs `info` (with per-microbatch loss `weights`, None: the mean); returns
        its (empty) per-microbatch loss list."""
        self.info[t] = info
        if weights is None:
            self.weights.pop(t, None)
        else:
            if len(weights) != microbatches:
                raise ValueError(f"weights: {len(weights)} loss weights for {microbatches} microbatches")
            self.weights[t] = [float(w) for w in weights]
        losses = self.losses[t] = [None] * microbatches
        return losses

    def fix_scale(self, t: int, new: Callable[[], float]) -> None:
        """Give iteration t the loss scale `new()` unless it has one (a rewound iteration keeps its own)."""
        if t not in self.scales:
            self.scales[t] = new()

    def grad_factor(self, t: int, mb: int) -> float:
        """The factor microbatch mb's loss is multiplied by before its backward: loss scale x weight."""
        w = self.weights.get(t)
        return self.scales[t] / self.program_of(t).microbatches if w is None else self.scales[t] * w[mb]

    def weight(self, t: int, mb: int) -> float | None:
        """Microbatch mb's weight in iteration t's loss (None: the plain mean)."""
        w = self.weights.get(t)
        return None if w is None else w[mb]

    def mean(self, t: int, values: list[float]) -> float:
        """Iteration t's loss from its microbatch losses: their mean, or their weighted sum (a weight-0
        microbatch is left out, so its NaN (0/0 trained tokens) counts for nothing)."""
        w = self.weights.get(t)
        if w is None:
            return sum(values) / len(values)
        return sum(x * v for x, v in zip(w, values) if x != 0.0)

    def set_loss(self, t: int, mb: int, pair: tuple) -> None:
        """Leave microbatch mb's loss download (host buffer, event) for whoever takes iteration t's losses."""
        self.losses[t][mb] = pair

    def add_hits(self, t: int, hits: Any) -> None:
        """Add a microbatch's (right, counted) predictions (a CPU tensor of 2) to evaluation t's."""
        with self._lock:
            self.hits[t] = hits if t not in self.hits else self.hits[t] + hits

    def take_hits(self, t: int) -> tuple[int, int] | None:
        """Evaluation t's (right, counted) predictions over its microbatches (None: its loss has no
        cross-entropy to count); forgotten once taken."""
        with self._lock:
            h = self.hits.pop(t, None)
        return None if h is None else (int(h[0]), int(h[1]))

    def read_losses(self, t: int, ctx: Any, give: Callable[[Any], None]) -> list[float]:
        """Iteration t's microbatch losses, read once from their downloads (one host wait if still running).

        The caller of `step` and the commit check both read them; whichever comes first reads the
        host buffers and hands them back (`give(handle)`) at once, the other gets the same floats.
        Every loss download of t must have been issued (`set_loss`) before this is called.
        """
        with self._lock:
            if t in self.values:
                return self.values[t]
            pairs = list(self.losses.get(t, []))
        wait_all([ev for _, ev in pairs], ctx, t)
        with self._lock:
            if t in self.values:
                return self.values[t]
            values = self.values[t] = [float(h.get()) for h, _ in pairs]
            self.losses.pop(t, None)
        for h, _ in pairs:
            give(h)
        return values

    def advance(self) -> None:
        """The training iteration `t` has been submitted: the next `step` runs t + 1."""
        self.t += 1

    def end(self, t: int) -> None:
        """Forget an evaluation run t (after it completed)."""
        with self._lock:
            self.info.pop(t, None)
            self.values.pop(t, None)
            self.weights.pop(t, None)
            self.hits.pop(t, None)

    def forget(self, keep: Callable[[int], bool]) -> None:
        """Drop the ProgramInfo and loss scale of training iterations failing `keep(iteration)`."""
        with self._lock:
            for t in [t for t in self.info if not keep(t) and t < EVAL_BASE]:
                del self.info[t]
                self.scales.pop(t, None)
                self.weights.pop(t, None)
            for t in [t for t in self.values if not keep(t) and t < EVAL_BASE]:
                del self.values[t]

    def rewind(self, u: int) -> None:
        """Drop the records of the abandoned iterations >= u; a training u becomes the next `step`'s."""
        with self._lock:
            for d in (self.losses, self.values, self.info, self.weights, self.hits):
                for t in [t for t in d if t >= u]:
                    del d[t]
        if u < EVAL_BASE:
            self.t = u
