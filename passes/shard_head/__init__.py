"""The `shard_lm_head` pass: the LM head + cross-entropy as K vocabulary shards (DESIGN.md idea 4).

The second pass of the pipeline (trace -> shard_lm_head -> estimate_costs -> partition -> emit -> verify).
This folder holds it and the helpers only it uses:

    chunked.py  the kernels of the shard layers: a vocabulary shard of the head + loss, in token chunks
    fused.py    the fused head's kernel: a token shard over the whole vocabulary that takes its gradients
                in its forward, chunk by chunk (`fused=True`)
    auto.py     the automatic choices: how many shards, how many tokens per chunk

Note:
    `x @ W^T (+ b)` -> [float / to / contiguous / view(-1, V) / constant scale] ->
    `cross_entropy` in the last layer becomes K shard layers and a loss layer.
    Shard k owns rows [lo, hi) of W (sizes differ by at most one) and folds its
    logits (tokens x V/K, its only vocabulary-sized tensor) into an online
    log-sum-exp: running max `m` (detached: the result does not depend on it),
    sum of exponentials `s`, target logit `t`. The loss layer reduces
    `m + log(s) - t` over non-ignored tokens as the call did (mean/sum/none), then
    runs what followed the call (HF `/ num_items_in_batch`). The old layer's glue
    (label shift; a norm in a coarse trace) runs in shard 0, which emits the
    `target` ids. Shard k < K-1 passes `x` on as a new value (a view): a value
    carrying a gradient still has exactly one consumer layer.

    Parameter slices: a shard module holds the whole Parameter under its canonical
    name (`named_parameters()` and `graph.run` stay exact, the gradient reaches the
    model's Parameter) and reads it via `vocab_slice`, which narrows a full tensor
    and passes one of the slice's size through. `Layer.param_slices` records
    `(name, dim, start, stop)`: a runtime uploads only that slice to
    `functional_call(module, {name: slice}, args)` and adds the gradient it gets
    into that slice of the full gradient.

    Fused (`fused=True`, `fused.py`): the K shards are token shards instead. Shard
    k takes tokens [T*k/K, T*(k+1)/K) over the whole vocabulary (the whole W,
    no `param_slices`), computes their NLL sum and, when autograd needs it, the
    gradients of that sum in the same chunk loop, and passes on `prev + sum`
    (a scalar); the loss layer divides by the trained-token count (mean) or not
    (sum). A head whose cross_entropy has reduction "none" cannot be fused.
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from rpcompile.ir.costs import CostTable
from rpcompile.ir.graph import Layer, LayerGraph, Value
from rpcompile.passes.shard_head.chunked import chunked_lse, lse_loss, lse_update, vocab_slice
from rpcompile.passes.shard_head.fused import fused_ce, fused_loss
from rpcompile.passes.shard_head.auto import auto_chunk, auto_shards

__all__ = ["shard_lm_head", "vocab_slice", "lse_update", "lse_loss"]

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


def shard_lm_head(graph: LayerGraph, shards: int | str = "auto", *, costs: CostTable | None = None,
                  chunk: int | str = "auto", memory_budget: int | None = None,
                  balance: str = "flops", fused: bool = False) -> LayerGraph:
    """Split the last layer's LM head + cross-entropy into `K` vocabulary shards (run in sequence chunks) and a loss layer.

    Args:
        graph: a traced causal LM whose last layer computes `linear -> cross_entropy`
            (HF LlamaForCausalLM / Qwen3 / GPT-2 `ForCausalLMLoss`, nanoGPT `F.linear(x, wte.weight)`).
        shards: K >= 1, or "auto": with `fused`, 1 (each token shard would repeat the whole weight, its
            gradient and their transfers; the round-robin dispatch absorbs one heavy layer); otherwise
            K = ceil(head fwd+bwd / median fwd+bwd of the other layers) in
            FLOPs from `costs` (or its times, `balance="time"`), else ceil(head param bytes / median
            param bytes of the other layers with parameters); clamped to [1, vocab]. Never from a
            measured time: K shapes the layer graph (`_head_auto`, Note).
        costs: the CostTable of `graph` (unsharded), used by the "auto"s.
        chunk: tokens per chunk of every shard (the logits that exist at once are chunk x ceil(V/K)),
            or "auto": from `memory_budget`, else from `costs` (`shard_head.auto.auto_chunk`), else no
            chunking. K = 1 with no chunk to apply (or one covering all tokens) returns `graph`
            itself; with shards="auto" a head that must be chunked gets at least 2 shards.
        memory_budget: device bytes per worker, for chunk="auto".
        balance: what shards="auto" balances: "flops" (default; the only choice for measured costs) or
            "time" (the costs' times: for predicted costs, a deterministic roofline of FLOPs and bytes).
        fused: cut the head into K token shards that take their gradients in their forward
            (`shard_head.fused`; module Note) instead of vocabulary shards; even K = 1 rewrites the head.
    Returns:
        A new LayerGraph (the input is unchanged): the head layer is replaced by K layers
        `<head>.shard{k}` (each `param_slices` one vocabulary slice of W and b) and `<head>.loss`,
        so the layer count grows by K. Its `run()` gives the same loss and gradients.
    Raises:
        ValueError: the last layer is not a supported `linear -> cross_entropy` (says what it found),
            bad `shards`, `chunk` or `balance`, or `costs` does not match the graph.

    Example:
        >>> import torch; from transformers import LlamaConfig, LlamaForCausalLM
        >>> _ = torch.manual_seed(0)
        >>> llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=128, attn_implementation="eager"))
        >>> from rpcompile.passes import trace
        >>> ids = torch.randint(0, 128, (2, 16)); batch = {"input_ids": ids, "labels": ids}
        >>> g = shard_lm_head(trace(llama, batch), shards=2, chunk=16)   # vocabulary 128: two shards of 64 rows
        >>> [layer.name for layer in g.layers][-3:]
        ['lm_head.shard0', 'lm_head.shard1', 'lm_head.loss']
        >>> g.layers[-3].param_slices
        (('lm_head.weight', 0, 0, 64),)
    """
    layer = graph.layers[-1]
    h = _match(layer)
    if shards == "auto":  # a fused head's token shards each repeat the whole weight and its gradient: one
        k = 1 if fused else auto_shards(graph, costs, h.vocab, balance)
    else:
        k = shards
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= h.vocab:
        raise ValueError(f"shards must be 'auto' or an int in [1, {h.vocab}] (the vocabulary), got {shards!r}")
    meta = _shapes(graph, layer)
    logits = meta[h.logits]
    if logits.dim() != 2 or any(meta[c].shape[-1] != h.vocab for c in h.chain):
        raise ValueError(f"shard_lm_head: in last layer {layer.name!r}, cross_entropy must read (tokens, {h.vocab}) "
                         f"logits with the vocabulary last throughout, got {tuple(logits.shape)}")
    tokens = logits.shape[0]
    if fused:
        if h.reduction == "none":
            raise ValueError(f"shard_lm_head: in last layer {layer.name!r}, cross_entropy has reduction 'none'; "
                             f"a fused head needs 'mean' or 'sum' (every token gets the same output gradient)")
        k = min(k, tokens)
        c = auto_chunk(costs, memory_budget, -(-tokens // k), h.vocab) if chunk == "auto" else chunk
    else:
        c = auto_chunk(costs, memory_budget, tokens, -(-h.vocab // k)) if chunk == "auto" else chunk
    if not fused and shards == "auto" and k == 1 and c is not None and c < tokens and h.vocab > 1:
        k = 2  # a head that must be chunked is cut: K stays what compile's re-planning repeats
        c = auto_chunk(costs, memory_budget, tokens, -(-h.vocab // k)) if chunk == "auto" else chunk
    if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 1):
        raise ValueError(f"chunk must be 'auto' or an int >= 1 (tokens per chunk), got {chunk!r}")
    if k == 1 and (c is None or c >= tokens) and not fused:
        return graph
    return _rewrite(graph, layer, h, k, min(c or tokens, tokens), meta, fused)


def _fmt(n: fx.Node) -> str:
    """Short description of a node for messages."""
    return f"{n.op} {n.target if isinstance(n.target, str) else getattr(n.target, '__name__', n.target)!r} ({n.name})"


def _match(layer: Layer) -> _Head:
    """Find linear -> [casts, view, scale] -> cross_entropy in the layer's graph (see module note)."""
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


