"""Costs as exact formulas in the microbatch size B and sequence length S, and `max_seq_len`.

`symbolic_costs` counts every layer (predict mode, on `meta`) at six (B, S)
shapes, fits each op's FLOPs, bytes and kernel launches and each memory column
EXACTLY (rational arithmetic) on the monomials 1, S, S^2, B, B*S, B*S^2, and
checks the fit on a seventh shape (at one microbatch size, `batch=`, as `max_seq_len` asks: three lengths fit
1, S, S^2 and a fourth checks them). The same pricing rules as predict mode
apply (`cost.py` Note: SDPA as one flash op, elementwise ops one kernel each,
a chunk loop one op per position). Times are sums of per-op rooflines,
`Max(flops/(peak*eff), bytes/bw)`; `peak_bytes` is the Max over the live bytes
after each op (each fitted exactly; dominated ones dropped), so it stays right
when the op that peaks changes with S. `SymbolicCosts.at(B, S)` reproduces
`estimate_costs(mode="predict")` at any shape (chunked heads: at token counts
that are multiples of the chunk; between them the last partial chunk's
launches and weight reads are interpolated). `max_seq_len` (`seqlen.py`)
solves the memory constraints for the largest S.

    >>> import torch; from transformers import LlamaConfig, LlamaForCausalLM
    >>> _ = torch.manual_seed(0)
    >>> llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=128, attn_implementation="eager"))
    >>> from rpcompile.passes import trace, estimate_costs
    >>> from rpcompile.passes.cost.seqlen import max_seq_len
    >>> ids = torch.randint(0, 128, (2, 16)); batch = {"input_ids": ids, "labels": ids}
    >>> g, hw = trace(llama, batch), Hardware.preset("rtx4090")
    >>> sc = estimate_costs(g, batch, mode="predict", hardware=hw, symbolic=True)  # tiny Llama, hidden 32
    >>> sc.fwd_flops[1]   # layer 1, model.layers.0: eager attention's S x S scores, the linear layers
    128*B*S**2 + 18432*B*S
    >>> max_seq_len(sc, hw, gpus=8).length   # bound by model.layers.0's backward workspace on a 24 GB card
    21188
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from tabulate import tabulate

from rpcompile.ir.costs import CostTable
from rpcompile.ir.graph import LayerGraph
from rpcompile.ir.hardware import Hardware
from rpcompile.passes.shard_head.chunked import chunked_lse
from rpcompile.passes.shard_head.fused import fused_ce
from rpcompile.passes.cost.count import LayerCount, count_layers
from rpcompile.passes.cost.recorder import OpCount, op_rate, priced
from rpcompile.passes.cost.host_bytes import host_bytes
from rpcompile.passes.cost.polyfit import Fitter, _sympy, symbols

if TYPE_CHECKING:  # annotations only: sympy is imported on first use
    import sympy

__all__ = ["SymbolicCosts", "symbolic_costs", "B", "S"]  # max_seq_len, which solves them: seqlen.py


def __getattr__(name: str) -> Any:
    """`B` and `S` as module attributes (`symbols()`), made on first use (PEP 562)."""
    if name in ("B", "S"):
        return symbols()["BS".index(name)]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
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
    # host bytes of the parameter state by category (`passes.cost.host_bytes.host_bytes`, AdamW, own dtypes)
    host_state: tuple[tuple[str, int], ...] = ()
    batch: int | None = None  # fitted at this microbatch size only (`symbolic_costs(batch=)`: in S alone); None: any B

    def at(self, B: int, S: int = 1) -> CostTable:
        """The CostTable at a concrete microbatch size and sequence length.

        >>> import torch; from transformers import LlamaConfig, LlamaForCausalLM
        >>> _ = torch.manual_seed(0)
        >>> llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=128, attn_implementation="eager"))
        >>> from rpcompile.passes import trace, estimate_costs
        >>> ids = torch.randint(0, 128, (2, 16)); batch = {"input_ids": ids, "labels": ids}
        >>> sc = estimate_costs(trace(llama, batch), batch, mode="predict", hardware=Hardware.preset("rtx4090"),
        ...                     symbolic=True)
        >>> sc.fwd_flops[1]
        128*B*S**2 + 18432*B*S
        >>> sc.at(B=2, S=100).fwd_flops[1]   # 128 * 2 * 100**2 + 18432 * 2 * 100
        6246400.0
        """
        if self.batch is not None and B != self.batch:
            raise ValueError(f"SymbolicCosts.at: these costs were fitted at B = {self.batch} only "
                             f"(symbolic_costs(batch=)), not at B = {B}")
        sympy = _sympy()
        env = dict(zip(symbols(), (B, S)))

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


def _points(s0: int | None, unit: int | None = None,
            batch: int | None = None) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Six fitting shapes (B in {2, 3} x three S) and one check shape; at one microbatch size `batch`, three
    fitting shapes (that B x the three S) and one check shape.

    Note: B = 1 and S = 1 are avoided; there some copies (`contiguous` of a size-1 dim) vanish.
    With a chunked LM head (`unit` = its chunk), S is a multiple of the chunk, so every
    chunk is full and a chunk loop's sums are exact polynomials: S in {1, 2, 3} x unit, check
    4 x unit (a unit of 1 token, or one microbatch size of 1: {2, 3, 4}, check 5). The head runs B x S / unit
    chunks at each shape, which is most of the counting, so the multiples are the smallest that fit exactly.
    At one B (1 included) every shape has that B, so what vanishes at B = 1 vanishes at each of them: the
    fit is exact at that B (and only there), with 4 counts instead of 7.
    """
    if s0 is None:
        return [(2, 1), (3, 1)], (4, 1)
    if unit:  # at least two chunks at every shape: at B = 1 one chunk of S = unit runs no loop
        ks = (1, 2, 3) if unit > 1 and (batch is None or batch > 1) else (2, 3, 4)
        seqs, check = [k * unit for k in ks], (ks[-1] + 1) * unit
    else:
        seqs = sorted({max(2, math.ceil(s0 / 2)), max(2, math.ceil(3 * s0 / 4)), s0})
        check = max(2, round(5 * s0 / 8))
        if len(seqs) < 3 or check in seqs:
            seqs, check = [s0, s0 + 1, s0 + 2], s0 + 3
    if batch is not None:
        return [(batch, s) for s in seqs], (batch, check)
    return [(b, s) for b in (2, 3) for s in seqs], (4, check)


