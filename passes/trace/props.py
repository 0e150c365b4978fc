"""Shape propagation for `trace`: every node's value metadata, at (almost) no FLOPs.

Note:
    Every module call runs on `meta` copies of its parameters and inputs, and so
    does every glue op that reads a meta value: tracing a large model costs no
    FLOPs and works when the model itself is on `meta`. Glue that reads only
    real values (the example, position ids built from it) runs for real, because
    Hugging Face mask creation branches on the values of position ids; `x.device`
    of a meta stand-in answers the example's device, so such glue stays real. An
    op that fails on meta (data-dependent: `.item()`, `nonzero`, e.g. mask
    creation or mixture-of-experts routing) is re-run for real, with zero
    tensors standing in for the meta values; a module whose own weights are on
    meta cannot be, and raises a clear error naming the node.

    Repeated units run once: a layer unit equal to one already run (`unit_signature`:
    the same classes, attributes, parameter and buffer shapes, up to module
    indices) on inputs with the same metadata gives that unit's output again, since
    only metadata is recorded. A decoder of 94 identical blocks runs one block, not
    94 (`propagate(..., memo=False)` runs every one; tests/passes/trace checks they agree).
    So does arithmetic glue (`+`, `-`, `*`, `/`, unary `-`) on meta values: a residual add
    between sub-block units runs once per distinct metadata, not once per block.
"""
from __future__ import annotations

import operator
import re
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["TMeta", "propagate", "PropagationError", "unit_signature"]

# attributes that number a block among its peers (Hugging Face's `layer_idx`): not part of a unit's signature
INDEX_ATTRS = frozenset({"layer_idx", "layer_index", "layer_id", "block_idx"})
_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device)
# glue ops whose result on meta values depends on their metadata only (no in-place variant): run once per
# distinct metadata, as repeated units are (a decoder's residual adds)
_ARITHMETIC = frozenset({operator.add, operator.sub, operator.mul, operator.truediv, operator.neg})


class PropagationError(ValueError):
    """A node failed while recording shapes; the message names the node and the layer unit."""


@dataclass(frozen=True, slots=True)
class TMeta:
    """Metadata of a traced tensor value."""

    shape: tuple[int, ...]  # concrete shape at the traced example
    dtype: torch.dtype  # element type
    requires_grad: bool  # depends on a trainable parameter


def describe(v: Any) -> Any:
    """Tensors -> TMeta, tuples/lists/dicts recursively, anything else as is."""
    if isinstance(v, torch.Tensor):
        return TMeta(tuple(v.shape), v.dtype, bool(v.requires_grad))
    if isinstance(v, torch.Size):
        return v
    if type(v) in (tuple, list):
        return type(v)(describe(x) for x in v)
    if type(v) is dict:
        return {k: describe(x) for k, x in v.items()}
    return v


def _to_meta(t: Any) -> Any:
    """A meta copy of a tensor that keeps its requires_grad flag."""
    if not isinstance(t, torch.Tensor):
        return t
    m = t.detach().to("meta")
    return m.requires_grad_(t.requires_grad) if (t.is_floating_point() or t.is_complex()) else m


