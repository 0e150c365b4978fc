"""Recognising the LM head in the last layer: `linear -> [casts, view, scale] -> cross_entropy`.

`_match` finds the head matmul (an nn.Linear, `F.linear`, `x @ W.t()` or `x @ W` on a Parameter), the
ops allowed between it and the loss, the cross_entropy call and its options, and sorts the layer's other
nodes into the prologue (before the loss) and the epilogue (after it); `_Head` is what it found. The
pass (`shard_head/__init__.py`, its Note) rewrites the layer from it.
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from rpcompile.ir.graph import Layer

_CASTS = frozenset({"float", "to", "contiguous", "half", "bfloat16", "double"})
_VIEWS = frozenset({"view", "reshape"})
_SCALES = frozenset({operator.mul, operator.truediv, torch.mul, torch.div, "mul", "div", "__mul__", "__truediv__"})
_MATMULS = frozenset({operator.matmul, torch.matmul, "matmul", "__matmul__"})
_TRANSPOSES = frozenset({"t", torch.t, "transpose", torch.transpose})
_CE_SIG = inspect.signature(F.cross_entropy)


@dataclass(frozen=True, slots=True)
class _Head:
    """What `_match` found in the last layer's fx graph."""

    x: fx.Node  # the hidden input of the head matmul
    weight: str  # qualified name of W in the layer module (canonical)
    bias: str | None  # qualified name of b, if any
    dim: int  # vocabulary dim of W (0: linear / x @ W.t(); 1: x @ W)
    vocab: int  # V
    chain: tuple[fx.Node, ...]  # ops from the logits to the cross_entropy input, in order
    logits: fx.Node  # the cross_entropy input
    ce: fx.Node  # the cross_entropy call
    target: fx.Node  # its target argument
    ignore_index: int  # cross_entropy ignore_index
    reduction: str  # "mean" | "sum" | "none"
    internal: frozenset[fx.Node]  # head matmul, W/b reads and transposes, chain, cross_entropy
    side: frozenset[fx.Node]  # metadata reads of the logits (size(-1), .device)
    prologue: tuple[fx.Node, ...]  # other nodes before the loss, graph order
    epilogue: tuple[fx.Node, ...]  # nodes after cross_entropy, graph order


def _fmt(n: fx.Node) -> str:
    """Short description of a node for messages."""
    return f"{n.op} {n.target if isinstance(n.target, str) else getattr(n.target, '__name__', n.target)!r} ({n.name})"


def _match(layer: Layer) -> _Head:
    """Find linear -> [casts, view, scale] -> cross_entropy in the layer's graph (see the pass's Note, `__init__.py`)."""
    gm, where = layer.module, f"last layer {layer.name!r}"
    ces = [n for n in gm.graph.nodes if _is_ce(gm, n)]
    if len(ces) != 1:
        ops = sorted({_fmt(n).split(" (")[0] for n in gm.graph.nodes if n.op.startswith("call")})
        raise ValueError(f"shard_lm_head: {where} must call cross_entropy once, found {len(ces)}; its ops: "
                         f"{', '.join(ops)}")
    ce = ces[0]
    ce_in, target, ignore_index, reduction = _ce_args(gm, ce, where)
    chain, n = [], ce_in
    while (head := _head_matmul(gm, n)) is None:
        if not (isinstance(n, fx.Node) and _is_chain_op(n)):
            raise ValueError(f"shard_lm_head: in {where}, the cross_entropy input comes from "
                             f"{_fmt(n) if isinstance(n, fx.Node) else repr(n)}; supported between the head "
                             f"linear/matmul and cross_entropy: float/to/contiguous, view/reshape(..., V), "
                             f"multiplying or dividing by a constant")
        chain.insert(0, n)
        n = next(a for a in n.args if isinstance(a, fx.Node))  # args[0], or the node of `c * z`
    x, weight, bias, dim, reads = head
    internal = frozenset({n, *reads, *chain, ce})
    after: set[fx.Node] = set()
    for m in gm.graph.nodes:
        if m.op != "output" and (ce in m.all_input_nodes or after & set(m.all_input_nodes)):
            after.add(m)
    side = {u for m in [n, *chain] for u in m.users if u not in internal}
    bad = [u for u in side if not _is_meta_read(u) or any(v in after or v.op == "output" for v in u.users)]
    bad += [u for r in reads for u in r.users if u not in internal]
    if bad:
        raise ValueError(f"shard_lm_head: in {where}, the logits or the head weight are also used by "
                         f"{_fmt(bad[0])}; only cross_entropy and size(-1)/.device reads before the loss may")
    pro = tuple(m for m in gm.graph.nodes if m.op not in ("placeholder", "output")
                and m not in internal and m not in side and m not in after)
    epi = tuple(m for m in gm.graph.nodes if m in after)
    return _Head(x, weight, bias, dim, gm.get_parameter(weight).shape[dim], tuple(chain), ce_in, ce, target,
                 ignore_index, reduction, internal, frozenset(side), pro, epi)


