"""Splitting the traced top-level graph into per-layer fx modules (used by `trace`).

Note:
    Every node belongs to one layer. A node read by a later layer "crosses" the
    cut. Tensors cross as values, except attention masks: a `masking_utils`
    mask call is copied into every layer that reads it (`_fx_remat`), so only
    its [B, S] padding mask and position ids cross. Before splitting,
    `fix_crossings` also rewrites the other kinds: a tuple of tensors becomes one `getitem` per tensor (the
    consumer rebuilds the tuple), a `None` is inlined as a constant in the
    consumer, and a Python value computed from tensor metadata (sizes, dtypes)
    is recomputed in the consumer from a tensor it already has (the same tensor,
    a model input, or one of the consumer's inputs with the same shape).
    Anything else is an error that names the value.
"""
from __future__ import annotations

import keyword
import operator
import re
from typing import Any

import torch
import torch.fx as fx

from rpcompile.passes.trace.props import TMeta
from rpcompile.passes.trace.remat import is_mask_call, position, rebuild_in_consumers
from rpcompile.passes.trace.tracer import UntraceableError

try:  # generates a module's Python code when it is first called or read, not when it is built
    from torch.fx._lazy_graph_module import _LazyGraphModule as _LayerModule
except ImportError:  # pragma: no cover - a torch without it: code generated at once
    _LayerModule = fx.GraphModule

__all__ = ["fix_crossings", "eliminate_dead_code", "build_layer_module", "layer_io", "structure_key"]

_META_METHODS = frozenset({"size", "dim", "numel", "ndimension", "get_device", "element_size"})
_META_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad"})


def eliminate_dead_code(graph: fx.Graph) -> None:
    """Remove unused pure nodes (call_module units count as pure; in-place ops and item assignment do not)."""
    for node in reversed(list(graph.nodes)):
        if node.users or node.op in ("placeholder", "output"):
            continue
        if node.op in ("call_function", "call_method") and (node.is_impure() or _in_place(node)):
            continue
        graph.erase_node(node)


