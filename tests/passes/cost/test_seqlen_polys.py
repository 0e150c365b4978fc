"""`max_seq_len` evaluates the memory columns without sympy per length (`seqlen_model._at_b`): the same whole
bytes as the expressions themselves, at every B and S, and sympy's own evaluation for other forms."""
from __future__ import annotations

import math
import random

import sympy

from rpcompile.ir.hardware import Hardware
from rpcompile.passes.cost.seqlen_model import SeqLenModel, _at_b, _Polys
from rpcompile.passes.cost.polyfit import Fitter
from rpcompile.passes.cost.symbolic import B, S, SymbolicCosts, _points


def exact(e, b: int, s: int) -> int:
    """The expression at (b, s) in exact rationals, rounded towards zero (as the columns' int())."""
    v = sympy.sympify(e).subs({B: b, S: s})
    return int(v)


def random_poly(rng: random.Random):
    """A polynomial on 1, S, S^2, B, BS, BS^2 with rational (sometimes negative) coefficients."""
    monos = [sympy.Integer(1), S, S ** 2, B, B * S, B * S ** 2]
    return sum(sympy.Rational(rng.randint(-500, 5000), rng.choice([1, 1, 2, 3, 8])) * m
               for m in monos if rng.random() < 0.7)


def test_polynomials_and_their_max_give_the_exact_whole_bytes_at_every_b_and_s():
    rng = random.Random(3)
    for _ in range(80):
        k = rng.choice([1, 1, 2, 3])
        polys = [random_poly(rng) for _ in range(k)]
        e = polys[0] if k == 1 else sympy.Max(*polys, evaluate=False)
        for b in (1, 3):
            fn = _at_b(e, b)
            assert isinstance(fn, _Polys)
            for s in (1, 7, 74_753, 1 << 24):
                assert fn(s) == exact(e, b, s), (e, b, s)


def test_constants_and_plain_integers_are_columns_too():
    for e in (0, 12345, sympy.Integer(7), sympy.Rational(7, 2)):
        assert _at_b(e, 3)(100) == int(sympy.sympify(e))


def test_another_form_falls_back_to_sympy():
    e = sympy.sqrt(S) * 1000 + B
    fn = _at_b(e, 2)
    assert not isinstance(fn, _Polys)
    assert fn(10_000) == int(math.sqrt(10_000) * 1000 + 2)
    cubic = S ** 3 + B * S
    assert _at_b(cubic, 2)(100) == 100 ** 3 + 200
    for other in (sympy.Float(0.5) * S + 3, sympy.Max(S ** 3, B * S, evaluate=False), sympy.sqrt(B) * S):
        fn = _at_b(other, 3)  # a float coefficient, a Max with a cubic, a root of B: each falls back
        assert not isinstance(fn, _Polys) and fn(1001) == int(other.subs({B: 3, S: 1001})), other
    assert not isinstance(_at_b(sympy.Symbol("X") * S, 3), _Polys)  # another symbol is not a column's
    assert _at_b(B ** 2 * S + 7, 3)(10) == 97  # any power of B is a number once B is fixed


def test_the_search_builds_each_lengths_memory_columns_once_and_each_length_gets_its_own():
    cols = dict(param_bytes=(100, 200, 300), grad_bytes=(0, 0, 300), act_bytes=(B * S, 2 * B * S, 4 * B),
                saved_bytes=(B * S, B * S, 3 * B * S), peak_bytes=(B * S ** 2, B * S * 5, 7 * B * S))
    zero = (sympy.Integer(0),) * 3
    sc = SymbolicCosts(names=("a", "b", "c"), fwd=zero, bwd=zero, fwd_flops=zero, bwd_flops=zero, param_numel=0,
                       hardware=Hardware.preset("rtx4090"), **cols)
    model = SeqLenModel(sc, 2, gpus=2, microbatches=2)
    first = model.table(10)
    assert model.table(10) is first  # built once
    for s in (10, 11, 1000):  # every length its own columns, whatever was asked before
        t = model.table(s)
        for f, exprs in cols.items():
            assert list(getattr(t, f)) == [exact(e, 2, s) for e in exprs], (s, f)


def test_a_fit_gives_the_exact_coefficients_and_refuses_a_check_value_off_the_polynomial():
    rng = random.Random(5)
    for s0, unit in ((2048, None), (300, 64), (None, None)):
        pts, check = _points(s0, unit)
        fitter = Fitter(pts, check, s0 is not None)
        for _ in range(20):
            e = random_poly(rng) * 8 * 3 if s0 is not None else sympy.Integer(rng.randint(0, 99)) + 7 * B
            at = [int(e.subs({B: b, S: s})) for b, s in [*pts, check]]
            assert fitter.fit(at[:-1], at[-1]) == sympy.expand(e)
            coef = fitter.coefficients(at[:-1], at[-1])
            assert fitter.numerators(at[:-1], at[-1]) == tuple(c * fitter.den for c in coef)
            assert fitter.fit(at[:-1], at[-1] + 1) is None  # only the check shape tells this from a polynomial
            assert fitter.fit([at[0] + 1, *at[1:-1]], at[-1]) is None


def test_sympy_is_imported_on_first_symbolic_use_not_by_import_rpcompile():
    """`import rpcompile` leaves sympy unimported (0.2 s of every command that does not count symbolically);
    B and S, and a fit's polynomials, import it when first used."""
    import subprocess
    import sys
    code = ("import sys, rpcompile\nprint('sympy' in sys.modules)\n"
            "from rpcompile.passes.cost.symbolic import B, S\nprint('sympy' in sys.modules, B * S)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "B*S"]
