"""The torch.fx tracer behind `rpcompile.passes.trace`: layer units as leaves, HF quirks handled.

Note:
    Three facts about tracing Hugging Face transformers models shape this file.
    (1) The decorated `forward` has a `*args, **kwargs` signature, so we never
    let fx inspect it: `create_args_for_root` is overridden to emit one
    placeholder per flattened example input and to call the model's forward
    with explicit keywords. (2) `masking_utils.create_*mask` must be opaque
    `call_function` leaves; fx's autowrap search only looks at the globals of
    the decorated forward (another module), so `autowrap_masks` patches the
    modeling modules' globals for the duration of the trace. (3) The config
    object must stay a constant: fx would rebuild a dataclass argument inside
    the graph and silently drop `_attn_implementation`, so `create_arg` stores
    opaque objects as constant attributes of the root instead.

    Three more make models whose loss is computed inside `forward` traceable
    (BERT, T5). A module built inside `forward` (`CrossEntropyLoss()(logits,
    labels)`) is not a submodule, so it is traced through; item assignment on a
    proxy (T5's `_shift_right`: `shifted[..., 1:] = ids[..., :-1]`) records an
    `operator.setitem` node (`_Proxy`), and in-place ops are kept by dead-code
    elimination (`_fx_split`); the buffers of a traced-through module become
    `get_attr` nodes, so slicing one by a traced size works (BERT's
    `position_ids[:, :seq_length]`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import inspect
import operator
import os
import sys
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

__all__ = ["UntraceableError", "LayerTracer", "make_root", "autowrap_masks", "leaf_function"]

_PLAIN = (str, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format, torch.Size, slice, range, enum.Enum, type(Ellipsis))
_HERE = os.path.dirname(os.path.abspath(__file__))


class UntraceableError(ValueError):
    """The model (or a glue op between layers) cannot be traced; the message names module and op."""


def make_root(model: torch.nn.Module) -> torch.nn.Module:
    """A bare Module sharing `model`'s parameter/buffer/submodule dicts (same qualified names)."""
    root = torch.nn.Module()
    root._modules = model._modules
    root._parameters = model._parameters
    root._buffers = model._buffers
    root.training = model.training
    return root


