"""The `shard_lm_head` pass: the LM head + cross-entropy as K vocabulary shards (DESIGN.md idea 4).

The second pass of the pipeline (trace -> shard_lm_head -> estimate_costs -> partition -> emit -> verify).
This folder holds it and the helpers only it uses:

    chunked.py  the kernels of the shard layers: a vocabulary shard of the head + loss, in token chunks
    fused.py    the fused head's kernel: a token shard over the whole vocabulary that takes its gradients
                in its forward, chunk by chunk (`fused=True`)
    auto.py     the automatic choices: how many shards, how many tokens per chunk
    match.py    recognising the head in the last layer's graph: linear -> [casts, view, scale] -> cross_entropy

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

import operator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from rpcompile.ir.costs import CostTable
from rpcompile.ir.graph import Layer, LayerGraph, Value
from rpcompile.passes.shard_head.chunked import chunked_lse, lse_loss, lse_update, vocab_slice
from rpcompile.passes.shard_head.fused import fused_ce, fused_loss
from rpcompile.passes.shard_head.auto import auto_chunk, auto_shards
from rpcompile.passes.shard_head.match import _CASTS, _SCALES, _Head, _is_size_last, _match

__all__ = ["shard_lm_head", "vocab_slice", "lse_update", "lse_loss"]


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
