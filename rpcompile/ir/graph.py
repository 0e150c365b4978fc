"""The layer-graph IR: a model as an ordered list of layers and the values between them.

`rpcompile.passes.trace` builds a `LayerGraph`; the later passes read its layer
list, the values that cross each cut (the activation traffic of a stage
boundary) and the parameters each layer owns.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from tabulate import tabulate

__all__ = ["Value", "Layer", "LayerGraph"]


@dataclass(frozen=True, slots=True)
class Value:
    """A tensor that crosses a layer boundary, a model input, the loss or a parameter.

    Example:
        >>> Value("h1", (2, 8, 32), torch.float32, 2048, True, "activation", 0)
        Value(name='h1', shape=(2, 8, 32), dtype=torch.float32, bytes=2048, requires_grad=True, kind='activation', batch_dim=0)
    """

    name: str  # unique in the graph, e.g. "input_ids", "h3", "rotary_emb_0"
    shape: tuple[int, ...]  # at the traced example (the global batch); () for scalars
    dtype: torch.dtype  # element type
    bytes: int  # numel * element size
    requires_grad: bool  # True if a gradient flows back through it to a trainable parameter
    kind: str = "activation"  # "input" | "activation" | "loss" | "param"
    batch_dim: int | None = None  # dim that scales with the batch (0), None if batch-independent


@dataclass(frozen=True)
class Layer:
    """One layer: an executable fx module from named input values to named output values.

    `module(*inputs)` returns a tuple with one entry per name in `outputs`; its
    `named_parameters()` keys are the original model's canonical qualified names.
    """

    index: int  # position in LayerGraph.layers
    name: str  # module path, e.g. "model.layers.3", "lm_head"
    inputs: tuple[str, ...]  # value names, in the positional order module.forward takes them
    outputs: tuple[str, ...]  # value names, in the order module.forward returns them
    params: tuple[str, ...]  # canonical qualified parameter names this layer uses
    module: torch.fx.GraphModule = field(repr=False, compare=False)  # forward(*inputs) -> tuple
    # (canonical name, dim, start, stop) per parameter this layer reads only a slice of (vocab shards of
    # `shard_lm_head`): the module accepts the full parameter or exactly that slice; () = all whole
    param_slices: tuple[tuple[str, int, int, int], ...] = ()


def _fmt_bytes(n: int) -> str:
    """Human-readable byte count."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _names(names: tuple[str, ...], limit: int = 4) -> str:
    """Comma-joined names, shortened after `limit`."""
    shown = ", ".join(names[:limit])
    return shown + (f", +{len(names) - limit}" if len(names) > limit else "")