@contextlib.contextmanager
def autowrap_masks(model: torch.nn.Module) -> Iterator[None]:
    """Make transformers' `masking_utils.create_*mask` functions fx leaves while tracing `model`."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        yield
        return
    fns = {id(v): v for k, v in vars(masking).items() if k.startswith("create_") and callable(v)}
    dicts = {id(vars(masking)): vars(masking)}
    for mod in model.modules():
        for cls in type(mod).__mro__:
            pymod = sys.modules.get(cls.__module__)
            if pymod is not None and cls.__module__.startswith("transformers"):
                dicts[id(vars(pymod))] = vars(pymod)
    saved = []
    try:
        for d in dicts.values():
            for key, val in list(d.items()):
                if id(val) in fns and not isinstance(val, type):
                    saved.append((d, key, val))
                    d[key] = leaf_function(val)
        yield
    finally:
        for d, key, val in reversed(saved):
            d[key] = val


def leaf_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `fn` so that a call with proxy arguments records one call_function node (an fx leaf).

    Without proxies it simply calls `fn`, so a wrapped function can be used everywhere; its
    arguments must be values fx can record (tensors, plain constants), not modules.

    >>> double = leaf_function(lambda x: 2 * x)
    >>> double(3)
    6
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        proxies: list[fx.Proxy] = []
        fx.node.map_aggregate((args, kwargs), lambda a: proxies.append(a) if isinstance(a, fx.Proxy) else None)
        if proxies:
            return proxies[0].tracer.create_proxy("call_function", fn, args, kwargs)
        return fn(*args, **kwargs)

    return wrapper


class LayerTracer(fx.Tracer):
    """fx tracer whose leaves are the layer units; records which unit call made each node.

    Args:
        units: qualified module names that are layer units.
        tied_modules: names of modules holding a tied parameter (under any of its names);
            they are traced through so the graph refers to it by its canonical name.
        input_names: one placeholder per name, in order.
        body: called with the placeholder proxies; returns the traced loss.
    """

    def __init__(self, units: frozenset[str], tied_modules: frozenset[str], input_names: tuple[str, ...],
                 body: Callable[[tuple[fx.Proxy, ...]], Any]) -> None:
        super().__init__(param_shapes_constant=True)
        self.units = units
        self.unit_parents = frozenset(".".join(u.split(".")[:k]) for u in units for k in range(u.count(".") + 1))
        self.tied_modules = tied_modules
        self.input_names = input_names
        self.body = body
        self.node_unit: dict[fx.Node, int] = {}  # node -> index of the unit call that made it
        self.unit_calls: list[str] = []  # unit call index -> qualified name
        self.rp_modules: list[str] = []  # qualified names of the modules being traced
        self.constants: dict[int, str] = {}  # id(object) -> root attribute name

    def create_args_for_root(self, root_fn: Any, is_module: bool, concrete_args: Any = None) -> Any:
        proxies = tuple(self.create_proxy("placeholder", n, (), {}) for n in self.input_names)
        return (lambda root, *args: self.body(args)), [self.root, *proxies]

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        if qualname in self.tied_modules:
            return False
        if qualname in self.units or self._inside_unit():
            return True
        if qualname in self.unit_parents:
            return False
        std = m.__module__.startswith(("torch.nn", "torch.ao.nn")) and not isinstance(m, torch.nn.Sequential)
        return std or next(m.buffers(recurse=False), None) is not None

    def _inside_unit(self) -> bool:
        """True while tracing through a unit (one holding a tied parameter)."""
        return any(name in self.units for name in self.rp_modules)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        """Buffers of traced-through modules become get_attr nodes (BERT slices `position_ids` by a size)."""
        if isinstance(attr_val, torch.Tensor) and not isinstance(attr_val, torch.nn.Parameter):
            for name, buf in self.root.named_buffers():
                if buf is attr_val:
                    if name not in parameter_proxy_cache:
                        parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
                    return parameter_proxy_cache[name]
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def call_module(self, m: torch.nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        try:
            name = self.path_of_module(m)
        except NameError:  # built inside forward (`CrossEntropyLoss()(logits, labels)`): trace through it
            if next(m.parameters(), None) is not None or next(m.buffers(), None) is not None:
                raise UntraceableError(f"module {type(m).__name__} is created inside forward and holds "
                                       f"parameters or buffers; register it as a submodule") from None
            return forward(*args, **kwargs)
        is_unit = name in self.units and not self._inside_unit()
        if is_unit:
            self.unit_calls.append(name)
        self.rp_modules.append(name)
        try:
            return super().call_module(m, forward, args, kwargs)
        except UntraceableError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised with the module and op named
            raise UntraceableError(_explain(name, m, exc)) from exc
        finally:
            self.rp_modules.pop()

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any, name: str | None = None,
                    type_expr: Any = None) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if any(n in self.units for n in self.rp_modules):
            self.node_unit[node] = len(self.unit_calls) - 1
        return node

    def create_arg(self, a: Any) -> Any:
        if _is_opaque(a):
            name = self.constants.get(id(a))
            if name is None:
                name = f"_rp_const{len(self.constants)}"
                self.constants[id(a)] = name
                setattr(self.root, name, a)
            return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)


class _Proxy(fx.Proxy):
    """An fx Proxy that records item assignment (`x[..., 1:] = y`) as an `operator.setitem` node."""

    def __setitem__(self, key: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


def _is_opaque(a: Any) -> bool:
    """True for objects fx cannot rebuild faithfully (configs, dataclasses, custom objects)."""
    if isinstance(a, (fx.Proxy, fx.Node, torch.Tensor, torch.nn.Module, tuple, list, dict) + _PLAIN):
        return False
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return True
    if callable(a) or isinstance(a, type):
        return False
    return type(a).__module__ not in ("builtins", "torch")


def _explain(name: str, mod: torch.nn.Module, exc: BaseException) -> str:
    """Error text naming the module, the failing operation and the `layers=` escape hatch."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(_HERE) and f"{os.sep}torch{os.sep}" not in f.filename]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}: `{frames[-1].line}`" if frames else ""
    label = name or "<root>"
    hint = f"layers=[..., {name!r}, ...]" if name else "layers=[...]"
    return (f"cannot trace module {label!r} ({type(mod).__name__}): {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}{where}. Make it (or a module that "
            f"contains it) a layer unit so it runs eagerly, e.g. trace(model, example, {hint}).")


def explain_root(model: torch.nn.Module, exc: BaseException) -> str:
    """Error text for a failure in the model's own forward (glue between layers)."""
    return _explain("", model, exc)


def forward_params(model: torch.nn.Module) -> tuple[list[str], bool, bool]:
    """Names of `model.forward`'s parameters (unwrapped), and whether it takes *args / **kwargs."""
    sig = inspect.signature(inspect.unwrap(type(model).forward))
    params = list(sig.parameters.values())[1:]
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    has_var = any(p.kind is p.VAR_POSITIONAL for p in params)
    has_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    return names, has_var, has_kw
