"""The `trace` pass: nn.Module + example batch -> LayerGraph.

The first pass of the pipeline (trace -> shard_lm_head -> estimate_costs -> partition -> emit -> verify).
This folder holds it and the helpers only it uses:

    tracer.py     the torch.fx tracer: layer units as leaves, HF quirks, untraceable-model messages
    props.py      shape propagation: every node's value metadata, at (almost) no FLOPs
    split.py      the traced graph cut into per-layer fx modules
    remat.py      attention masks rebuilt inside each layer that reads them, never passed across a cut
    hf_compat.py  Hugging Face defaults switched off while tracing (the KV cache)

Note:
    The model is traced once with torch.fx; layer units (the blocks of the main
    ModuleList/Sequential, and of a comparable one beside it such as an encoder's,
    and each parameter-owning module around them) are fx leaves, so a decoder
    layer is one `call_module` node that runs eagerly.
    Glue ops between units join the layer of the unit before them (glue before
    the first unit joins the first layer), so the loss lands in the last layer
    and rotary/mask/position values are produced by the embedding layer. Shapes
    come from one run of the graph with units on the meta device (`_fx_props`).
    Tied parameters: a unit holding a tied parameter is traced through, so its
    layer module refers to the parameter by its canonical name (the first name
    in `model.named_parameters()`).
"""
from __future__ import annotations

import contextlib

import fnmatch
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from rpcompile.ir.graph import Layer, LayerGraph, Value
from rpcompile.passes.meta.moe import balanced_experts
from rpcompile.passes.trace.props import PropagationError, TMeta, propagate
from rpcompile.passes.trace.split import build_layer_module, eliminate_dead_code, fix_crossings, layer_io
from rpcompile.passes.trace.hf_compat import no_kv_cache
from rpcompile.passes.trace.tracer import (LayerTracer, UntraceableError, autowrap_masks, explain_root,
                                         forward_params, make_root)

__all__ = ["trace", "match_units", "UntraceableError", "PropagationError"]


def trace(model: torch.nn.Module, example: Any, *, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
          layers: Sequence[str] | None = None) -> LayerGraph:
    """Trace `model` on `example` into a LayerGraph whose last layer produces the scalar loss.

    Args:
        model: the model; its parameters may live on any device, including `meta`.
        example: one global batch: a tensor, a tuple/list, or a dict of keyword inputs
            (Hugging Face: `{"input_ids": ..., "labels": ...}`; `use_cache=False` is added).
        loss_fn: `loss_fn(output, example) -> scalar`; without it the loss is the model's
            output if that is a tensor, else `output.loss` / `output["loss"]`. With it, a dict
            example passes only the keys `forward` accepts and a tuple example only as many
            leading items as `forward` has positional parameters.
        layers: module-name patterns of the layer units (`*` matches one dotted segment),
            e.g. `["model.embed_tokens", "model.layers.*", "model.norm", "lm_head"]`.
            Default: detected (see module note).
    Returns:
        The LayerGraph; `graph.run(example)` reproduces the model's loss.
    Raises:
        UntraceableError: a module or glue op cannot be traced (names both), or a
            non-tensor value crosses layers and cannot be rebuilt (names it).

    Example:
        >>> import torch; from transformers import LlamaConfig, LlamaForCausalLM
        >>> _ = torch.manual_seed(0)
        >>> llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=128, attn_implementation="eager"))
        >>> ids = torch.randint(0, 128, (2, 16))
        >>> g = trace(llama, {"input_ids": ids, "labels": ids})
        >>> [layer.name for layer in g.layers]
        ['model.embed_tokens', 'model.layers.0', 'model.layers.1', 'model.norm', 'lm_head']
    """
    kind, inputs, consts = _flatten_example(example)
    canonical, tied = _param_names(model)
    tied_names = [*tied, *tied.values()]
    tied_modules = frozenset(".".join(n.split(".")[:k]) for n in tied_names for k in range(n.count(".") + 1))
    units = match_units(model, layers) if layers is not None else _detect_units(model)
    root = make_root(model)
    body = _make_body(model, example, kind, tuple(inputs), loss_fn)
    tracer = LayerTracer(frozenset(units), tied_modules, tuple(inputs), body)
    with autowrap_masks(model), no_kv_cache(model):
        try:
            graph = tracer.trace(root)
        except UntraceableError:
            raise
        except Exception as exc:  # noqa: BLE001 - glue in the model's own forward
            raise UntraceableError(explain_root(model, exc)) from exc
    eliminate_dead_code(graph)
    layer_of, layer_names, unit_nodes, results = _assign_layers(graph, tracer)
    on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    with balanced_experts(model) if on_meta else contextlib.nullcontext():  # MoE dispatch needs real data
        record = propagate(tracer.root, graph, inputs, unit_nodes, on_meta)
    loss_node = next(n for n in graph.nodes if n.op == "output").args[0]
    loss_rec = record.get(loss_node)
    if not (isinstance(loss_rec, TMeta) and loss_rec.shape == () and loss_rec.dtype.is_floating_point):
        raise UntraceableError(f"the loss must be a floating scalar tensor, got {loss_rec!r}; pass loss_fn=")
    fix_crossings(graph, layer_of, record, layer_names)
    eliminate_dead_code(graph)
    return _assemble(model, tracer.root, graph, layer_of, layer_names, record, inputs, loss_node,
                     kind, canonical, tied, results)


