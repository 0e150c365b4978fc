"""Counting a layer's aten ops and memory on `meta` (predict mode's raw data), one layer at a time.

Each layer runs forward and backward on meta copies of its parameters and
inputs under the `Recorder` (`recorder.py`): every op's FLOPs and bytes, and
the live bytes after every op. SDPA runs as the fused flash kernel
(`meta.attention.FlashOnMeta`), MoE experts route evenly (`balanced_experts`; a layer of
more than five experts is counted from its first three to five where those give its count: `experts.py`),
attention masks are built as the data would have them (`meta_masks`).
Layers identical up to module indices are counted once.
"""
from __future__ import annotations

import re
import sys
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from rpcompile.ir.graph import Layer, LayerGraph
from rpcompile.passes.meta.attention import FlashOnMeta
from rpcompile.passes.meta.masks import meta_masks
from rpcompile.passes.meta.moe import balanced_experts, expert_count
from rpcompile.passes.cost.recorder import OpCount, Recorder, Tracker, storage_id, tensor_bytes
from rpcompile.passes.cost.experts import RUNS, extrapolate
from rpcompile.passes.trace.split import structure_key

__all__ = ["OpCount", "LayerCount", "count_layers", "split_microbatch", "run_once"]


@dataclass(frozen=True, slots=True)
class LayerCount:
    """What one layer does for one microbatch shape (predict mode's raw data)."""

    fwd_ops: tuple[OpCount, ...]  # aten ops of the forward (as a forward without autograd runs it)
    bwd_ops: tuple[OpCount, ...]  # aten ops of the backward (without recompute), and the gradient
                                  # regions a forward with autograd runs (`meta.regions.grad_region`)
    param_bytes: int  # bytes of its parameters
    grad_bytes: int  # bytes of its trainable parameters' gradients
    act_bytes: int  # bytes of outputs read downstream
    saved_bytes: int  # bytes of its inputs
    peak_bytes: int  # most bytes live at once during forward + backward above parameters and inputs (`live`)
    live: tuple[int, ...] = ()  # live bytes after each op, forward then backward (chunk loops folded)