def _in_place(node: fx.Node) -> bool:
    """True for an in-place tensor op (`x.masked_fill_(...)`, `torch.relu_(x)`): its effect is not its result."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.startswith("_")


def _has_tensor(rec: Any) -> bool:
    """True if a recorded value is or contains a tensor."""
    if isinstance(rec, TMeta):
        return True
    if isinstance(rec, (tuple, list)):
        return any(_has_tensor(r) for r in rec)
    if isinstance(rec, dict):
        return any(_has_tensor(r) for r in rec.values())
    return False


def _is_meta_access(m: fx.Node, x: fx.Node) -> bool:
    """True if node `m` only reads metadata (size, dtype, ...) of tensor node `x`."""
    if not m.args or m.args[0] is not x:
        return False
    if m.op == "call_method":
        return m.target in _META_METHODS
    return m.op == "call_function" and m.target is getattr and len(m.args) > 1 and m.args[1] in _META_ATTRS


def _metadata_chain(n: fx.Node, record: dict[fx.Node, Any]) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """Nodes (topological) computing non-tensor `n` from tensor metadata, and the tensor leaves; None if impossible."""
    chain: list[fx.Node] = []
    leaves: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(m: fx.Node) -> bool:
        if m in seen:
            return True
        seen.add(m)
        if m.op == "get_attr" and not _has_tensor(record.get(m)):
            chain.append(m)
            return True
        if m.op not in ("call_function", "call_method") or _has_tensor(record.get(m)):
            return False
        for x in m.all_input_nodes:
            if _has_tensor(record.get(x)):
                if not (isinstance(record.get(x), TMeta) and _is_meta_access(m, x)):
                    return False
                if x not in leaves:
                    leaves.append(x)
            elif not visit(x):
                return False
        chain.append(m)
        return True

    return (chain, leaves) if visit(n) else None


def fix_crossings(graph: fx.Graph, layer_of: dict[fx.Node, int], record: dict[fx.Node, Any],
                  names: list[str]) -> None:
    """Rewrite non-tensor values that cross layers (see module note); updates layer_of and record in place.

    Raises:
        UntraceableError: a crossing value cannot be passed as tensors nor rebuilt.
    """
    last = len(names) - 1

    def user_layer(u: fx.Node) -> int:
        return last if u.op == "output" else layer_of[u]

    for n in list(graph.nodes):
        if n.op in ("placeholder", "output", "get_attr") or n not in layer_of:
            continue
        a, rec = layer_of[n], record.get(n)
        later = [u for u in n.users if user_layer(u) > a]
        if later and is_mask_call(n):  # an attention mask (tensor or None): rebuilt where it is read
            rebuild_in_consumers(graph, n, later, layer_of, record, user_layer)
            continue
        if not later or isinstance(rec, TMeta):
            continue
        if rec is None:
            for u in later:
                _replace_input(u, n, None)
        elif isinstance(rec, (tuple, list)) and all(isinstance(r, TMeta) or r is None for r in rec):
            parts: list[Any] = []
            with graph.inserting_after(n):
                for i, r in reversed(list(enumerate(rec))):
                    if r is None:
                        parts.insert(0, None)
                        continue
                    g = graph.create_node("call_function", operator.getitem, (n, i), {}, name=f"{n.name}_{i}")
                    layer_of[g], record[g] = a, r
                    parts.insert(0, g)
            for u in later:
                _replace_input(u, n, type(rec)(parts))
        else:
            found = _metadata_chain(n, record) if not _has_tensor(rec) else None
            if found is None:
                consumers = sorted({names[user_layer(u)] for u in later})
                raise UntraceableError(
                    f"value {n.name!r} ({type(rec).__name__}: {_short(rec)}) is computed in layer "
                    f"{names[a]!r} and read by {consumers}; it is not a tensor (or a tuple of tensors) and "
                    f"cannot be rebuilt there. Choose layer units so that it stays inside one layer "
                    f"(layers=[...]) or compute it from a tensor inside the consumer.")
            for b in sorted({user_layer(u) for u in later}):
                _copy_chain(graph, n, found, [u for u in later if user_layer(u) == b], b, layer_of, record)


def _copy_chain(graph: fx.Graph, n: fx.Node, found: tuple[list[fx.Node], list[fx.Node]],
                users: list[fx.Node], b: int, layer_of: dict[fx.Node, int], record: dict[fx.Node, Any]) -> None:
    """Recompute the metadata chain of `n` inside layer b, right before its first user there."""
    chain, leaves = found
    first = min(users, key=lambda u: position(graph, u))
    env: dict[fx.Node, Any] = {x: _substitute(x, b, first, graph, layer_of, record) for x in leaves}
    with graph.inserting_before(first):
        for m in chain:
            env[m] = graph.node_copy(m, lambda y: env.get(y, y))
            layer_of[env[m]], record[env[m]] = b, record.get(m)
    for u in users:
        _replace_input(u, n, env[n])


def _substitute(x: fx.Node, b: int, first: fx.Node, graph: fx.Graph, layer_of: dict[fx.Node, int],
                record: dict[fx.Node, Any]) -> fx.Node:
    """A tensor available in layer b with the same shape as `x` (x itself if it is there or a model input)."""
    if x.op == "placeholder" or layer_of.get(x) == b:
        return x
    shape = record[x].shape
    for node in graph.nodes:
        if node is first:
            break
        if layer_of.get(node) != b:
            continue
        for cand in [*node.all_input_nodes, node]:
            rec = record.get(cand)
            if isinstance(rec, TMeta) and rec.shape == shape and cand.op != "get_attr":
                return cand
    return x


def _replace_input(user: fx.Node, old: fx.Node, new: Any) -> None:
    """Replace `old` in user's args/kwargs by `new` (a node, None, or a tuple of nodes)."""
    user.args = fx.node.map_arg(user.args, lambda y: new if y is old else y)
    user.kwargs = fx.node.map_arg(user.kwargs, lambda y: new if y is old else y)


def _short(rec: Any) -> str:
    """Short repr for error messages."""
    text = repr(rec)
    return text if len(text) < 80 else text[:77] + "..."