def chunk_unit(graph: LayerGraph) -> int | None:
    """The chunk of the graph's chunked LM head (lcm over its shards; x K for K token shards), None without one."""
    unit = None
    for layer in graph.layers:
        for n in layer.module.graph.nodes:
            c = None
            if n.op == "call_function" and n.target is chunked_lse:
                c = int(n.args[5])
            elif n.op == "call_function" and n.target is fused_ce:  # token shards: every shard whole chunks
                c = int(n.args[6]) * int(n.args[5][1])
            if c is not None:
                unit = c if unit is None else unit * c // math.gcd(unit, c)
    return unit


def _time_expr(fitter: Fitter, per_shape: list[Sequence], hw: Hardware, where: str,
               fp16_accumulation: bool = False) -> sympy.Expr:
    """Memory-bound ops' bytes / bw + launches * op_latency + sum of Max(flops/(peak*eff), bytes/bw) of FLOP ops."""
    per_shape = [[_at_rate(o, fp16_accumulation) for o in priced(ops, hw)] for ops in per_shape]
    flop_ops = [[o for o in ops if o.flops] for ops in per_shape]
    if any([o.name for o in ops] != [o.name for o in flop_ops[0]] for ops in flop_ops):
        raise ValueError(f"{where}: the FLOP-counted ops change with the shape; cannot fit it symbolically")
    mem = fitter.fit([sum(o.bytes for o in ops if not o.flops) for ops in per_shape[:-1]],
                     sum(o.bytes for o in per_shape[-1] if not o.flops))
    launches = fitter.fit([sum(o.launches for o in ops) for ops in per_shape[:-1]],
                          sum(o.launches for o in per_shape[-1]))
    if launches is None or mem is None:
        raise ValueError(f"{where}: the memory-bound ops change with the shape; cannot fit it symbolically")
    groups: dict[tuple, int] = {}
    for k, op in enumerate(flop_ops[0]):
        col = [ops[k] for ops in flop_ops]
        fl = fitter.fit([o.flops for o in col[:-1]], col[-1].flops)
        by = fitter.fit([o.bytes for o in col[:-1]], col[-1].bytes)
        if fl is None or by is None:
            raise ValueError(f"{where}: op {op.name} is not polynomial in B, S of degree <= (1, 2)")
        groups[(fl, by, op.dtype)] = groups.get((fl, by, op.dtype), 0) + 1
    sympy = _sympy()
    bw = sympy.Float(hw.mem_bandwidth)
    expr = mem / bw + launches * sympy.Float(hw.op_latency)
    for (fl, by, dt), n in groups.items():
        expr += n * _max(fl / sympy.Float(hw.flops(dt) * hw.efficiency), by / bw)
    return expr