class _Prop(fx.Interpreter):
    """Interpreter that records `describe(value)` per node; modules and fake values run on meta."""

    def __init__(self, root: torch.nn.Module, graph: fx.Graph, units: dict[fx.Node, str],
                 glue_device: torch.device, model_on_meta: bool, memo: bool = True) -> None:
        super().__init__(root, graph=graph)
        self.units = units
        self.glue_device = glue_device
        self.model_on_meta = model_on_meta
        self.record: dict[fx.Node, Any] = {}
        self.memo: dict[tuple, tuple[Any, Any]] | None = {} if memo else None  # key -> (output, inputs kept alive)
        self.signatures: dict[str, tuple | None] = {}  # module target -> unit_signature

    def run_node(self, n: fx.Node) -> Any:
        try:
            if n.op in ("call_function", "call_method", "call_module"):
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                value = self._run_mixed(n, args, kwargs)
            else:
                value = super().run_node(n)
        except PropagationError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised naming the node
            where = f"layer unit {self.units[n]!r}" if n in self.units else "glue between layers"
            hint = (" (the model is on the meta device and this op needs real data; trace a model with "
                    "real weights, or make the op part of a layer unit with layers=[...])"
                    if self.model_on_meta else "")
            raise PropagationError(f"recording shapes failed at node {n.name!r} ({n.op} {_target(n)}) "
                                   f"in {where}: {type(exc).__name__}: {exc}{hint}") from exc
        self.record[n] = describe(value)
        return value

    def _run_mixed(self, n: fx.Node, args: Any, kwargs: Any) -> Any:
        """`_run_fresh`, or for a module call equal to one already run (the module Note), or an arithmetic
        glue op (a residual add) on meta values equal to one already run, that one's output."""
        key = None
        if self.memo is not None and n.op == "call_module":
            key = self._unit_key(n, args, kwargs)
        elif self.memo is not None and n.op == "call_function" and n.target in _ARITHMETIC and all(
                t.is_meta for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)):
            key = (n.target, _hashable((args, kwargs)))  # on meta values it reads only their metadata
        if key is not None and key in self.memo:
            return self.memo[key][0]
        value = self._run_fresh(n, args, kwargs)
        if key is not None:
            self.memo[key] = (value, (args, kwargs))  # the inputs stay alive: the ids in keys are not reused
        return value

    def _unit_key(self, n: fx.Node, args: Any, kwargs: Any) -> tuple | None:
        """(the module's signature, its inputs' metadata), or None when the call must run."""
        if n.target not in self.signatures:
            self.signatures[n.target] = unit_signature(self.fetch_attr(n.target))
        sig = self.signatures[n.target]
        return None if sig is None else (sig, _hashable((args, kwargs)))

    def _run_fresh(self, n: fx.Node, args: Any, kwargs: Any) -> Any:
        """Run on meta when a module or a meta stand-in is involved; on failure, for real."""
        if n.op == "call_function" and n.target is getattr and len(args) > 1 and args[1] == "device" \
                and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return self.glue_device  # meta tensors stand in for real ones on the glue device
        leaves: list[torch.Tensor] = []
        tree_map(lambda t: leaves.append(t) if isinstance(t, torch.Tensor) else None, (args, kwargs))
        if self.glue_device.type == "meta" or not (n.op == "call_module" or any(t.is_meta for t in leaves)):
            return self._call(n, args, kwargs, meta_state=False)
        try:
            return self._call(n, tree_map(_to_meta, args), tree_map(_to_meta, kwargs), meta_state=True)
        except Exception:  # noqa: BLE001 - data-dependent op: run it for real on zero stand-ins
            pass
        if n.op == "call_module" and any(t.is_meta for t in self._state(n)):
            raise RuntimeError(f"module {n.target!r} cannot run on the meta device (data-dependent op) "
                               f"and its weights are on meta")
        try:  # zero stand-ins that allocate nothing (one zero, expanded): mask creation reads only shapes
            value = self._call(n, tree_map(self._broadcast_zero, args), tree_map(self._broadcast_zero, kwargs), False)
            if not any(_is_broadcast(t) for t in tree_flatten(value)[0]):
                return value
        except Exception:  # noqa: BLE001 - e.g. an in-place write into the stand-in: dense zeros below
            pass
        return self._call(n, tree_map(self._materialise, args), tree_map(self._materialise, kwargs), False)

    def _state(self, n: fx.Node) -> list[torch.Tensor]:
        """Parameters and buffers of a call_module node's module."""
        mod = self.fetch_attr(n.target)
        return [*mod.parameters(), *mod.buffers()]

    def _call(self, n: fx.Node, args: Any, kwargs: Any, meta_state: bool) -> Any:
        """Execute one node; modules with meta copies of their state if `meta_state`."""
        if n.op == "call_function":
            return n.target(*args, **kwargs)
        if n.op == "call_method":
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        mod = self.fetch_attr(n.target)
        if not meta_state:
            return mod(*args, **kwargs)
        state = {k: _to_meta(p) for k, p in mod.named_parameters()}
        state.update({k: b.to("meta") for k, b in mod.named_buffers()})
        return torch.func.functional_call(mod, state, args, kwargs)

    def _broadcast_zero(self, t: Any) -> Any:
        """One zero on the glue device expanded to meta tensor `t`'s shape: no memory (others unchanged)."""
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return t
        return torch.zeros((), dtype=t.dtype, device=self.glue_device, requires_grad=t.requires_grad).expand(t.shape)

    def _materialise(self, t: Any) -> Any:
        """A zero tensor on the glue device standing in for meta tensor `t` (others unchanged)."""
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return t
        z = torch.zeros(t.shape, dtype=t.dtype, device=self.glue_device)
        return z.requires_grad_(t.requires_grad) if t.requires_grad else z


