"""CostTable: per-layer, per-microbatch time and memory, the partitioner's input.

A CostTable is plain data (tuples of floats and ints), so partitioning and
scheduling can be unit-tested with no model at all:

    >>> t = CostTable.from_lists(fwd=[1.0, 2.0], bwd=[2.0, 4.0])
    >>> t.num_layers, t.fwd[1], t.param_bytes
    (2, 2.0, (0, 0))
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Sequence

from tabulate import tabulate

# Per-layer columns: (field name, is a time in seconds, printed header).
_COLUMNS = (
    ("fwd", True, "fwd"),
    ("bwd", True, "bwd"),
    ("param_bytes", False, "params"),
    ("grad_bytes", False, "grads"),
    ("act_bytes", False, "act out"),
    ("saved_bytes", False, "saved in"),
    ("peak_bytes", False, "workspace"),
)


@dataclass(frozen=True, slots=True)
class CostTable:
    """Per-layer costs for one microbatch.

    Every field is a tuple with one entry per layer, in layer order.
    """

    names: tuple[str, ...]        # layer names, for messages and tables
    fwd: tuple[float, ...]        # forward time (s)
    bwd: tuple[float, ...]        # backward time (s), excluding the recompute (which is `fwd` again)
    param_bytes: tuple[int, ...]  # bytes of the layer's parameters in the training dtype
    grad_bytes: tuple[int, ...]   # bytes of gradients of trainable parameters
    act_bytes: tuple[int, ...]    # bytes of the layer's outputs that cross a cut (sent downstream)
    saved_bytes: tuple[int, ...]  # bytes of the layer's input kept on the host for recompute
    peak_bytes: tuple[int, ...]   # device workspace during the layer's backward (autograd-saved tensors etc.)
    fwd_flops: tuple[float, ...] | None = None  # forward FLOPs where known
    bwd_flops: tuple[float, ...] | None = None  # backward FLOPs where known

    def __post_init__(self) -> None:
        n = len(self.names)
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if len(v) != n:
                raise ValueError(f"CostTable.{f.name} has {len(v)} entries, expected {n} (one per layer)")
            for name, x in zip(self.names, v):
                if isinstance(x, str):
                    continue
                if not math.isfinite(x) or x < 0:
                    raise ValueError(f"CostTable.{f.name} of layer {name!r} is {x!r}; costs must be finite and >= 0")

    @classmethod
    def from_lists(
        cls,
        fwd: Sequence[float],
        bwd: Sequence[float],
        param_bytes: Sequence[int] | None = None,
        grad_bytes: Sequence[int] | None = None,
        act_bytes: Sequence[int] | None = None,
        saved_bytes: Sequence[int] | None = None,
        peak_bytes: Sequence[int] | None = None,
        names: Sequence[str] | None = None,
        fwd_flops: Sequence[float] | None = None,
        bwd_flops: Sequence[float] | None = None,
    ) -> "CostTable":
        """Build a table from plain numbers; a missing list means zeros.

        Args:
            fwd, bwd: seconds per layer per microbatch (`bwd` excludes the recompute).
            param_bytes .. peak_bytes: bytes per layer (see the field comments).
            names: layer names (default "L0", "L1", ...).
        Returns:
            A validated CostTable.

        >>> CostTable.from_lists([1, 1], [2, 2], names=["a", "b"]).names
        ('a', 'b')
        """
        n = len(fwd)
        zeros = (0,) * n

        def ints(v):
            return zeros if v is None else tuple(int(x) for x in v)

        return cls(
            names=tuple(names) if names is not None else tuple(f"L{i}" for i in range(n)),
            fwd=tuple(float(x) for x in fwd),
            bwd=tuple(float(x) for x in bwd),
            param_bytes=ints(param_bytes),
            grad_bytes=ints(grad_bytes),
            act_bytes=ints(act_bytes),
            saved_bytes=ints(saved_bytes),
            peak_bytes=ints(peak_bytes),
            fwd_flops=None if fwd_flops is None else tuple(float(x) for x in fwd_flops),
            bwd_flops=None if bwd_flops is None else tuple(float(x) for x in bwd_flops),
        )

    def to_lists(self) -> dict:
        """The keyword arguments of `from_lists` that rebuild this table."""
        return {f.name: (None if getattr(self, f.name) is None else list(getattr(self, f.name)))
                for f in fields(self)}

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def totals(self) -> dict[str, float]:
        """Sum over layers of every known column, e.g. `t.totals()["fwd"]`.

        >>> CostTable.from_lists([1, 2], [3, 4]).totals()["bwd"]
        7.0
        """
        return {f.name: sum(getattr(self, f.name)) for f in fields(self)
                if f.name != "names" and getattr(self, f.name) is not None}

    def __str__(self) -> str:
        cols = list(_COLUMNS) + [(f, None, h) for f, h in (("fwd_flops", "fwd FLOP"), ("bwd_flops", "bwd FLOP"))
                                 if getattr(self, f) is not None]
        rows = []
        for i, name in enumerate(self.names):
            rows.append([i, name] + [_fmt(getattr(self, f)[i], is_time) for f, is_time, _ in cols])
        rows.append(["", "total"] + [_fmt(sum(getattr(self, f)), is_time) for f, is_time, _ in cols])
        return tabulate(rows, headers=["#", "layer"] + [h for _, _, h in cols], disable_numparse=True)


def _fmt(x: float, is_time: bool | None) -> str:
    """A time in ms, a FLOP count (is_time None) in G, or a byte count in binary units."""
    if is_time is None:
        return f"{x / 1e9:.2f} G"
    if is_time:
        return f"{x * 1e3:.3f} ms"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return str(x)