def _at_rate(op: OpCount, fp16_accumulation: bool) -> OpCount:
    """`op` with the rate it is priced at as its dtype (`recorder.op_rate`; the op itself where that is its own)."""
    rate = op_rate(op, fp16_accumulation)
    return op if rate == op.dtype else replace(op, dtype=rate)


def _flops_expr(fitter: Fitter, per_shape: list[Sequence]) -> sympy.Expr | None:
    """One phase's FLOPs (a fused region counted once) fitted over the shapes; None if not polynomial."""
    tot = [sum(o.flops for o in ops if o.form != "fused") for ops in per_shape]
    return fitter.fit(tot[:-1], tot[-1])


def _max(*args: sympy.Expr) -> sympy.Expr:
    """`sympy.Max` of polynomials without sympy's search for arguments it can prove smaller.

    That search (`Max._find_localzeros`, asking the assumptions whether a - b >= 0 for every pair)
    took most of `symbolic_costs`' time outside counting. The callers keep only arguments that no
    other one dominates coefficient-wise; one argument is itself, and equal ones are merged.
    """
    args = tuple(dict.fromkeys(args))
    return args[0] if len(args) == 1 else _sympy().Max(*args, evaluate=False)


def _peak_expr(fitter: Fitter, lives: list[tuple[int, ...]], where: str) -> sympy.Expr:
    """Max over the exactly fitted live bytes after each op, coefficient-wise dominated ones dropped."""
    if len({len(live) for live in lives}) != 1:
        raise ValueError(f"{where}: the ops change with the shape; cannot fit its peak memory symbolically")
    polys: set[tuple[int, ...]] = set()  # numerators over `fitter.den` (> 0): they order as the coefficients
    for k, col in enumerate(dict.fromkeys(zip(*lives))):
        coef = fitter.numerators(col[:-1], col[-1])
        if coef is None:
            raise ValueError(f"{where}: the live bytes after op {k} are not polynomial in B, S of degree <= (1, 2)")
        polys.add(coef)
    keep: list[tuple[int, ...]] = []
    for p in sorted(polys, key=lambda c: -sum(c)):  # a dominating polynomial has the larger coefficient sum
        if not any(all(a >= b for a, b in zip(q, p)) for q in keep):
            keep.append(p)
    return _max(*(fitter.expr(p) for p in keep)) if keep else _sympy().Integer(0)