def _flatten_example(example: Any) -> tuple[str, dict[str, torch.Tensor], dict[str, Any]]:
    """(kind, tensor inputs by name, non-tensor constants by name) of an example."""
    if isinstance(example, torch.Tensor):
        return "tensor", {"x": example}, {}
    if isinstance(example, (tuple, list)):
        items = {f"arg{k}": v for k, v in enumerate(example)}
        kind = "tuple"
    elif isinstance(example, dict):
        items, kind = dict(example), "dict"
    else:
        raise ValueError(f"example must be a tensor, tuple/list or dict, got {type(example).__name__}")
    tensors = {k: v for k, v in items.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise ValueError("example has no tensors")
    return kind, tensors, {k: v for k, v in items.items() if k not in tensors}


def _param_names(model: torch.nn.Module) -> tuple[dict[int, str], dict[str, str]]:
    """id(param) -> canonical name (first in named_parameters), and alias -> canonical."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    tied = {name: canonical[id(p)] for name, p in model.named_parameters(remove_duplicate=False)
            if canonical[id(p)] != name}
    return canonical, tied


def _nparams(m: torch.nn.Module) -> int:
    """Parameter count of a module."""
    return sum(p.numel() for p in m.parameters())


def _detect_units(model: torch.nn.Module) -> list[str]:
    """Blocks of the biggest ModuleList/Sequential (and of comparable ones beside it, `_stacks`) plus each
    parameter-owning module around them."""
    lists = [(n, m) for n, m in model.named_modules()
             if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m) > 0]
    if not lists:
        raise UntraceableError(f"{type(model).__name__} has no nn.ModuleList/nn.Sequential of blocks; "
                               f"pass layers=[...] with the module names of the layer units")
    main, block = max(lists, key=lambda nm: (_nparams(nm[1]), -(nm[0].count(".") + bool(nm[0]))))
    stacks = _stacks(lists, main)
    units: list[str] = []

    def walk(mod: torch.nn.Module, prefix: str) -> None:
        for cname, child in mod.named_children():
            q = f"{prefix}.{cname}" if prefix else cname
            if q in stacks:
                units.extend(f"{q}.{k}" for k, _ in child.named_children())
            elif any(m.startswith(q + ".") for m in stacks):
                walk(child, q)
            elif next(child.parameters(), None) is not None:
                units.append(q)

    if main == "":
        units.extend(k for k, _ in block.named_children())
    else:
        walk(model, "")
    return units


def sublayer_units(model) -> list[str]:
    """Layer-unit patterns that cut every decoder block into its sub-blocks (norms, attention, MLP).

    For `trace(..., layers=)`. A backward stage then recomputes and differentiates one sub-block,
    not a whole decoder layer, so the activations it holds are those of attention or of the MLP:
    at long sequences this is what lets a layer's workspace fit (`seq_len_limit`). The sub-blocks
    are the decoder block's children that own parameters; the residual adds run as glue.

    >>> sublayer_units(build_meta("llama3.1-8b"))[:3]   # rpcompile.models.presets.build_meta  # doctest: +SKIP
    ['model.embed_tokens', 'model.layers.*.self_attn', 'model.layers.*.mlp']
    """
    units = _detect_units(model)
    blocks = [u for u in units if u.rsplit(".", 1)[-1].isdigit()]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no list of decoder blocks to cut into sub-blocks")
    inner: dict[str, list[str]] = {}  # block list (an encoder-decoder has two) -> its sub-block patterns
    for b in blocks:
        parent = b.rsplit(".", 1)[0]
        if parent not in inner:
            inner[parent] = [f"{parent}.*.{c}" for c, m in model.get_submodule(b).named_children()
                             if next(m.parameters(), None) is not None]
    out: list[str] = []
    for u in units:
        out += inner[u.rsplit(".", 1)[0]] if u in blocks else [u]
    return list(dict.fromkeys(out))


def _stacks(lists: list[tuple[str, torch.nn.Module]], main: str) -> list[str]:
    """`main` and each other block list with at least a quarter of its parameters (T5's encoder beside its
    decoder), none inside another."""
    if main == "":
        return [main]
    least = _nparams(dict(lists)[main]) / 4
    chosen = [main]
    for name, m in sorted(lists, key=lambda nm: -_nparams(nm[1])):
        if name and _nparams(m) >= least and not any(name == c or name.startswith(c + ".") or
                                                     c.startswith(name + ".") for c in chosen):
            chosen.append(name)
    return chosen


def match_units(model: torch.nn.Module, patterns: Sequence[str]) -> list[str]:
    """Module names matching the patterns (`*` = one dotted segment); outermost matches win.

    Raises:
        ValueError: a pattern matches no module of `model` (names the pattern).

    >>> match_units(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), ["*"])
    ['0', '1']
    """
    names = [n for n, _ in model.named_modules() if n]

    def hit(name: str, pat: str) -> bool:
        a, b = name.split("."), pat.split(".")
        return len(a) == len(b) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(a, b))

    for pat in patterns:
        if not any(hit(n, pat) for n in names):
            raise ValueError(f"layers pattern {pat!r} matches no module of {type(model).__name__}")
    found = [n for n in names if any(hit(n, p) for p in patterns)]
    inside = set(found)  # a match inside another: one of its dotted prefixes matched too
    return [n for n in found if not any(".".join(n.split(".")[:k]) in inside for k in range(1, n.count(".") + 1))]


def _make_body(model: torch.nn.Module, example: Any, kind: str, names: tuple[str, ...],
               loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> Callable[[tuple[fx.Proxy, ...]], Any]:
    """The traced function: call model.forward with proxies in the example's structure, return the loss."""
    fparams, has_var, has_kw = forward_params(model)
    forward = type(model).forward

    def body(proxies: tuple[fx.Proxy, ...]) -> Any:
        sub = dict(zip(names, proxies))
        if kind == "tensor":
            ex: Any = sub["x"]
            out = forward(model, ex)
        elif kind == "tuple":
            ex = type(example)(sub.get(f"arg{k}", v) for k, v in enumerate(example))
            npos = len(ex) if (loss_fn is None or has_var) else len(fparams)
            out = forward(model, *ex[:npos])
        else:
            ex = {k: sub.get(k, v) for k, v in example.items()}
            kwargs = {k: v for k, v in ex.items() if has_kw or k in fparams}
            if "use_cache" in fparams and "use_cache" not in kwargs:
                kwargs["use_cache"] = False
            out = forward(model, **kwargs)
        if loss_fn is not None:
            return loss_fn(out, ex)
        if isinstance(out, fx.Proxy):
            return out
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
        if not isinstance(loss, fx.Proxy):
            raise UntraceableError(f"cannot find the loss in the output of {type(model).__name__} "
                                   f"({type(out).__name__}); pass loss_fn=lambda output, example: ...")
        return loss

    return body


