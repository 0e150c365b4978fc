"""The constraint model `max_seq_len` searches (`seqlen.py`): device and host bytes of a plan at any length S.

Note:
    Two constraints, every byte count from `SymbolicCosts` at microbatch size
    B (sequences per microbatch) and length S:

    device: RoundPipe keeps activations on the host, so S is bounded by the
      largest stage a worker must hold. At the longest S the planner can only
      use one-layer windows around the layer that binds (a wider window adds
      that layer's neighbours to the same worker), so the bound is
      `StagePlan.stage_memory` (the partitioner's own rule) of the plan with one
      layer per forward and backward stage, with the prefetched next stage
      bounded by the largest other stage's parameters. That makes it
      independent of the GPU count. A stage's bytes are its parameters, the
      prefetched ones, gradients of trainable parameters, the workspace
      (`peak_bytes`: saved tensors plus backward transients, the live bytes
      counted op by op) and the inputs, outputs and gradients in flight.

    host (an estimate: compile's admission counts the arena of the plan it
      picks, `runtime.host.assign`; `bench/seq_limit.py` compares the two): the
      parameter state plus the saved stage inputs of the microbatches in
      flight, with the backward stages as wide as the device allows at that
      length (`passes.partition.host_lean.widest_backward`, grown greedily
      from the last layer: each backward stage keeps one saved input per
      microbatch, so these are about the fewest host bytes). Compile takes
      such a plan where the partitioner's, which chooses for time, is over the
      host (`host_lean`). Where those bytes are over the host, the
      partitioner's own plan at that length (`passes.partition` on these
      costs, staleness 1) is priced too and the fewer bytes count: the greedy
      growth is not always the widest (it widens each window from the top down
      as far as it goes, which can leave narrow ones below, and where its plan
      fails the exact check it falls back to one layer per stage). qwen3-1.7b
      in sub-blocks on 8x rtx4090 at 130,316 tokens: 85 greedy backward
      stages, 61 in the partitioner's plan; the limit is 133,738 tokens,
      admission's boundary, against 130,157 from the greedy windows alone.
      Parameter state: `passes.cost.host_bytes.host_bytes` by category: every
      parameter's compute copy at its own dtype; a trainable one adds an fp32
      master, an fp32 gradient and two fp32 AdamW moments (16 B); a frozen one
      nothing more; with the masters and moments sharded over servers (`shard=`),
      one server's share of them. In flight (`round_saved_bytes`, what `host_bytes` counts for a
      plan without its program):
      iterations run in rounds of R microbatches (`default_round_size(gpus,
      M)`); a round's saved inputs live from its forward to its backward, so at
      most R microbatches hold every backward stage's input. The rotation has no drain: the next
      round (with staleness 1 also the next iteration's first round) starts
      forward on a worker as soon as it is free, i.e. while the previous
      round's last N - 1 backward slots (the lowest layers) still wait for
      their saved inputs, which therefore count once more.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from rpcompile.ir.costs import CostTable
from rpcompile.ir.plan import StagePlan
from rpcompile.passes.cost.host_bytes import round_saved_bytes
from rpcompile.passes.cost.stage_memory import _COLUMNS, _gib, stage_terms
from rpcompile.passes.cost.symbolic import SymbolicCosts, _sympy, symbols
from rpcompile.passes.partition import partition
from rpcompile.passes.partition.host_lean import widest_backward

__all__ = ["SeqLenLimit", "SeqLenModel"]


@dataclass(frozen=True, slots=True)
class SeqLenLimit:
    """The longest trainable sequence and what stops a longer one.

    Example:
        >>> lim = max_seq_len(graph, Hardware.preset("rtx4090"), gpus=8)   # doctest: +SKIP
        >>> lim.length, lim.binding                                        # doctest: +SKIP
        (74752, "device: backward stage of layer 3 'model.layers.2', workspace (...)")
    """

    length: int  # the longest S that fits (0: not even S = 1)
    binding: str  # the constraint the next length breaks, and its largest term
    bytes: int  # that constraint's bytes at length + 1
    capacity: int  # the bytes it must fit in (the device budget or the host memory)
    terms: tuple[tuple[str, int], ...] = ()  # its bytes by term at length + 1, largest first

    def __str__(self) -> str:
        if not self.terms:
            return f"{self.length:,} tokens ({self.binding})"
        parts = ", ".join(f"{name} {_gib(n)}" for name, n in self.terms if n)
        return (f"{self.length:,} tokens; at {self.length + 1:,} the {self.binding} needs {_gib(self.bytes)} "
                f"> {_gib(self.capacity)} ({parts})")


class _Polys:
    """A memory column's expression at a fixed B, as a function of S: the max of polynomials in S, exactly.

    Integer coefficients over a common denominator, evaluated in integers and rounded towards zero; nothing of sympy
    runs per length (`sympy.lambdify` and `subs` took most of `max_seq_len`'s time outside counting).
    """

    def __init__(self, polys: list[tuple[int, int, int]], den: int):
        self.polys, self.den = polys, den  # (c0, c1, c2) of c0 + c1 S + c2 S^2, all over den

    def __call__(self, s: int) -> int:
        top = max(c0 + s * (c1 + s * c2) for c0, c1, c2 in self.polys)
        return top // self.den if top >= 0 else -(-top // self.den)  # towards zero, as int()


def _at_b(e: Any, b: int) -> Any:
    """`e` (a column's sympy expression in B and S: a polynomial or a Max of polynomials) at B = b, as a
    function of S giving whole bytes: `_Polys`, or sympy's lambdify for any other form."""
    sympy, (B, S) = _sympy(), symbols()
    e = sympy.sympify(e)
    terms = e.args if isinstance(e, sympy.Max) else (e,)
    polys = []
    for t in terms:
        coef = [Fraction(0)] * 3
        for mono, c in t.as_coefficients_dict().items():
            powers = dict(mono.as_powers_dict())
            eb, es = powers.pop(B, 0), powers.pop(S, 0)
            powers.pop(sympy.Integer(1), None)
            if not (c.is_Rational and not powers and es in (0, 1, 2) and sympy.sympify(eb).is_Integer and eb >= 0):
                fn = sympy.lambdify(S, e.subs(B, b), "math")  # not rational x B^i x S^(0, 1 or 2)
                return lambda s: int(fn(s))
            coef[es] += Fraction(int(c.p), int(c.q)) * b ** int(eb)
        polys.append(coef)
    den = math.lcm(*(c.denominator for p in polys for c in p))
    return _Polys([tuple(int(c * den) for c in p) for p in polys], den)


class SeqLenModel:
    """The two constraints of the module Note, evaluated at any S."""

    def __init__(self, sc: SymbolicCosts, b: int, gpus: int, microbatches: int) -> None:
        if sc.batch is not None and b != sc.batch:
            raise ValueError(f"max_seq_len: microbatch_size={b}, but these SymbolicCosts were fitted at "
                             f"microbatch size {sc.batch} only (seq_len_costs(batch=)); fit them without batch=")
        self.sc, self.b, self.gpus, self.microbatches, n = sc, b, gpus, microbatches, len(sc.names)
        fns: dict[Any, Any] = {}  # one function per distinct expression (repeated blocks share theirs)
        for _, f in _COLUMNS:
            for e in getattr(sc, f):
                if e not in fns:
                    fns[e] = _at_b(e, b)
        self.cols = {f: [fns[e] for e in getattr(sc, f)] for _, f in _COLUMNS}
        self.plan = StagePlan.from_sizes([1] * (n - 1), 1, [1] * (n - 1))
        self.host_state = dict(sc.host_state)
        self.tables: dict[int, CostTable] = {}  # length -> its memory columns (`table`)
        self.times: tuple[list, list] | None = None  # fwd and bwd seconds as functions of S (`partitioned`)
        self.plans: dict[tuple[int, int], StagePlan] = {}  # (length, device budget) -> `partitioned`

    def table(self, s: int) -> CostTable:
        """The memory columns at length s (built once per length: the search asks for each several times)."""
        if s not in self.tables:
            at: dict[Any, int] = {}

            def value(fn) -> int:  # each distinct function evaluated once at s
                if fn not in at:
                    at[fn] = fn(s)
                return at[fn]

            n = len(self.sc.names)
            cols = {f: [value(fn) for fn in fns] for f, fns in self.cols.items()}
            self.tables[s] = CostTable.from_lists(fwd=[0.0] * n, bwd=[0.0] * n, names=self.sc.names, **cols)
        return self.tables[s]

    def device(self, s: int) -> tuple[int, int]:
        """(bytes of the largest stage, its index) at length s."""
        need = self.plan.stage_memory(self.table(s))
        i = max(range(len(need)), key=need.__getitem__)
        return need[i], i

    def windows(self, s: int, cap: int) -> StagePlan:
        """The plan with the widest backward stages that fit `cap` at length s (fewest saved inputs on the host).

        Backward stages are grown greedily from the last layer down with `StagePlan.stage_memory`'s
        backward-stage terms (prefetch bounded by the largest layer's parameters: `widest_backward`, as
        compile's `host_lean` fallback grows them); the resulting plan is checked with `stage_memory`
        itself, falling back to one layer per stage if it does not fit.
        """
        t, n = self.table(s), len(self.sc.names)
        sizes = widest_backward(t, cap, n - 1, max(t.param_bytes))
        plan = StagePlan.from_sizes([1] * (n - 1), 1, sizes)
        return plan if max(plan.stage_memory(t)) <= cap else self.plan

    def partitioned(self, s: int, cap: int) -> StagePlan:
        """The partitioner's plan at length s (staleness 1, the default round size), priced by these costs, or
        one layer per stage if it finds none."""
        if self.times is None:  # float functions of S, one per distinct expression, made on first use
            sympy, (B, S) = _sympy(), symbols()
            fns: dict[Any, Any] = {}
            for e in (*self.sc.fwd, *self.sc.bwd):
                if e not in fns:
                    fns[e] = sympy.lambdify(S, sympy.sympify(e).subs(B, self.b), "math")
            self.times = ([fns[e] for e in self.sc.fwd], [fns[e] for e in self.sc.bwd])
        if (s, cap) not in self.plans:
            fwd, bwd = ([float(fn(s)) for fn in fns] for fns in self.times)
            t = replace(self.table(s), fwd=tuple(fwd), bwd=tuple(bwd))
            try:
                plan = partition(t, gpus=self.gpus, microbatches=self.microbatches, memory_budget=cap, staleness=1)
            except ValueError:  # no plan fits the device: the one-layer plan's own device check decides
                plan = self.plan
            self.plans[(s, cap)] = plan
        return self.plans[(s, cap)]

    def holds(self, plan: StagePlan, s: int, device_cap: int, host_cap: int) -> bool:
        """Whether `plan` itself still fits at length s: its stages the device (the partitioner's rule: the
        stage prefetched is the one N slots later), its saved inputs the host."""
        t = self.table(s)
        acts, _ = round_saved_bytes(list(t.saved_bytes), plan, self.gpus, self.microbatches)
        device = max(plan.stage_memory(t, gpus=self.gpus))
        return device <= device_cap and sum(self.host_state.values()) + acts <= host_cap

    def host(self, s: int, cap: int, host_cap: int | None = None) -> tuple[int, str]:
        """(host bytes at length s with the widest backward stages that fit `cap`, what the activations are).

        With `host_cap`, where those bytes are over it, the partitioner's plan is priced too and the fewer
        bytes of the two count: the greedy windows are not always the widest (past lengths where two
        layers stop fitting a worker here and there, the partitioner keeps wider stages elsewhere).
        """
        saved, state = list(self.table(s).saved_bytes), sum(self.host_state.values())
        plan = self.windows(s, cap)
        acts, r = round_saved_bytes(saved, plan, self.gpus, self.microbatches)
        if host_cap is not None and state + acts > host_cap:
            other = self.partitioned(s, cap)
            fewer, _ = round_saved_bytes(saved, other, self.gpus, self.microbatches)
            if fewer < acts:
                plan, acts = other, fewer
        return state + acts, (f"saved inputs of {len(plan.bwd)} backward stages x {r} microbatches per round (+ the "
                              f"last round's tail)")

    def explain(self, s: int, device_cap: int, host_cap: int, partitioned: bool = False) -> SeqLenLimit | None:
        """The first constraint that length s breaks, with its terms; None if it fits (`partitioned`: the host
        term also prices the partitioner's plan, `host`)."""
        need, i = self.device(s)
        if need > device_cap:
            where, terms = stage_terms(self.table(s), self.plan, i)
            return SeqLenLimit(s - 1, f"device: {where}, {terms[0][0]}", need, device_cap, tuple(terms))
        host, what = self.host(s, device_cap, host_cap if partitioned else None)
        if host > host_cap:
            acts = host - sum(self.host_state.values())
            terms = sorted([*self.host_state.items(), (what, acts)], key=lambda t: -t[1])
            return SeqLenLimit(s - 1, f"host: {terms[0][0]}", host, host_cap, tuple(terms))
        return None