def split_microbatch(graph: LayerGraph, example: Any, microbatches: int) -> dict[str, torch.Tensor]:
    """The first of `microbatches` equal slices (dim 0) of the example's batched inputs, by name.

    Raises:
        ValueError: a batched input's size is not divisible by `microbatches` (names it).

    >>> import torch; from transformers import LlamaConfig, LlamaForCausalLM
    >>> _ = torch.manual_seed(0)
    >>> llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=128, attn_implementation="eager"))
    >>> from rpcompile.passes import trace
    >>> ids8x16 = torch.randint(0, 128, (8, 16)); batch = {"input_ids": ids8x16, "labels": ids8x16}
    >>> g = trace(llama, batch)
    >>> split_microbatch(g, batch, 4)["input_ids"].shape
    torch.Size([2, 16])
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    out = {}
    for name, t in graph.flatten_inputs(example).items():
        v = graph.values.get(name)
        if microbatches > 1 and (v is None or v.batch_dim == 0) and t.dim() > 0:
            if t.shape[0] % microbatches:
                raise ValueError(f"input {name!r} has batch size {t.shape[0]}, "
                                 f"not divisible into {microbatches} microbatches")
            t = t[: t.shape[0] // microbatches]
        out[name] = t
    return out


def _state(layer: Layer, make: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """name -> make(tensor) for every parameter and buffer of the layer module (aliases included)."""
    mod = layer.module
    state = {k: make(p).requires_grad_(p.requires_grad) if p.is_floating_point() else make(p)
             for k, p in mod.named_parameters(remove_duplicate=False)}
    state.update({k: make(b) for k, b in mod.named_buffers(remove_duplicate=False)})
    return state


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    """A detached leaf of `t` that requires grad if asked and possible."""
    t = t.detach()
    return t.requires_grad_(True) if grad and (t.is_floating_point() or t.is_complex()) else t


def _later_inputs(graph: LayerGraph) -> list[set[str]]:
    """For each layer index i, the value names read by layers after i (plus the loss)."""
    later: list[set[str]] = [set() for _ in graph.layers]
    acc = {graph.loss}
    for i in range(len(graph.layers) - 1, -1, -1):
        later[i] = set(acc)
        acc |= set(graph.layers[i].inputs)
    return later


def run_once(layer: Layer, state: dict, inputs: list) -> tuple[tuple, Recorder, Recorder, list[int]]:
    """Forward + backward of one layer under recorders: (outputs, forward ops, backward ops, live curve).

    The output gradients (ones) are created between the two phases: tracked, not priced (in a
    pipeline they arrive from the next stage). The live curve excludes parameter gradients.
    """
    params = {storage_id(p) for p in state.values()}
    tracker = Tracker(params | {storage_id(t) for t in inputs if isinstance(t, torch.Tensor)})
    rf, glue, rb = Recorder(tracker), Recorder(tracker), Recorder(tracker)
    with torch.enable_grad(), rf:
        outs = tuple(torch.func.functional_call(layer.module, state, tuple(inputs)))
    diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    wrt = [t for t in [*inputs, *state.values()] if isinstance(t, torch.Tensor) and t.requires_grad]
    grads: tuple = ()
    if diff and wrt:
        with glue:
            gouts = [torch.ones_like(o) for o in diff]
        with rb:
            grads = torch.autograd.grad(diff, wrt, gouts, allow_unused=True)
        del gouts
    pgrads = {storage_id(g) for g, t in zip(grads, wrt) if g is not None and storage_id(t) in params}
    return outs, rf, rb, tracker.live(exclude=pgrads)


def _layer_memory(graph: LayerGraph, layer: Layer, inputs: list, outs: tuple, later: set[str]) -> tuple:
    """(param_bytes, grad_bytes, act_bytes, saved_bytes) of one layer at this microbatch."""
    pb, gb = graph.param_bytes(layer), graph.param_bytes(layer, trainable=True)
    act = sum(tensor_bytes(o) for n, o in zip(layer.outputs, outs) if n in later and isinstance(o, torch.Tensor))
    saved = sum(tensor_bytes(t) for t in inputs if isinstance(t, torch.Tensor))
    return pb, gb, act, saved


def _to_meta(t: Any) -> Any:
    """A meta tensor like `t` (non-tensors unchanged)."""
    return t.detach().to("meta") if isinstance(t, torch.Tensor) else t


def _count_one(graph: LayerGraph, layer: Layer, inputs: list, later: set[str],
               fallback_param_bytes: int) -> tuple[LayerCount, tuple]:
    """Count one layer on meta, else with fake tensors, else for real on the CPU (small layers only)."""
    grads = [graph.values[n].requires_grad if n in graph.values else False for n in layer.inputs]
    errors = []
    for how in ("meta", "fake", "cpu"):
        try:
            if how == "meta":
                outs, fwd, bwd, live = _run_meta(layer, inputs, grads)
            elif how == "fake":
                outs, fwd, bwd, live = _ops(*_run_fake(layer, inputs, grads))
            else:
                pbytes = graph.param_bytes(layer)
                if pbytes > fallback_param_bytes:
                    raise ValueError(f"layer {layer.index} ({layer.name}) cannot run on the meta device "
                                     f"({'; '.join(errors)}) and its {pbytes} parameter bytes exceed "
                                     f"fallback_param_bytes={fallback_param_bytes}")
                state = _state(layer, _random_cpu)
                real = [_leaf(_random_cpu(t), g) for t, g in zip(inputs, grads)]
                outs, fwd, bwd, live = _ops(*run_once(layer, state, real))
            if how == "cpu":
                warnings.warn(f"estimate_costs: layer {layer.index} ({layer.name}) cannot run on the meta device "
                              f"({'; '.join(errors)}); counted it by running it on the CPU with random weights", stacklevel=3)
            outs = tuple(_plain_meta(o) for o in outs)
            mem = _layer_memory(graph, layer, inputs, outs, later)
            return LayerCount(tuple(fwd), tuple(bwd), *mem, max(live, default=0), tuple(live)), outs
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - try the next way, report all if none works
            errors.append(f"{how}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    raise ValueError(f"layer {layer.index} ({layer.name}) could not be counted: {'; '.join(errors)}")


def _ops(outs: tuple, rf: Recorder, rb: Recorder, live: list[int]) -> tuple:
    """`run_once`'s result as (outputs, forward ops, backward ops, live curve): forward-time gradients count
    with the backward."""
    return outs, tuple(rf.ops), tuple(rf.grad_ops) + tuple(rb.ops), tuple(live)


def _run_meta(layer: Layer, inputs: list, grads: list) -> tuple:
    """`run_once` on meta, as `_ops` (MoE: average routing; SDPA: the fused kernel). A layer of balanced
    experts is counted from its first few experts where they give the count of all (`experts.extrapolate`)."""
    got: dict[int | None, tuple] = {}

    def run(k: int | None) -> tuple:
        state = _state(layer, _to_meta)
        with balanced_experts(layer.module, run=k), FlashOnMeta():
            got[k] = _ops(*run_once(layer, state, [_leaf(t, g) for t, g in zip(inputs, grads)]))
        return got[k][1:]

    if (n := expert_count(layer.module)) and (counts := extrapolate(run, n)) is not None:
        return (got[RUNS[0]][0], *counts)
    run(None)
    return got[None]


def _run_fake(layer: Layer, inputs: list, grads: list) -> tuple:
    """`run_once` under FakeTensorMode (Hugging Face skips data-dependent checks on fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fm = FakeTensorMode(allow_non_fake_inputs=True)
    state = {k: fm.from_tensor(v).requires_grad_(v.requires_grad) if v.is_floating_point() else fm.from_tensor(v)
             for k, v in _state(layer, _to_meta).items()}
    fake_in = [_leaf(fm.from_tensor(t), g) if isinstance(t, torch.Tensor) else t for t, g in zip(inputs, grads)]
    with fm, FlashOnMeta():
        return run_once(layer, state, fake_in)


def _plain_meta(t: Any) -> Any:
    """A plain meta tensor with `t`'s shape and dtype (fake/real/meta in)."""
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")


def _random_cpu(t: torch.Tensor) -> torch.Tensor:
    """A real CPU tensor of `t`'s shape (`t` itself if it is one): small random floats, integer zeros."""
    if not t.is_meta and t.device.type == "cpu":
        return t.detach()
    if t.is_floating_point():
        return torch.randn(tuple(t.shape), dtype=t.dtype) * 0.02
    return torch.zeros(tuple(t.shape), dtype=t.dtype)


def count_layers(graph: LayerGraph, inputs: dict[str, torch.Tensor], *, progress: bool = True,
                 fallback_param_bytes: int = 256 * 2 ** 20, counted: dict | None = None,
                 codes: dict | None = None) -> list[LayerCount]:
    """Per-layer op counts and memory for one microbatch, executed layer by layer on `meta`.

    Args:
        graph: the traced model (its weights may be on `meta`).
        inputs: the microbatch's named model inputs (real or meta tensors).
        fallback_param_bytes: largest layer that may be run for real on the CPU when `meta` fails.
        counted: the layers counted so far, filled in here: pass the same dict to count another graph of
            the same model (e.g. after `shard_lm_head`) and a layer equal to one counted before (code up to
            module indices, parameter and input shapes: `_layer_key`) is not run again. Default: a new one.
        codes: layer index -> the part of its `_layer_key` that does not depend on the inputs (code,
            parameters), filled in here: pass the same dict to count the same graph at other shapes.
    Returns:
        One LayerCount per layer.
    """
    env: dict[str, Any] = {k: _to_meta(v) for k, v in inputs.items()}
    later = _later_inputs(graph)
    counts, start = [], time.perf_counter()
    seen: dict[tuple, tuple[LayerCount, tuple]] = {} if counted is None else counted  # equal layers: counted once
    for layer in graph.layers:
        _progress(progress, layer.index, len(graph.layers), start, "counting")
        args = [env[n] for n in layer.inputs]
        key = _layer_key(graph, layer, args, codes)
        if key in seen:
            first, outs = seen[key]
            count = replace(first, **dict(zip(("param_bytes", "grad_bytes", "act_bytes", "saved_bytes"),
                                              _layer_memory(graph, layer, args, outs, later[layer.index]))))
        else:
            with meta_masks():
                count, outs = _count_one(graph, layer, args, later[layer.index], fallback_param_bytes)
            seen[key] = count, outs
        env.update(zip(layer.outputs, outs))
        counts.append(count)
    _progress(progress, len(graph.layers), len(graph.layers), start, "counting")
    return counts


def _layer_key(graph: LayerGraph, layer: Layer, args: list, codes: dict | None = None) -> tuple:
    """Layers equal in code (up to module indices), parameter shapes and input shapes count the same.

    `codes` (layer index -> `_code_key`) keeps the part that does not depend on `args` between calls."""
    code = codes.get(layer.index) if codes is not None else None
    if code is None:
        code = _code_key(layer)
        if codes is not None:
            codes[layer.index] = code
    ins = tuple((tuple(t.shape), t.dtype, graph.values[n].requires_grad if n in graph.values else False)
                if isinstance(t, torch.Tensor) else repr(t) for n, t in zip(layer.inputs, args))
    return code[0], code[1], ins, code[2]


def _code_key(layer: Layer) -> tuple:
    """(code, parameters, parameter slices) of `_layer_key`, module indices replaced by '#' (the code as
    `trace.split.structure_key`: its Python text is not generated for the layers that are not run)."""
    def norm(text: str) -> str:
        return re.sub(r"\d+", "#", text)
    params = tuple((norm(n), tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.module.named_parameters())
    slices = tuple((norm(n), d, b - a) for n, d, a, b in layer.param_slices)  # a slice costs by its width
    return structure_key(layer.module), params, slices


def _progress(enabled: bool, i: int, n: int, start: float, what: str) -> None:
    """A one-line progress indicator on stderr, only when stderr is a terminal."""
    if enabled and sys.stderr.isatty():
        end = "\n" if i == n else ""
        sys.stderr.write(f"\r[estimate_costs] {what} layer {min(i + 1, n)}/{n}, "
                         f"{time.perf_counter() - start:.1f} s elapsed{end}")
        sys.stderr.flush()