def _is_broadcast(t: Any) -> bool:
    """Whether `t` is a tensor that repeats an element through a zero stride (an expanded stand-in's view)."""
    return isinstance(t, torch.Tensor) and t.numel() > 1 and 0 in t.stride()


def unit_signature(module: torch.nn.Module) -> tuple | None:
    """What a module call's output metadata depends on besides its inputs, equal for repeated blocks.

    Per submodule (named with every number as '#', so `layers.3.mlp` and `layers.7.mlp` agree): its class,
    its public attributes (plain values as they are, any other object by identity, so a shared config matches
    and a per-block object does not; a method bound to the submodule itself by its function; block numbers,
    `INDEX_ATTRS`, left out), its parameters' and buffers'
    shapes, dtypes, devices and requires_grad. None (always run) for a module with forward hooks.

    >>> a, b = torch.nn.Linear(4, 8), torch.nn.Linear(4, 8)
    >>> unit_signature(a) == unit_signature(b), unit_signature(a) == unit_signature(torch.nn.Linear(4, 9))
    (True, False)
    """
    parts = []
    for name, m in module.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return None
        attrs = tuple((k, _attribute(m, v)) for k, v in sorted(vars(m).items())
                      if not k.startswith("_") and k not in INDEX_ATTRS)
        tensors = tuple((k, tuple(t.shape), t.dtype, t.device.type, t.requires_grad)
                        for k, t in [*m._parameters.items(), *m._buffers.items()] if t is not None)
        parts.append((re.sub(r"\d+", "#", name), type(m), attrs, tensors))
    return tuple(parts)


def _attribute(m: torch.nn.Module, v: Any) -> Any:
    """An attribute of `m` in its signature: a method bound to `m` itself (a patched `forward`, as
    `meta.moe.balanced_experts` sets on every experts module) by its function, anything else `_plain_or_id`."""
    if isinstance(v, types.MethodType) and v.__self__ is m:
        return ("method", id(v.__func__))
    return _plain_or_id(v)


def _plain_or_id(v: Any) -> Any:
    """A plain value (or a tuple / list of them) as it is; anything else by identity."""
    if isinstance(v, _PLAIN) or (type(v) in (tuple, list, frozenset) and all(isinstance(x, _PLAIN) for x in v)):
        return (type(v).__name__, tuple(v) if type(v) in (tuple, list) else v)
    return ("id", id(v))


def _hashable(v: Any) -> Any:
    """A call's arguments as a key: tensors by their `TMeta`, tuples, lists and dicts (fx's immutable ones
    included) as tagged tuples, plain values as they are, any other object by identity."""
    if isinstance(v, torch.Tensor):
        v = describe(v)
    if isinstance(v, (TMeta, torch.Size)) or isinstance(v, _PLAIN):
        return (type(v).__name__, v)
    if type(v) in (tuple, list) or isinstance(v, fx.immutable_collections.immutable_list):
        return ("list" if isinstance(v, list) else "tuple", *map(_hashable, v))
    if isinstance(v, dict) and type(v) in (dict, fx.immutable_collections.immutable_dict):
        return ("dict", *((k, _hashable(x)) for k, x in v.items()))
    return ("id", id(v))


def _target(n: fx.Node) -> str:
    """Readable op target of a node."""
    return getattr(n.target, "__name__", None) or str(n.target)


def propagate(root: torch.nn.Module, graph: fx.Graph, inputs: dict[str, torch.Tensor],
              units: dict[fx.Node, str], model_on_meta: bool, *, memo: bool = True) -> dict[fx.Node, Any]:
    """Run `graph` once on `inputs` and return `describe(value)` for every node.

    Args:
        root: module holding the graph's submodules and attributes.
        graph: the traced top-level graph.
        inputs: model inputs by placeholder name.
        units: call_module nodes of layer units -> unit name (for error messages).
        model_on_meta: the model's weights are on meta (for error messages).
        memo: run a repeated unit once (the module Note); False runs every call.
    Returns:
        node -> TMeta for tensors, tuples/lists/dicts of those, or the Python value.
    """
    names = [n.target for n in graph.nodes if n.op == "placeholder"]
    args = [inputs[name] for name in names]
    device = args[0].device if args else torch.device("cpu")
    prop = _Prop(root, graph, units, device, model_on_meta, memo)
    with torch.enable_grad():
        prop.run(*args)
    return prop.record
