"""Costs as exact formulas in the microbatch size B and sequence length S, and `max_seq_len`.

`symbolic_costs` counts every layer (predict mode, on `meta`) at six (B, S)
shapes, fits each op's FLOPs and bytes and each memory column EXACTLY (rational
arithmetic) on the monomials 1, S, S^2, B, B*S, B*S^2, and checks the fit on a
seventh shape. Times are then sums of per-op rooflines, `Max(flops/(peak*eff),
bytes/bw)`, so `SymbolicCosts.at(B, S)` reproduces `estimate_costs(mode="predict")`
at any shape. `max_seq_len` solves the memory constraints for the largest S.

    >>> sc = estimate_costs(g, batch, mode="predict", hardware=hw, symbolic=True)  # tiny Llama, hidden 32
    >>> sc.fwd_flops[1]
    128*B*S**2 + 18432*B*S
    >>> max_seq_len(sc, Hardware.preset("rtx4090"), gpus=8)
    32789
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Sequence

import sympy
import torch
from tabulate import tabulate

from rpcompile.costs import CostTable
from rpcompile.graph import LayerGraph
from rpcompile.hardware import Hardware
from rpcompile.passes.cost import LayerCount, count_layers

__all__ = ["SymbolicCosts", "symbolic_costs", "max_seq_len", "B", "S"]

B, S = sympy.symbols("B S", positive=True, integer=True)
_SYM_B, _SYM_S = B, S
_MEMORY = ("param_bytes", "grad_bytes", "act_bytes", "saved_bytes", "peak_bytes")


@dataclass(frozen=True)
class SymbolicCosts:
    """Per-layer costs of one microbatch as sympy expressions in `B` (microbatch size) and `S` (sequence length)."""

    names: tuple[str, ...]  # layer names
    fwd: tuple[sympy.Expr, ...]  # forward seconds on `hardware`
    bwd: tuple[sympy.Expr, ...]  # backward seconds (no recompute)
    fwd_flops: tuple[sympy.Expr, ...]  # forward FLOPs (exact polynomial)
    bwd_flops: tuple[sympy.Expr, ...]  # backward FLOPs (exact polynomial)
    param_bytes: tuple[sympy.Expr, ...]  # as CostTable, constants
    grad_bytes: tuple[sympy.Expr, ...]  # as CostTable, constants
    act_bytes: tuple[sympy.Expr, ...]  # as CostTable, polynomials
    saved_bytes: tuple[sympy.Expr, ...]  # as CostTable, polynomials
    peak_bytes: tuple[sympy.Expr, ...]  # as CostTable, polynomials
    param_numel: int  # distinct parameter elements of the model (tied counted once), for host memory
    hardware: Hardware  # the hardware the times are for

    def at(self, B: int, S: int = 1) -> CostTable:
        """The CostTable at a concrete microbatch size and sequence length.

        >>> sc.at(B=2, S=100).fwd_flops[1]
        6246400
        """
        env = {_SYM_B: B, _SYM_S: S}

        def ev(exprs, kind):
            return [kind(sympy.sympify(e).subs(env)) for e in exprs]

        return CostTable.from_lists(
            fwd=ev(self.fwd, float), bwd=ev(self.bwd, float), names=self.names,
            **{k: ev(getattr(self, k), int) for k in _MEMORY},
            fwd_flops=ev(self.fwd_flops, int), bwd_flops=ev(self.bwd_flops, int))

    def __str__(self) -> str:
        rows = [[i, n, self.fwd_flops[i], self.bwd_flops[i], self.act_bytes[i], self.peak_bytes[i]]
                for i, n in enumerate(self.names)]
        return tabulate(rows, headers=["#", "layer", "fwd FLOPs", "bwd FLOPs", "act out bytes", "workspace bytes"],
                        disable_numparse=True)


def _seq_len(graph: LayerGraph, inputs: dict[str, torch.Tensor]) -> int | None:
    """S of the example: dim 1 of the first token-id input (ndim >= 2) or float input with ndim >= 3."""
    for name in graph.inputs:
        t = inputs[name]
        if (t.dim() >= 2 and not t.is_floating_point()) or t.dim() >= 3:
            return int(t.shape[1])
    return None


def resize_inputs(graph: LayerGraph, inputs: dict[str, torch.Tensor], b: int, s: int | None) -> dict:
    """Inputs tiled/cropped to batch `b` (batched inputs' dim 0) and sequence `s` (dims of size S0, from dim 1)."""
    s0 = _seq_len(graph, inputs)
    out = {}
    for name, t in inputs.items():
        v = graph.values.get(name)
        for d in range(t.dim()):
            if d == 0 and (v is None or v.batch_dim == 0):
                new = b
            elif d > 0 and s is not None and t.shape[d] == s0:
                new = s
            else:
                continue
            idx = torch.arange(new, device=t.device) % max(t.shape[d], 1)
            t = t.index_select(d, idx)
        out[name] = t
    return out


def _points(s0: int | None) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Six fitting shapes (B in {2, 3} x three S) and one check shape.

    Note: B = 1 and S = 1 are avoided; there some copies (`contiguous` of a size-1 dim) vanish.
    """
    if s0 is None:
        return [(2, 1), (3, 1)], (4, 1)
    pts = sorted({max(2, math.ceil(s0 / 2)), max(2, math.ceil(3 * s0 / 4)), s0})
    check = max(2, round(5 * s0 / 8))
    if len(pts) < 3 or check in pts:
        pts, check = [s0, s0 + 1, s0 + 2], s0 + 3
    return [(b, s) for b in (2, 3) for s in pts], (4, check)


def _basis(with_s: bool) -> list[Callable[[int, int], int]]:
    """Monomials in (B, S): 1, S, S^2, B, BS, BS^2 (or 1, B without S)."""
    if not with_s:
        return [lambda b, s: 1, lambda b, s: b]
    return [lambda b, s: 1, lambda b, s: s, lambda b, s: s * s,
            lambda b, s: b, lambda b, s: b * s, lambda b, s: b * s * s]


def _inverse(rows: list[list[Fraction]]) -> list[list[Fraction]]:
    """Exact inverse of a small square matrix (Gauss-Jordan on Fractions)."""
    n = len(rows)
    a = [list(r) + [Fraction(int(i == j)) for j in range(n)] for i, r in enumerate(rows)]
    for c in range(n):
        p = next(r for r in range(c, n) if a[r][c] != 0)
        a[c], a[p] = a[p], a[c]
        a[c] = [x / a[c][c] for x in a[c]]
        for r in range(n):
            if r != c and a[r][c] != 0:
                a[r] = [x - a[r][c] * y for x, y in zip(a[r], a[c])]
    return [r[n:] for r in a]


class _Fitter:
    """Exact polynomial fits of integer samples at the fitting shapes, checked at the check shape."""

    def __init__(self, pts: list[tuple[int, int]], check: tuple[int, int], with_s: bool) -> None:
        self.basis = _basis(with_s)
        self.pts, self.check = pts, check
        design = [[Fraction(f(b, s)) for f in self.basis] for b, s in pts]
        if len(design) != len(self.basis):  # B-only: use the first two points
            design = design[: len(self.basis)]
        self.inv = _inverse(design)
        self.monos = [sympy.Integer(1), S, S ** 2, B, B * S, B * S ** 2] if with_s else [sympy.Integer(1), B]
        self.cache: dict[tuple, sympy.Expr | None] = {}

    def fit(self, samples: Sequence[int], check_value: int) -> sympy.Expr | None:
        """The polynomial through `samples`, or None if it misses `check_value`."""
        key = (*samples, check_value)
        if key not in self.cache:
            ys = [Fraction(int(y)) for y in samples[: len(self.basis)]]
            coef = [sum(r * y for r, y in zip(row, ys)) for row in self.inv]
            ok = all(sum(c * f(b, s) for c, f in zip(coef, self.basis)) == y
                     for (b, s), y in zip([*self.pts, self.check], [*samples, check_value]))
            self.cache[key] = sum(sympy.Rational(c.numerator, c.denominator) * m
                                  for c, m in zip(coef, self.monos)) if ok else None
        return self.cache[key]


def _time_expr(fitter: _Fitter, per_shape: list[Sequence], hw: Hardware, where: str) -> sympy.Expr:
    """Memory-bound ops' bytes / bw + launches * op_latency + sum of Max(flops/(peak*eff), bytes/bw) of FLOP ops."""
    flop_ops = [[o for o in ops if o.flops] for ops in per_shape]
    if any([o.name for o in ops] != [o.name for o in flop_ops[0]] for ops in flop_ops):
        raise ValueError(f"{where}: the FLOP-counted ops change with the shape; cannot fit it symbolically")
    launches = {len(ops) for ops in per_shape}
    mem = fitter.fit([sum(o.bytes for o in ops if not o.flops) for ops in per_shape[:-1]],
                     sum(o.bytes for o in per_shape[-1] if not o.flops))
    if len(launches) != 1 or mem is None:
        raise ValueError(f"{where}: the memory-bound ops change with the shape; cannot fit it symbolically")
    groups: dict[tuple, int] = {}
    for k, op in enumerate(flop_ops[0]):
        col = [ops[k] for ops in flop_ops]
        fl = fitter.fit([o.flops for o in col[:-1]], col[-1].flops)
        by = fitter.fit([o.bytes for o in col[:-1]], col[-1].bytes)
        if fl is None or by is None:
            raise ValueError(f"{where}: op {op.name} is not polynomial in B, S of degree <= (1, 2)")
        groups[(fl, by, op.dtype)] = groups.get((fl, by, op.dtype), 0) + 1
    bw = sympy.Float(hw.mem_bandwidth)
    expr = mem / bw + launches.pop() * sympy.Float(hw.op_latency)
    for (fl, by, dt), n in groups.items():
        expr += n * sympy.Max(fl / sympy.Float(hw.flops(dt) * hw.efficiency), by / bw)
    return expr


def symbolic_costs(graph: LayerGraph, inputs: dict[str, torch.Tensor], hardware: Hardware, *,
                   make_inputs: Callable[[int, int], dict] | None = None, progress: bool = False) -> SymbolicCosts:
    """Fit every layer's predicted costs as exact expressions in B and S.

    Args:
        graph: the traced model (weights may be on `meta`).
        inputs: one microbatch's named inputs; its shapes pick the fitting points (near its S).
        hardware: prices the ops (times are Max-sums of rooflines).
        make_inputs: optional (B, S) -> named inputs; default tiles/crops `inputs`.
    Returns:
        A SymbolicCosts; `.at(B, S)` equals predict mode at that shape (FLOPs/bytes exactly).
    Raises:
        ValueError: a quantity is not polynomial of the assumed form (names layer and op).
    """
    s0 = _seq_len(graph, inputs)
    pts, check = _points(s0)
    fitter = _Fitter(pts, check, s0 is not None)
    make = make_inputs or (lambda b, s: resize_inputs(graph, inputs, b, s if s0 is not None else None))
    runs: list[list[LayerCount]] = [count_layers(graph, make(b, s), progress=progress) for b, s in [*pts, check]]
    cols: dict[str, list] = {k: [] for k in ("fwd", "bwd", "fwd_flops", "bwd_flops", *_MEMORY)}
    for i, layer in enumerate(graph.layers):
        where = f"layer {i} ({layer.name})"
        per = [run[i] for run in runs]
        for k in _MEMORY:
            e = fitter.fit([getattr(c, k) for c in per[:-1]], getattr(per[-1], k))
            if e is None:
                raise ValueError(f"{where}: {k} is not polynomial in B, S of degree <= (1, 2)")
            cols[k].append(e)
        for ph in ("fwd", "bwd"):
            ops = [getattr(c, f"{ph}_ops") for c in per]
            cols[ph].append(_time_expr(fitter, ops, hardware, f"{where} {ph}"))
            tot = [sum(o.flops for o in o_) for o_ in ops]
            cols[f"{ph}_flops"].append(fitter.fit(tot[:-1], tot[-1]))
    numel = sum(v.bytes // max(v.dtype.itemsize, 1) for v in graph.params.values())
    return SymbolicCosts(names=tuple(layer.name for layer in graph.layers), **{k: tuple(v) for k, v in cols.items()},
                         param_numel=numel, hardware=hardware)


def _default_inputs(graph: LayerGraph) -> dict[str, torch.Tensor]:
    """Zero tensors shaped like the traced example's inputs."""
    return {n: torch.zeros(graph.values[n].shape, dtype=graph.values[n].dtype) for n in graph.inputs}


def max_seq_len(graph_or_costs: LayerGraph | SymbolicCosts, hardware: Hardware, *, gpus: int | None = None,
                example: Any = None, microbatch_size: int = 1, layers_per_stage: int = 1,
                microbatches: int | None = None, host_bytes_per_param: int = 16, usable: float = 0.9,
                limit: int = 1 << 24) -> int:
    """Largest sequence length S whose training fits the device and host memory (0 if none does).

    Constraints, every byte count at microbatch size `microbatch_size` and length S:
      device: for every window of `layers_per_stage` consecutive layers (a stage running
        its backward): params + grads + workspace of the window + its saved input + the
        output gradient + the next window's prefetched params <= usable * device_memory;
      host: param_numel * host_bytes_per_param (compute copy, fp32 master, Adam m and v,
        gradient) + microbatches * saved inputs of every stage <= usable * host_memory.

    Args:
        graph_or_costs: a SymbolicCosts, or a LayerGraph (fitted here in predict mode).
        hardware: device_memory, host_memory (and gpus if `gpus` is None).
        gpus: workers; default `hardware.gpus`. microbatches: in flight, default = gpus.
        example: for a LayerGraph, a batch to fit at (default zeros shaped like the trace's).
    Returns:
        The largest integer S <= limit that fits (0 if even S=1 does not).

    >>> max_seq_len(sc, Hardware.preset("rtx4090"), gpus=8)
    """
    sc = graph_or_costs
    if isinstance(sc, LayerGraph):
        inputs = sc.flatten_inputs(example) if example is not None else _default_inputs(sc)
        sc = symbolic_costs(sc, inputs, hardware)
    if not isinstance(sc, SymbolicCosts):
        raise TypeError(f"max_seq_len needs a LayerGraph or SymbolicCosts, got {type(sc).__name__}")
    m = microbatches or gpus or hardware.gpus
    k = max(1, layers_per_stage)
    col = {f: [sympy.lambdify(S, sympy.sympify(e).subs(B, microbatch_size), "math") for e in getattr(sc, f)]
           for f in _MEMORY}
    n = len(sc.names)

    def fits(s: int) -> bool:
        v = {f: [fn(s) for fn in fns] for f, fns in col.items()}
        wins = [range(i, min(i + k, n)) for i in range(n)]
        par = [sum(v["param_bytes"][j] for j in w) for w in wins]
        dev = max(par[w.start] + sum(v["grad_bytes"][j] + v["peak_bytes"][j] for j in w)
                  + v["saved_bytes"][w.start] + v["act_bytes"][w.stop - 1]
                  + (par[w.stop] if w.stop < n else 0) for w in wins)
        host = sc.param_numel * host_bytes_per_param + m * sum(v["saved_bytes"][i] for i in range(0, n, k))
        return dev <= usable * hardware.device_memory and host <= usable * hardware.host_memory

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