def _assign_layers(graph: fx.Graph, tracer: LayerTracer
                   ) -> tuple[dict[fx.Node, int], list[str], dict[fx.Node, str], dict[int, fx.Node]]:
    """Node -> layer (glue joins the preceding unit), layer names, leaf unit calls, each unit's result node."""
    layer_of: dict[fx.Node, int] = {}
    call_layer: dict[int, int] = {}
    names: list[str] = []
    unit_nodes: dict[fx.Node, str] = {}
    results: dict[int, fx.Node] = {}
    cur = 0
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        call = tracer.node_unit.get(node)
        if call is not None:
            if call not in call_layer:
                call_layer[call] = len(names)
                name = tracer.unit_calls[call]
                names.append(name if name not in names else f"{name}#{names.count(name)}")
            cur = call_layer[call]
            results[cur] = node
            if node.op == "call_module" and node.target == tracer.unit_calls[call]:
                unit_nodes[node] = names[cur]
        layer_of[node] = cur
    if not names:
        raise UntraceableError("no layer unit was called by the model's forward; pass layers=[...]")
    return layer_of, names, unit_nodes, results


def _assemble(model: torch.nn.Module, root: torch.nn.Module, graph: fx.Graph, layer_of: dict[fx.Node, int],
              layer_names: list[str], record: dict[fx.Node, Any], inputs: dict[str, torch.Tensor],
              loss_node: fx.Node, kind: str, canonical: dict[int, str], tied: dict[str, str],
              results: dict[int, fx.Node]) -> LayerGraph:
    """Build the Layer modules and Value records."""
    nlayers = len(layer_names)
    nodes, ins, outs = layer_io(graph, layer_of, nlayers, loss_node)
    batch = next(iter(inputs.values())).shape[0] if next(iter(inputs.values())).dim() else None
    vnames: dict[fx.Node, str] = {}
    taken = set(inputs)
    main = {_main_output(results[b], set(outs[b]) - {loss_node}, layer_of): b for b in range(nlayers) if b in results}
    for node in graph.nodes:
        if node.op == "placeholder":
            vnames[node] = node.target
        elif node is loss_node and "loss" not in taken:
            vnames[node] = "loss"
        elif node in main and f"h{main[node]}" not in taken:
            vnames[node] = f"h{main[node]}"
        else:
            kw = _kwarg_name(node)
            vnames[node] = kw if kw and kw not in taken else node.name if node.name not in taken else f"{node.name}_v"
        taken.add(vnames[node])
    values: dict[str, Value] = {}
    for node in [*[n for n in graph.nodes if n.op == "placeholder"], *{x: 0 for o in outs for x in o}]:
        rec = record.get(node)
        if node.op == "placeholder" and node not in record:
            t = inputs[node.target]
            rec = TMeta(tuple(t.shape), t.dtype, False)
        vkind = "input" if node.op == "placeholder" else "loss" if node is loss_node else "activation"
        values[vnames[node]] = _value(vnames[node], rec, vkind, batch)
    layers = []
    for b in range(nlayers):
        module = build_layer_module(root, nodes[b], ins[b], outs[b], vnames, b)
        layers.append(Layer(b, layer_names[b], tuple(vnames[x] for x in ins[b]),
                            tuple(vnames[x] for x in outs[b]), _layer_params(module, canonical), module))
    params = {name: _value(name, TMeta(tuple(p.shape), p.dtype, p.requires_grad), "param", None)
              for name, p in model.named_parameters()}
    return LayerGraph(tuple(layers), values, tuple(vnames[n] for n in graph.nodes if n.op == "placeholder"),
                      vnames[loss_node], tied, params, kind, dict(model.named_parameters()))


