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
from dataclasses import dataclass
from typing import Sequence


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

    def __post_init__(self) -> None:
        if len(self.fused) < 1 or self.fused.step != 1:
            raise ValueError(f"StagePlan: the fused stage must hold at least one layer, got {self.fused}")
        _check_cover("forward", self.fwd, self.fused.start, ascending=True)
        _check_cover("backward", self.bwd, self.fused.start, ascending=False)

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
        out = []
        kinds = [(StageKind.F, self.fwd), (StageKind.FB, (self.fused,)), (StageKind.B, self.bwd)]
        for kind, ranges in kinds:
            for j, r in enumerate(ranges):
                out.append(Stage(len(out), kind, j, r))
        return tuple(out)

    def __str__(self) -> str:
        return f"StagePlan({self.to_str()})"


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