def layer_io(graph: fx.Graph, layer_of: dict[fx.Node, int], nlayers: int,
             loss: fx.Node) -> tuple[list[list[fx.Node]], list[list[fx.Node]], list[list[fx.Node]]]:
    """Per layer: its nodes (graph order), its crossing input nodes and its crossing output nodes."""
    nodes: list[list[fx.Node]] = [[] for _ in range(nlayers)]
    ins: list[dict[fx.Node, None]] = [{} for _ in range(nlayers)]
    outs: list[dict[fx.Node, None]] = [{} for _ in range(nlayers)]
    for node in graph.nodes:
        if node.op == "placeholder" or node not in layer_of:
            continue
        b = layer_of[node]
        nodes[b].append(node)
        for x in node.all_input_nodes:
            if x.op != "get_attr" and layer_of.get(x) != b:
                ins[b][x] = None
                if x.op != "placeholder":
                    outs[layer_of[x]][x] = None
    last = nlayers - 1
    if layer_of.get(loss) != last:
        ins[last][loss] = None
        if loss.op != "placeholder":
            outs[layer_of[loss]][loss] = None
    outs[last][loss] = None
    return nodes, [list(d) for d in ins], [list(d) for d in outs]


def build_layer_module(root: torch.nn.Module, nodes: list[fx.Node], inputs: list[fx.Node],
                       outputs: list[fx.Node], names: dict[fx.Node, str], index: int) -> fx.GraphModule:
    """An fx module computing `outputs` (a tuple) of one layer from its `inputs`, positionally."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, x in enumerate(inputs):
        name = names[x] if names[x].isidentifier() and not keyword.iskeyword(names[x]) else f"in_{k}"
        env[x] = g.placeholder(name)

    def arg(y: fx.Node) -> fx.Node:
        if y not in env:  # a parameter or constant read by this layer but created in another
            env[y] = g.node_copy(y)
        return env[y]

    for node in nodes:
        env[node] = g.node_copy(node, arg)
    g.output(tuple(env[x] for x in outputs))
    # most layers of a large model are never called while planning (cost counting runs one of each kind,
    # `structure_key`): their Python code is generated on first use (a call, `.code`, pickling)
    return _LayerModule(root, g, class_name=f"Layer{index}")


def structure_key(module: fx.GraphModule) -> tuple:
    """What `module.code` computes, with every number in a module path replaced by '#': equal for layers
    whose code is the same up to block indices (`layers.3.mlp` and `layers.7.mlp`), without generating it.

    Per node, in order: its kind, its target (a module or attribute path normalised, a function itself;
    none for an input, whose name changes nothing) and its arguments (a node by its position, constants as
    they are). As in the code's text, a called module is its path only, not its class or weights.

    >>> a = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    >>> b = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.ReLU()))
    >>> structure_key(a) == structure_key(fx.symbolic_trace(a)), structure_key(a) == structure_key(b)
    (True, False)
    """
    index: dict[fx.Node, int] = {}
    out = []
    for node in module.graph.nodes:
        index[node] = len(index)
        target = (_path(node.target) if node.op in ("call_module", "get_attr")
                  else None if node.op == "placeholder" else _constant(node.target))
        out.append((node.op, target, _constant(node.args, index), _constant(node.kwargs, index)))
    return tuple(out)


def _path(target: str) -> str:
    """A module or attribute path with its numbers (block indices) as '#'."""
    return re.sub(r"\d+", "#", target)


def _constant(v: Any, index: dict[fx.Node, int] | None = None) -> Any:
    """An argument as a hashable key: a node by its position, containers item by item, a hashable value as
    itself (with its type: 1, 1.0 and True differ), anything else by its repr."""
    if isinstance(v, fx.Node):
        return ("node", index[v] if index is not None else v.name)
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, *(_constant(x, index) for x in v))
    if isinstance(v, dict):
        return ("dict", *((k, _constant(x, index)) for k, x in v.items()))
    if isinstance(v, slice):
        return ("slice", _constant(v.start, index), _constant(v.stop, index), _constant(v.step, index))
    try:
        hash(v)
    except TypeError:
        return ("repr", type(v), repr(v))
    return (type(v), v)
