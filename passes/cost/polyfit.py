"""Exact polynomial fits in the microbatch size B and the sequence length S, for `symbolic_costs`.

A layer's counted FLOPs and bytes at six (B, S) shapes fix the coefficients of 1, S, S^2, B, B*S, B*S^2
exactly (rational arithmetic on the inverse of the 6 x 6 design matrix); a seventh shape checks the fit. At one
microbatch size (`max_seq_len` asks for one B), three shapes fix 1, S, S^2 and a fourth checks them.
sympy is imported on first use (`_sympy`): `import rpcompile`, and a `plan` that does not ask for
`max_seq_len`, never need it.
"""
from __future__ import annotations

import math
import operator
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:  # annotations only: sympy is imported on first use
    import sympy


def _sympy():
    """sympy, imported on first use: `import rpcompile` and a `plan` without `max_seq_len` never need it (its
    import is about 0.2 s of the command)."""
    import sympy
    return sympy


def symbols() -> tuple[Any, Any]:
    """The symbols (B, S): sequences per microbatch and sequence length, positive integers (sympy makes equal
    symbols for equal names and assumptions, so every call's are the same)."""
    return tuple(_sympy().symbols("B S", positive=True, integer=True))



def _basis(with_s: bool, with_b: bool = True) -> list[Callable[[int, int], int]]:
    """Monomials in (B, S): 1, S, S^2, B, BS, BS^2; without S: 1, B; without B (one microbatch size): 1, S, S^2."""
    if not with_s:
        return [lambda b, s: 1, lambda b, s: b]
    in_s = [lambda b, s: 1, lambda b, s: s, lambda b, s: s * s]
    return in_s + [lambda b, s: b, lambda b, s: b * s, lambda b, s: b * s * s] if with_b else in_s


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


class Fitter:
    """Exact polynomial fits of integer samples at the fitting shapes, checked at the check shape."""

    def __init__(self, pts: list[tuple[int, int]], check: tuple[int, int], with_s: bool, with_b: bool = True) -> None:
        self.basis = _basis(with_s, with_b)
        design = [[Fraction(f(b, s)) for f in self.basis] for b, s in pts]
        if len(design) != len(self.basis):  # B-only: use the first two points
            design = design[: len(self.basis)]
        inv = _inverse(design)
        # in integers: coefficient i is (row i of inv x D) . samples / D, D the inverse's common denominator
        self.den = math.lcm(*(x.denominator for row in inv for x in row))
        self.inv = [[int(x * self.den) for x in row] for row in inv]
        self.at = [[f(b, s) for f in self.basis] for b, s in [*pts, check]]  # the monomials at every shape
        sympy = _sympy()
        B, S = symbols()
        monos = [sympy.Integer(1), S, S ** 2, B, B * S, B * S ** 2] if with_s else [sympy.Integer(1), B]
        self.monos = monos[:len(self.basis)]
        self.cache: dict[tuple, tuple[int, ...] | None] = {}
        self.exprs: dict[tuple[int, ...], sympy.Expr] = {}  # numerators -> polynomial

    def coefficients(self, samples: Sequence[int], check_value: int) -> tuple[Fraction, ...] | None:
        """The exact coefficients (on `self.monos`) through `samples`, or None if they miss `check_value`."""
        num = self.numerators(samples, check_value)
        return None if num is None else tuple(Fraction(c, self.den) for c in num)

    def numerators(self, samples: Sequence[int], check_value: int) -> tuple[int, ...] | None:
        """`coefficients` x `self.den` (whole numbers), or None if they miss `check_value`."""
        key = (*samples, check_value)
        if key not in self.cache:
            ys = [int(y) for y in samples[: len(self.basis)]]
            num = [sum(map(operator.mul, row, ys)) for row in self.inv]  # the coefficients x den
            den, n = self.den, len(self.basis)
            # the fit goes through its own n points exactly (`inv` is the exact inverse x den): only the
            # points after them (the check, and in B alone the fitting points past the first two) test it
            ok = all(sum(map(operator.mul, num, monos)) == int(y) * den
                     for monos, y in zip(self.at[n:], [*samples, check_value][n:]))
            self.cache[key] = tuple(num) if ok else None
        return self.cache[key]

    def expr(self, num: Sequence[int]) -> sympy.Expr:
        """The polynomial with coefficients `num` / `self.den` (built once per distinct numerators: a model's
        repeated blocks give the same ones, looked up as whole numbers, not Fractions)."""
        key = tuple(num)
        if key not in self.exprs:
            self.exprs[key] = sum(_sympy().Rational(c, self.den) * m for c, m in zip(key, self.monos))
        return self.exprs[key]

    def fit(self, samples: Sequence[int], check_value: int) -> sympy.Expr | None:
        """The polynomial through `samples`, or None if it misses `check_value`."""
        num = self.numerators(samples, check_value)
        return None if num is None else self.expr(num)