def _shapes(graph: LayerGraph, layer: Layer) -> dict[fx.Node, Any]:
    """Every node's (fake) value in the layer at the traced shapes: no FLOPs, no memory."""
    gm, out = layer.module, {}
    dev = next((p.device for p in gm.parameters()), torch.device("cpu"))

    class _Record(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out[n] = super().run_node(n)
            return out[n]

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            args = [torch.empty(v.shape, dtype=v.dtype, device=dev).requires_grad_(
                v.requires_grad and v.dtype.is_floating_point) for v in map(graph.values.get, layer.inputs)]
            _Record(gm).run(*args)
    except Exception as exc:  # noqa: BLE001 - report any failure as a bad last layer
        raise ValueError(f"shard_lm_head: cannot propagate shapes through layer {layer.name!r}: {exc}") from exc
    return out


def _ident(name: str) -> str:
    """A Python identifier for a placeholder named after a value."""
    text = "".join(c if c.isalnum() else "_" for c in name)
    return text if text.isidentifier() else f"v_{text}"


def _steps(chain: tuple[fx.Node, ...]) -> tuple[tuple[str, Any], ...]:
    """The chain between the head matmul and cross_entropy as `chunked_lse` steps (views drop out: 2-D chunks)."""
    out: list[tuple[str, Any]] = []
    for c in chain:
        if c.target in _CASTS:
            dtype = c.kwargs.get("dtype", c.args[1] if len(c.args) > 1 else None)
            dtype = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16,
                     "double": torch.float64}.get(c.target, dtype)
            if dtype is not None:
                out.append(("cast", dtype))
        elif c.target in _SCALES:
            a, b = c.args
            div = c.target in (operator.truediv, torch.div, "div", "__truediv__")
            out.append(("div", b) if div else ("mul", b) if isinstance(b, (int, float)) else ("rmul", a))
    return tuple(out)


