"""StagePlan: the asymmetric forward/backward grouping of layers into stages.

A plan is plain data. Forward stages run layers ascending; the fused stage runs
the last layers forward and backward at once; backward stages run in execution
order (descending layers), each recomputing its forward first.

    >>> p = StagePlan.from_str("2,2|1|3,1")
    >>> p.num_layers, p.num_stages, [s.label for s in p.stages]
    (5, 5, ['F1', 'F2', 'FB', 'B1', 'B2'])
    >>> p.bwd
    (range(1, 4), range(0, 1))
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Sequence

from tabulate import tabulate

from rpcompile.ir.costs import CostTable, _fmt


class StageKind(str, enum.Enum):
    """What a stage computes for each microbatch."""

    F = "F"    # forward only; saves the inputs the backward stages need
    FB = "FB"  # fused: forward then backward of the last layers, no recompute
    B = "B"    # recompute (forward again from the saved input), then backward


@dataclass(frozen=True, slots=True)
class Stage:
    """One stage: its position in the round's slot sequence, kind and layers."""

    index: int        # position in the slot sequence F1..Fa, FB, B1..Bb (0-based)
    kind: StageKind
    ordinal: int      # 0-based position among the stages of the same kind
    layers: range     # contiguous layer indices, ascending

    @property
    def label(self) -> str:
        """'F2', 'FB' or 'B3' (1-based within its kind)."""
        return self.kind.value if self.kind is StageKind.FB else f"{self.kind.value}{self.ordinal + 1}"