@dataclass(frozen=True)
class LayerGraph:
    """A traced model: ordered layers, the values between them and the parameters.

    Example:
        >>> import rpcompile, torch; from transformers import LlamaConfig, LlamaForCausalLM
        >>> _ = torch.manual_seed(0)
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=128, attn_implementation="eager"))
        >>> ids = torch.randint(0, 128, (2, 16)); batch = {"input_ids": ids, "labels": ids}
        >>> g = rpcompile.passes.trace(model, batch)
        >>> [layer.name for layer in g.layers]
        ['model.embed_tokens', 'model.layers.0', 'model.layers.1', 'model.norm', 'lm_head']
        >>> [v.name for v in g.live_at(1)]     # model inputs first, then in order of production
        ['labels', 'position_ids', 'position_embeddings_0', 'position_embeddings_1', 'h1']
        >>> torch.equal(g.run(batch), model(**batch).loss)   # the loss, exactly as model(**batch).loss
        True
    """

    layers: tuple[Layer, ...]  # in execution order
    values: dict[str, Value]  # every value crossing a boundary, the model inputs and the loss
    inputs: tuple[str, ...]  # model input names: dict keys, "x" for a tensor, "arg0".. for tuples
    loss: str  # name of the scalar loss value (an output of the last layer)
    tied: dict[str, str]  # alias qualified name -> canonical qualified name
    params: dict[str, Value]  # canonical parameter name -> metadata
    input_kind: str = "dict"  # how the example is structured: "tensor" | "tuple" | "dict"
    param_objects: dict[str, torch.nn.Parameter] = field(default_factory=dict, repr=False, compare=False)

    def live_at(self, i: int) -> tuple[Value, ...]:
        """Values crossing the cut between layer i and i+1 (produced at <= i or model inputs, read at > i).

        Args:
            i: layer index, -1 <= i < len(layers); -1 is the cut before the first layer.
        Returns:
            The values, in order of production (model inputs first).
        """
        if not -1 <= i < len(self.layers):
            raise IndexError(f"cut {i} out of range for {len(self.layers)} layers")
        later = {name for layer in self.layers[i + 1:] for name in layer.inputs}
        produced = list(self.inputs) + [n for layer in self.layers[: i + 1] for n in layer.outputs]
        return tuple(self.values[n] for n in dict.fromkeys(produced) if n in later)

    def cut_bytes(self, i: int) -> int:
        """Bytes of the values live at the cut after layer i (at the traced batch)."""
        return sum(v.bytes for v in self.live_at(i))

    def flatten_inputs(self, example: Any) -> dict[str, torch.Tensor]:
        """Named model inputs of an example (tensor, tuple/list or dict) as the graph names them.

        Raises:
            ValueError: an input is missing or is not a tensor.
        """
        if self.input_kind == "tensor":
            if not isinstance(example, torch.Tensor):
                raise ValueError(f"expected a tensor example, got {type(example).__name__}")
            found: dict[str, Any] = {"x": example}
        elif self.input_kind == "tuple":
            if not isinstance(example, (tuple, list)):
                raise ValueError(f"expected a tuple/list example, got {type(example).__name__}")
            found = {f"arg{k}": v for k, v in enumerate(example)}
        else:
            if not isinstance(example, dict):
                raise ValueError(f"expected a dict example, got {type(example).__name__}")
            found = dict(example)
        out = {}
        for name in self.inputs:
            if name not in found:
                raise ValueError(f"model input {name!r} is missing from the example")
            if not isinstance(found[name], torch.Tensor):
                raise ValueError(f"model input {name!r} must be a tensor, got {type(found[name]).__name__}")
            out[name] = found[name]
        return out

    def run(self, example: Any) -> torch.Tensor:
        """Reference executor: run the layers in order on one device and return the loss.

        The loss is differentiable with respect to the model's parameters.
        """
        env: dict[str, Any] = dict(self.flatten_inputs(example))
        for layer in self.layers:
            outs = layer.module(*(env[n] for n in layer.inputs))
            if len(outs) != len(layer.outputs):
                raise RuntimeError(f"layer {layer.index} ({layer.name}) returned {len(outs)} values, "
                                   f"expected {len(layer.outputs)}")
            env.update(zip(layer.outputs, outs))
        return env[self.loss]

    def parameters(self) -> dict[str, torch.nn.Parameter]:
        """Canonical parameter name -> the model's Parameter object."""
        return dict(self.param_objects)

    def param_owners(self) -> dict[str, tuple[int, ...]]:
        """Canonical parameter name -> indices of the layers that use it (tied: more than one)."""
        owners: dict[str, list[int]] = {name: [] for name in self.params}
        for layer in self.layers:
            for name in layer.params:
                owners.setdefault(name, []).append(layer.index)
        return {name: tuple(idx) for name, idx in owners.items()}

    def param_bytes(self, layer: Layer, *, trainable: bool = False, elements: bool = False) -> int:
        """Bytes of the parameters `layer` reads: only its slice of a sliced one (`param_slices`).

        Args:
            layer: a layer of this graph.
            trainable: count only parameters with requires_grad (the gradient bytes).
            elements: count elements instead of bytes.
        """
        sliced = {name: (dim, lo, hi) for name, dim, lo, hi in layer.param_slices}
        total = 0
        for name in layer.params:
            v = self.params[name]
            if trainable and not v.requires_grad:
                continue
            n = v.bytes // max(v.dtype.itemsize, 1) if elements else v.bytes
            if name in sliced:
                dim, lo, hi = sliced[name]
                n = n * (hi - lo) // v.shape[dim]
            total += n
        return total

    def __str__(self) -> str:
        rows = []
        for layer in self.layers:
            pbytes, nparams = self.param_bytes(layer), self.param_bytes(layer, elements=True)
            rows.append([layer.index, layer.name, f"{nparams:,}", _fmt_bytes(pbytes),
                         _names(layer.inputs), _names(layer.outputs)])
        head = ["layer", "name", "params", "param bytes", "inputs", "outputs"]
        return tabulate(rows, headers=head, tablefmt="simple")