def _rewrite(graph: LayerGraph, layer: Layer, h: _Head, k: int, chunk: int | None,
             meta: dict[fx.Node, Any], fused: bool = False) -> LayerGraph:
    """The new LayerGraph: layers[:-1] + K shard layers + the loss layer (token shards if `fused`)."""
    gm, where, steps, logits = layer.module, f"last layer {layer.name!r}", _steps(h.chain), meta[h.logits]
    head_outs = dict(zip(next(n for n in gm.graph.nodes if n.op == "output").args[0], layer.outputs))
    e_in = list(dict.fromkeys(a for e in h.epilogue for a in e.all_input_nodes if a not in h.epilogue))
    if any(n in h.internal - {h.ce} or n in h.side for n in [*head_outs, *e_in]):
        raise ValueError(f"shard_lm_head: in {where}, the logits are used after the loss or are an output")
    pro, taken, base = set(h.prologue), set(graph.values) | set(graph.inputs), _ident(layer.name)

    def fresh(stem: str) -> str:
        name = f"{base}_{stem}"
        while name in taken:
            name += "_"
        taken.add(name)
        return name

    exports = [n for n in dict.fromkeys([h.target, *head_outs, *(a for a in e_in if a.op != "get_attr")]) if n in pro]
    names = {**{n: head_outs.get(n) or fresh("target" if n is h.target else n.name) for n in exports},
             **dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), layer.inputs))}
    needed, stack = set(), [h.x, h.target, *exports]
    while stack:
        n = stack.pop()
        if (n in pro or n.op == "placeholder") and n not in needed:
            needed.add(n)
            stack.extend(a for a in n.all_input_nodes if a not in h.side)
    batch = next((v.shape[0] for v in map(graph.values.get, graph.inputs) if v.shape), None)
    values = dict(graph.values)

    def value(name: str, t: torch.Tensor, grad: bool) -> str:
        bdim = 0 if t.dim() and batch and t.shape[0] % batch == 0 else None
        values[name] = Value(name, tuple(t.shape), t.dtype, t.numel() * t.dtype.itemsize, grad, "activation", bdim)
        return name

    for n in exports:
        value(names[n], meta[n], bool(meta[n].requires_grad))
    tok = torch.empty(() if fused else logits.shape[0], device="meta")
    kinds = ("nll",) if fused else ("max", "sumexp", "tlogit")
    stats = [tuple(value(fresh(f"{w}{i}"), tok, w != "max" and logits.requires_grad) for w in kinds)
             for i in range(k)]
    xs = [names.get(h.x)] + [value(fresh(f"x{i}"), meta[h.x], bool(meta[h.x].requires_grad)) for i in range(k - 1)]
    canon = {n: graph.tied.get(n, n) for n in (h.weight, h.bias) if n}
    layers, bounds = list(graph.layers[:-1]), [h.vocab * i // k for i in range(k + 1)]
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        g, env, ins = fx.Graph(), {}, []

        def ph(name: str) -> fx.Node:
            ins.append(name)
            return g.placeholder(_ident(name))

        def arg(a: fx.Node) -> Any:  # a size(-1) / .device read of the logits: V / the hidden's device
            if a not in h.side:
                return env[a]
            return h.vocab if _is_size_last(a) else g.call_function(getattr, (env[h.x], "device"))

        if i == 0:
            for n in gm.graph.nodes:
                if n in needed:
                    env[n] = ph(names[n]) if n.op == "placeholder" else g.node_copy(n, arg)
            x, tgt, prev = env[h.x], env[h.target], ()
        else:
            x, tgt, prev = ph(xs[i]), ph(names[h.target]), tuple(ph(s) for s in stats[i - 1])
        outs = ([env[n] for n in exports] if i == 0 else []) + [g.call_method("view_as", (x, x))] * (i + 1 < k)
        if fused:  # a token shard over the whole vocabulary (fused.py)
            b = g.get_attr(h.bias) if h.bias else None
            st = g.call_function(fused_ce, (x, g.get_attr(h.weight), b, tgt, prev[0] if prev else None, (i, k),
                                            chunk, steps, h.dim, h.ignore_index))
            g.output(tuple(outs + [st]))
            slices: tuple = ()
        else:
            w = g.call_function(vocab_slice, (g.get_attr(h.weight), h.dim, lo, hi))
            b = g.call_function(vocab_slice, (g.get_attr(h.bias), 0, lo, hi)) if h.bias else None
            st = g.call_function(chunked_lse, (x, w, b, tgt, lo, chunk, steps, h.dim, *prev))
            g.output(tuple(outs + [g.call_function(operator.getitem, (st, j)) for j in range(3)]))
            slices = tuple((canon[n], d, lo, hi) for n, d in ((h.weight, h.dim), (h.bias, 0)) if n)
        onames = ([names[n] for n in exports] if i == 0 else []) + xs[i + 1:i + 2] + list(stats[i])
        layers.append(_layer(gm, g, len(layers), f"{layer.name}.shard{i}", ins, onames, slices))
    g, env, ins = fx.Graph(), {}, [*stats[-1], names[h.target]]
    *st_in, tgt = (g.placeholder(_ident(n)) for n in ins)
    for a in (a for a in e_in if a is not h.ce):
        ins += [] if a.op == "get_attr" else [names[a]]
        env[a] = g.node_copy(a) if a.op == "get_attr" else g.placeholder(_ident(names[a]))
    loss = fused_loss if fused else lse_loss
    env[h.ce] = g.call_function(loss, (*st_in, tgt, h.ignore_index, h.reduction, meta[h.ce].dtype))
    for n in h.epilogue:
        env[n] = g.node_copy(n, env.__getitem__)
    last = [n for n in head_outs if n is h.ce or n in h.epilogue]
    g.output(tuple(env[n] for n in last))
    layers.append(_layer(gm, g, len(layers), f"{layer.name}.loss", ins, [head_outs[n] for n in last], ()))
    return LayerGraph(tuple(layers), values, graph.inputs, graph.loss, dict(graph.tied), dict(graph.params),
                      graph.input_kind, dict(graph.param_objects))


def _layer(root: fx.GraphModule, g: fx.Graph, index: int, name: str, inputs: list[str], outputs: list[str],
           slices: tuple[tuple[str, int, int, int], ...]) -> Layer:
    """A Layer whose module is `g` over `root`'s attributes (parameters keep their canonical names)."""
    mod = fx.GraphModule(root, g, class_name=f"Layer{index}")
    return Layer(index, name, tuple(inputs), tuple(outputs), tuple(dict(mod.named_parameters())), mod, slices)