def _is_ce(gm: fx.GraphModule, n: fx.Node) -> bool:
    """True for F.cross_entropy or an nn.CrossEntropyLoss call."""
    return n.op == "call_function" and n.target is F.cross_entropy or n.op == "call_module" and isinstance(
        gm.get_submodule(n.target), torch.nn.CrossEntropyLoss)


def _ce_args(gm: fx.GraphModule, ce: fx.Node, where: str) -> tuple[Any, Any, int, str]:
    """(input, target, ignore_index, reduction) of the cross_entropy call; rejects unsupported options."""
    bound = _CE_SIG.bind(*ce.args, **ce.kwargs)
    bound.apply_defaults()
    opts = dict(bound.arguments)
    if ce.op == "call_module":
        mod = gm.get_submodule(ce.target)
        opts.update({k: getattr(mod, k) for k in ("weight", "ignore_index", "reduction", "label_smoothing")})
    inp, target = opts["input"], opts["target"]
    if opts["weight"] is not None or opts["label_smoothing"] != 0.0 or opts["size_average"] is not None \
            or opts["reduce"] is not None or opts["reduction"] not in ("mean", "sum", "none") \
            or not isinstance(opts["ignore_index"], int) or not isinstance(target, fx.Node):
        raise ValueError(f"shard_lm_head: in {where}, unsupported cross_entropy options "
                         f"{ {k: v for k, v in opts.items() if k not in ('input', 'target')} }; supported: "
                         f"no class weights, no label smoothing, reduction mean/sum/none")
    return inp, target, opts["ignore_index"], opts["reduction"]


def _head_matmul(gm: fx.GraphModule, n: Any) -> tuple[fx.Node, str, str | None, int, tuple[fx.Node, ...]] | None:
    """(x, weight name, bias name, vocab dim, weight-read nodes) if `n` is the head linear/matmul."""
    if not isinstance(n, fx.Node):
        pass
    elif n.op == "call_module" and isinstance(gm.get_submodule(n.target), torch.nn.Linear) and not n.kwargs:
        bias = f"{n.target}.bias" if gm.get_submodule(n.target).bias is not None else None
        return n.args[0], f"{n.target}.weight", bias, 0, ()
    elif n.op == "call_function" and n.target is F.linear:
        x, w, b = [*n.args, *(n.kwargs.get(key) for key in ("weight", "bias")[len(n.args) - 1:])][:3]
        if _is_param(gm, w) and (b is None or _is_param(gm, b)):
            return x, w.target, None if b is None else b.target, 0, tuple(a for a in (w, b) if a is not None)
    elif n.op != "call_module" and n.target in _MATMULS and len(n.args) == 2 and not n.kwargs:
        x, w = n.args
        if _is_param(gm, w):
            return x, w.target, None, 1, (w,)
        if isinstance(w, fx.Node) and _is_transpose(w) and _is_param(gm, w.args[0]):
            return x, w.args[0].target, None, 0, (w, w.args[0])
    return None


def _is_param(gm: fx.GraphModule, n: Any) -> bool:
    """True if `n` reads a Parameter of the module."""
    return isinstance(n, fx.Node) and n.op == "get_attr" and n.target in dict(gm.named_parameters())


def _is_transpose(n: fx.Node) -> bool:
    """True for w.t(), w.T or w.transpose of the two dims of a matrix."""
    return (n.op == "call_function" and n.target is getattr and n.args[1] == "T") or (
        n.op in ("call_method", "call_function") and n.target in _TRANSPOSES
        and (n.target in ("t", torch.t) or sorted(d % 2 for d in n.args[1:3]) == [0, 1]))


def _is_chain_op(n: fx.Node) -> bool:
    """True for the ops allowed between the head matmul and cross_entropy."""
    if n.op == "call_method" and n.target in _CASTS:
        return all(isinstance(a, torch.dtype) for a in n.args[1:]) and set(n.kwargs) <= {"dtype"}
    if n.op == "call_method" and n.target in _VIEWS or n.op == "call_function" and n.target is torch.reshape:
        dims = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)) else n.args[1:]
        return bool(dims) and all(isinstance(d, int) for d in dims[:-1]) and (
            isinstance(dims[-1], int) or _is_size_last(dims[-1]))
    if n.target in _SCALES and n.op in ("call_method", "call_function") and len(n.args) == 2 and not n.kwargs:
        a, b = n.args
        return isinstance(a, fx.Node) and isinstance(b, (int, float)) or (
            n.target in (operator.mul, torch.mul, "mul", "__mul__") and isinstance(b, fx.Node)
            and isinstance(a, (int, float)))
    return False


def _is_size_last(n: Any) -> bool:
    """True for `y.size(-1)`."""
    return isinstance(n, fx.Node) and n.op == "call_method" and n.target == "size" and n.args[1:] == (-1,)


def _is_meta_read(n: fx.Node) -> bool:
    """True for size(-1) and .device reads (the only allowed non-loss uses of the logits)."""
    return _is_size_last(n) or (n.op == "call_function" and n.target is getattr and n.args[1] == "device")