@dataclass(frozen=True, slots=True)
class StagePlan:
    """Layer groupings for the forward, fused and backward stages.

    `fwd` ranges ascend and cover 0..L-f-1; `fused` is the last f >= 1 layers;
    `bwd` ranges are in execution order (descending layers) and cover 0..L-f-1.
    """

    fwd: tuple[range, ...]  # forward stages, ascending
    fused: range            # the fused forward+backward stage (the last layers, through the loss)
    bwd: tuple[range, ...]  # backward stages in execution order (descending layers)
    # Evaluation attached at construction by `passes.with_report()` (never mutated); not part of equality.
    report: "PlanReport | None" = field(default=None, compare=False, repr=False)
    # Derived from the three groupings in __post_init__ (stage records in slot order).
    _stages: tuple = field(default=(), init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.fused) < 1 or self.fused.step != 1:
            raise ValueError(f"StagePlan: the fused stage must hold at least one layer, got {self.fused}")
        _check_cover("forward", self.fwd, self.fused.start, ascending=True)
        _check_cover("backward", self.bwd, self.fused.start, ascending=False)
        out: list[Stage] = []
        for kind, ranges in ((StageKind.F, self.fwd), (StageKind.FB, (self.fused,)), (StageKind.B, self.bwd)):
            for j, r in enumerate(ranges):
                out.append(Stage(len(out), kind, j, r))
        object.__setattr__(self, "_stages", tuple(out))

    @classmethod
    def from_sizes(cls, fwd: Sequence[int], fused: int, bwd: Sequence[int]) -> "StagePlan":
        """Build from stage sizes: forward ascending, fused, backward in execution order."""
        n = sum(fwd)
        if sum(bwd) != n:
            raise ValueError(f"StagePlan: forward sizes {list(fwd)} cover {n} layers but backward sizes "
                             f"{list(bwd)} cover {sum(bwd)}")
        if any(s < 1 for s in list(fwd) + list(bwd)):
            raise ValueError(f"StagePlan: every stage needs at least one layer: {list(fwd)} | {list(bwd)}")
        f, lo = [], 0
        for s in fwd:
            f.append(range(lo, lo + s))
            lo += s
        b, hi = [], n
        for s in bwd:
            b.append(range(hi - s, hi))
            hi -= s
        return cls(tuple(f), range(n, n + fused), tuple(b))

    @classmethod
    def from_str(cls, text: str) -> "StagePlan":
        """Parse "7,7,7,7|1|3,3,2" (forward sizes | fused size | backward sizes in execution order)."""
        parts = text.strip().split("|")
        if len(parts) != 3:
            raise ValueError(f"StagePlan.from_str: expected 'fwd sizes|fused size|bwd sizes', got {text!r}")
        try:
            fwd = [int(x) for x in parts[0].split(",") if x.strip()]
            fused = int(parts[1])
            bwd = [int(x) for x in parts[2].split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"StagePlan.from_str: sizes must be integers, got {text!r}") from None
        return cls.from_sizes(fwd, fused, bwd)

    def to_str(self) -> str:
        """The compact form parsed by `from_str`."""
        return (",".join(str(len(r)) for r in self.fwd) + f"|{len(self.fused)}|"
                + ",".join(str(len(r)) for r in self.bwd))

    @property
    def num_layers(self) -> int:
        return self.fused.stop

    @property
    def num_stages(self) -> int:
        return len(self.fwd) + 1 + len(self.bwd)

    @property
    def stages(self) -> tuple[Stage, ...]:
        """All stages in slot order: F1..Fa, FB, B1..Bb."""
        return self._stages

    def stage_times(self, costs: "CostTable") -> tuple[float, ...]:
        """Seconds per microbatch of each stage: F = sum fwd; FB = sum fwd+bwd; B = sum fwd+bwd (recompute)."""
        _check_costs(self, costs)
        out = []
        for s in self.stages:
            t = sum(costs.fwd[i] for i in s.layers)
            out.append(t if s.kind is StageKind.F else t + sum(costs.bwd[i] for i in s.layers))
        return tuple(out)

    def t_max(self, costs: "CostTable") -> float:
        """The slowest stage's time per microbatch."""
        return max(self.stage_times(costs))

    def stage_memory(self, costs: "CostTable", *, gpus: int | None = None) -> tuple[int, ...]:
        """Estimated device bytes of each stage while it runs (see Note).

        Args:
            costs: the cost table (`param_bytes` .. `peak_bytes`).
            gpus: workers N; the prefetched stage is the one N slots later in the
                rotation. None: the largest other stage's parameters (a bound).
        Returns:
            Bytes per stage, in slot order.

        Note: a stage's worker holds (1) the stage's parameters; (2) the next
        stage it runs, prefetched: stage (i + N) mod S of the rotation; (3) for
        FB and B stages the gradients and the backward workspace, `peak_bytes`
        summed over the stage's layers (the whole stage is recomputed, so all
        its saved tensors live at once); (4) in-flight activations: the input of
        the current and the next microbatch (uploaded one ahead; a B stage's
        input is its saved input `saved_bytes[first]`, an F/FB stage's the
        previous layer's `act_bytes`, layer 0's the batch `saved_bytes[0]`);
        the output `act_bytes[last]`; for F stages also the saved inputs of the
        backward cut points inside it; for B stages the incoming gradient
        (`act_bytes[last]`, current and next) and the outgoing one. An estimate
        used for feasibility, not an allocator trace.

        >>> from rpcompile.ir.costs import CostTable
        >>> c = CostTable.from_lists([1, 1], [2, 2], param_bytes=[10, 20], grad_bytes=[10, 20])
        >>> StagePlan.from_str("1|1|1").stage_memory(c, gpus=2)
        (20, 50, 40)
        """
        _check_costs(self, costs)
        stages = self.stages
        own = [sum(costs.param_bytes[i] for i in s.layers) for s in stages]
        cuts = {r.start for r in self.bwd if r.start > 0}
        at_cuts = [0]  # at_cuts[j + 1]: the saved inputs of the backward cut points at layers <= j
        for j, b in enumerate(costs.saved_bytes):
            at_cuts.append(at_cuts[-1] + (b if j in cuts else 0))
        top = sorted(range(len(own)), key=own.__getitem__)[-2:]  # the two largest: the largest other is one
        out = []
        for s in stages:
            lo, hi = s.layers.start, s.layers.stop - 1
            if gpus is None:
                nxt = max((own[j] for j in top if j != s.index), default=0)
            else:
                nxt = own[(s.index + gpus) % len(stages)]
            inp = costs.saved_bytes[lo] if s.kind is StageKind.B or lo == 0 else costs.act_bytes[lo - 1]
            mem = own[s.index] + nxt + 2 * inp + costs.act_bytes[hi]
            if s.kind is StageKind.F:
                mem += at_cuts[hi + 1] - at_cuts[lo + 1]
            else:
                mem += sum(costs.grad_bytes[i] + costs.peak_bytes[i] for i in s.layers)
                mem += (costs.act_bytes[lo - 1] if lo > 0 else 0)
                if s.kind is StageKind.B:
                    mem += costs.act_bytes[hi]
            out.append(mem)
        return tuple(out)

    def __str__(self) -> str:
        return f"StagePlan({self.to_str()})" if self.report is None else str(self.report)