def symbolic_costs(graph: LayerGraph, inputs: dict[str, torch.Tensor], hardware: Hardware, *,
                   make_inputs: Callable[[int, int], dict] | None = None, progress: bool = False,
                   fp16_accumulation: bool = False, optimizer: Any = None,
                   shard: tuple[int, int] | None = None, batch: int | None = None) -> SymbolicCosts:
    """Fit every layer's predicted costs as exact expressions in B and S (or in S alone, at one B).

    Args:
        graph: the traced model (weights may be on `meta`).
        inputs: one microbatch's named inputs; its shapes pick the fitting points (near its S).
        hardware: prices the ops (times are Max-sums of rooflines).
        make_inputs: optional (B, S) -> named inputs; default tiles/crops `inputs`.
        fp16_accumulation: fp16 GEMMs priced at the fp16-accumulate rate (`recorder.op_rate`).
        optimizer: the run's `rpcompile.AdamW` / `SGD` (default AdamW()): its state and master dtypes set the
            parameter state's bytes (`host_state`, `passes.cost.host_bytes.host_bytes`).
        shard: (rank, world) with the masters and moments sharded over `world` data-parallel servers: the
            parameter state is what server `rank` holds (`host_bytes(shard=)`); None: the whole state.
        batch: fit at this microbatch size only (4 counts of the model instead of 7; exact at that B, 1
            included): the expressions are in S alone and `.at` takes that B only. None: in B and S.
    Returns:
        A SymbolicCosts; `.at(B, S)` equals predict mode at that shape (FLOPs/bytes exactly).
    Raises:
        ValueError: a quantity is not polynomial of the assumed form (names layer and op).
    """
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ValueError(f"symbolic_costs: batch must be a positive integer or None, got {batch!r}")
    s0 = _seq_len(graph, inputs)
    batch = batch if s0 is not None else None  # without a sequence the fit is in B alone
    pts, check = _points(s0, chunk_unit(graph) if s0 is not None else None, batch)
    fitter = Fitter(pts, check, s0 is not None, with_b=batch is None)
    make = make_inputs or (lambda b, s: resize_inputs(graph, inputs, b, s if s0 is not None else None))
    codes: dict[int, tuple] = {}  # the layers' code and parameters, the same at every shape
    runs: list[list[LayerCount]] = [count_layers(graph, make(b, s), progress=progress, codes=codes)
                                    for b, s in [*pts, check]]
    cols: dict[str, list] = {k: [] for k in ("fwd", "bwd", "fwd_flops", "bwd_flops", *_MEMORY)}
    # layers counted once (`count_layers`: identical up to module indices) share their op and live tuples:
    # their expressions are built once, keyed by those tuples' identities (all alive in `runs`)
    built: dict[tuple, sympy.Expr] = {}

    def once(key: tuple, make: Callable[[], sympy.Expr]) -> sympy.Expr:
        if key not in built:
            built[key] = make()
        return built[key]

    for i, layer in enumerate(graph.layers):
        where = f"layer {i} ({layer.name})"
        per = [run[i] for run in runs]
        for k in _MEMORY:
            if k == "peak_bytes":
                lives = [c.live for c in per]
                cols[k].append(once(("peak", *map(id, lives)), lambda: _peak_expr(fitter, lives, where)))
                continue
            e = fitter.fit([getattr(c, k) for c in per[:-1]], getattr(per[-1], k))
            if e is None:
                raise ValueError(f"{where}: {k} is not polynomial in B, S of degree <= (1, 2)")
            cols[k].append(e)
        for ph in ("fwd", "bwd"):
            ops = [getattr(c, f"{ph}_ops") for c in per]
            cols[ph].append(once((ph, *map(id, ops)),
                                 lambda: _time_expr(fitter, ops, hardware, f"{where} {ph}", fp16_accumulation)))
            cols[f"{ph}_flops"].append(once((f"{ph}_flops", *map(id, ops)), lambda: _flops_expr(fitter, ops)))
    state = host_bytes(graph, microbatches=1, optimizer=optimizer, shard=shard)
    share = f" (1 of {state.servers} shares)" if state.servers > 1 else ""
    numel = sum(v.bytes // max(v.dtype.itemsize, 1) for v in graph.params.values())
    master = _SHORT.get(getattr(optimizer, "master_dtype", torch.float32), "fp32")
    grad = _SHORT.get(getattr(optimizer, "grad_dtype", torch.float32), "fp32")
    return SymbolicCosts(names=tuple(layer.name for layer in graph.layers), **{k: tuple(v) for k, v in cols.items()},
                         param_numel=numel, hardware=hardware, batch=batch,
                         host_state=(("compute copies", state.weights), (f"{master} masters{share}", state.masters),
                                     (f"{grad} gradients", state.grads), (f"optimizer state{share}", state.optimizer),
                                     (f"{state.undo_name} (staleness 1)", state.undo)))


_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}  # a state dtype, as printed


def _default_inputs(graph: LayerGraph) -> dict[str, torch.Tensor]:
    """Zero tensors shaped like the traced example's inputs."""
    return {n: torch.zeros(graph.values[n].shape, dtype=graph.values[n].dtype) for n in graph.inputs}