def _kwarg_name(node: fx.Node) -> str | None:
    """The keyword under which a module call reads `node` ("position_ids", "position_embeddings_0"), if any."""
    for user in node.users:
        if user.op != "call_module":
            continue
        for key, val in user.kwargs.items():
            if val is node:
                return key
            if isinstance(val, (tuple, list)):
                for i, item in enumerate(val):
                    if item is node:
                        return f"{key}_{i}"
    return None


def _main_output(result: fx.Node, outs: set[fx.Node], layer_of: dict[fx.Node, int]) -> fx.Node | None:
    """The layer's crossing output nearest (data flow, same layer) to the unit's result: its hidden state."""
    frontier, seen = [result], {result}
    while frontier:
        for node in frontier:
            if node in outs:
                return node
        nxt = [u for n in frontier for u in n.users if u not in seen and layer_of.get(u) == layer_of[result]]
        seen.update(nxt)
        frontier = list(dict.fromkeys(nxt))
    return None


def _value(name: str, rec: TMeta, kind: str, batch: int | None) -> Value:
    """Value record from tensor metadata."""
    numel = 1
    for d in rec.shape:
        numel *= d
    bdim = 0 if (kind in ("input", "activation") and rec.shape and batch is not None and rec.shape[0] == batch) \
        else None
    return Value(name, rec.shape, rec.dtype, numel * rec.dtype.itemsize, rec.requires_grad, kind, bdim)


def _layer_params(module: fx.GraphModule, canonical: dict[int, str]) -> tuple[str, ...]:
    """Canonical names of the parameters a layer module holds, in first-use order."""
    names = [canonical[id(p)] for p in module.parameters() if id(p) in canonical]
    return tuple(dict.fromkeys(names))