@dataclass(frozen=True, slots=True)
class PlanReport:
    """A plan's evaluation under one cost table and schedule; `str()` is a table.

    Made by `rpcompile.passes.describe_plan` (it times the plan):

    >>> from rpcompile.ir.costs import CostTable
    >>> from rpcompile.passes import describe_plan
    >>> c = CostTable.from_lists([1e-3] * 2, [2e-3] * 2)
    >>> print(describe_plan(StagePlan.from_str("1|1|1"), c, gpus=2, microbatches=2))  # doctest: +NORMALIZE_WHITESPACE
    stage    kind    layers    time      memory    share of t_max
    -------  ------  --------  --------  --------  ----------------
    F1       F       0         1.000 ms    0 B       33%
    FB       FB      1         3.000 ms    0 B       100%
    B1       B       0         3.000 ms    0 B       100%
    plan 1|1|1: 3 stages, t_max 3.000 ms, iteration 9.000 ms (2 GPUs, 2 microbatches, staleness 0), bubble 22.2%
    """

    stages: tuple[Stage, ...]       # the plan's stages in slot order
    times: tuple[float, ...]        # seconds per microbatch, per stage
    memory: tuple[int, ...]         # estimated device bytes, per stage (`StagePlan.stage_memory`)
    t_max: float                    # the slowest stage's time
    iteration_time: float           # `iteration_time` of the plan (s)
    bubble_ratio: float             # idle share of the workers over an iteration
    gpus: int                       # workers N
    microbatches: int               # microbatches per iteration M
    staleness: int                  # 0 or 1, as evaluated
    memory_budget: int | None       # device bytes per worker, None = no limit
    note: str = ""                  # why this plan and not the partitioner's (compile's host fallback), or ""

    def __str__(self) -> str:
        rows = []
        for s, t, m in zip(self.stages, self.times, self.memory):
            lay = f"{s.layers.start}" if len(s.layers) == 1 else f"{s.layers.start}-{s.layers.stop - 1}"
            share = f"{100 * t / self.t_max:.0f}%" if self.t_max > 0 else "-"
            rows.append([s.label, s.kind.value, lay, _fmt(t, True), _fmt(m, False), share])
        table = tabulate(rows, headers=["stage", "kind", "layers", "time", "memory", "share of t_max"],
                         disable_numparse=True)
        sizes = [len(s.layers) for s in self.stages]
        kinds = [s.kind for s in self.stages]
        compact = (",".join(str(n) for n, k in zip(sizes, kinds) if k is StageKind.F) + "|"
                   + "".join(str(n) for n, k in zip(sizes, kinds) if k is StageKind.FB) + "|"
                   + ",".join(str(n) for n, k in zip(sizes, kinds) if k is StageKind.B))
        budget = "" if self.memory_budget is None else f", memory budget {_fmt(self.memory_budget, False)}"
        it = "inf" if math.isinf(self.iteration_time) else _fmt(self.iteration_time, True)
        return (f"{table}\nplan {compact}: {len(self.stages)} stages, t_max {_fmt(self.t_max, True)}, "
                f"iteration {it} ({self.gpus} GPUs, {self.microbatches} microbatches, staleness "
                f"{self.staleness}), bubble {100 * self.bubble_ratio:.1f}%{budget}"
                + (f"\n{self.note}" if self.note else ""))


def _check_costs(plan: StagePlan, costs: "CostTable") -> None:
    """Raise unless the cost table has one entry per layer of the plan."""
    if len(costs.fwd) != plan.num_layers:
        raise ValueError(f"plan has {plan.num_layers} layers but the cost table has {len(costs.fwd)}")


def _check_cover(what: str, ranges: tuple[range, ...], n: int, *, ascending: bool) -> None:
    """Raise unless `ranges` are contiguous, non-empty and cover 0..n-1 in the given order."""
    seq = ranges if ascending else tuple(reversed(ranges))
    lo = 0
    for r in seq:
        if r.step != 1 or len(r) < 1 or r.start != lo:
            raise ValueError(f"StagePlan: {what} stages {list(ranges)} must be contiguous, non-empty and "
                             f"{'ascending' if ascending else 'descending'} over layers 0..{n - 1}")
        lo = r.stop
    if lo != n:
        raise ValueError(f"StagePlan: {what} stages {list(ranges)} cover 0..{lo - 1}, expected 0..{n - 1}")
