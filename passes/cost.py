"""The `estimate_costs` pass: LayerGraph + example -> CostTable (per layer, per microbatch).

Two modes:
- "measure": run each layer alone on a device with the microbatch inputs that the
  previous layers produced, time forward and backward (median after warm-up) and
  account the memory it really allocates.
- "predict": count FLOPs and bytes of every aten op of each layer (forward and
  backward) on the `meta` device and price each op with `Hardware.roofline` plus
  a launch latency. Needs no weights.

Note:
    How ops are priced (predict mode), i.e. how the runtime runs them: the
    runtime executes layers eagerly, so every aten op is one kernel that reads
    its operands from device memory and writes its results back. An
    elementwise chain (RMSNorm's pow/mean/rsqrt/mul, rotary's mul/cat/add,
    SwiGLU's silu/mul, their backward) is therefore priced op by op: each op
    `max(FLOPs / (peak * efficiency), bytes / bandwidth)` with its own bytes
    (inputs + outputs; a broadcast operand counts its distinct elements once), plus one
    `op_latency` per kernel launch; nothing is assumed fused. SDPA is the
    exception because it is one fused kernel on every real device: it is
    priced as the flash kernel (one op forward, one backward; FLOPs of the
    scored pairs only, half of them with `is_causal`; bytes linear in S; see
    `_attention.py`). A chunk loop (the sequence-chunked LM head) is one op
    per loop position with summed FLOPs and bytes and one launch per iteration.
    FLOPs come from `_attention.FLOP_RULES` and `_meta_moe.GROUPED_MM_FLOPS`, else torch's
    `flop_registry`.

    Memory columns (both modes): `act_bytes` = outputs read by a later layer;
    `saved_bytes` = the layer's inputs (kept for the recompute); `peak_bytes` =
    the most bytes live at once on top of the layer's parameters and inputs
    during its forward + backward: autograd's saved tensors, outputs, output
    gradients, every backward transient and the input gradients (parameter
    gradients are `grad_bytes`). Both modes follow every storage's lifetime
    with the same recorder (`_recorder.py`), on meta or on real tensors; on
    CUDA measure mode reads the allocator's peak above the layer's resident
    state instead. A layer that cannot run on `meta` (data-dependent ops) is
    retried with fake tensors, then for real on the CPU with random weights if
    its parameters are small (a warning names it); otherwise a ValueError
    names it.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch

from rpcompile.costs import CostTable
from rpcompile.graph import Layer, LayerGraph
from rpcompile.hardware import Hardware
from rpcompile.passes._count import (LayerCount, OpCount, _later_inputs, _layer_memory, _leaf, _progress,
                                     _random_cpu, _state, count_layers, run_once, split_microbatch)

__all__ = ["estimate_costs", "OpCount", "LayerCount", "count_layers", "split_microbatch", "layer_times"]


def layer_times(ops: Sequence[OpCount], hardware: Hardware) -> float:
    """Predicted seconds of a sequence of ops: per-op roofline plus a launch latency per kernel (see module Note)."""
    return (sum(hardware.roofline(o.flops, o.bytes, o.dtype) for o in ops)
            + sum(o.launches for o in ops) * hardware.op_latency)


def _predict(graph: LayerGraph, inputs: dict, hardware: Hardware, progress: bool) -> CostTable:
    """CostTable from counted ops priced on `hardware`."""
    counts = count_layers(graph, inputs, progress=progress)
    return CostTable.from_lists(
        fwd=[layer_times(c.fwd_ops, hardware) for c in counts],
        bwd=[layer_times(c.bwd_ops, hardware) for c in counts],
        param_bytes=[c.param_bytes for c in counts], grad_bytes=[c.grad_bytes for c in counts],
        act_bytes=[c.act_bytes for c in counts], saved_bytes=[c.saved_bytes for c in counts],
        peak_bytes=[c.peak_bytes for c in counts], names=[layer.name for layer in graph.layers],
        fwd_flops=[sum(o.flops for o in c.fwd_ops) for c in counts],
        bwd_flops=[sum(o.flops for o in c.bwd_ops) for c in counts])


def _median_time(fn: Callable[[], Any], dev: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of fn() after warm-up; fewer repeats once 3 s are spent."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda d: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
        if sum(times) > 3.0 and len(times) >= 2:
            break
    return statistics.median(times)


def _measure_layer(graph: LayerGraph, layer: Layer, inputs: list, later: set[str], dev: torch.device,
                   warmup: int, repeats: int) -> tuple[list, tuple]:
    """[fwd s, bwd s, param, grad, act, saved, peak bytes, fwd flops, bwd flops] and the layer's outputs."""
    state = _state(layer, lambda t: _random_cpu(t).to(dev) if t.is_meta else t.detach().to(dev))
    grads = [graph.values[n].requires_grad if n in graph.values else False for n in layer.inputs]
    xs = [_leaf(t, g) if isinstance(t, torch.Tensor) else t for t, g in zip(inputs, grads)]
    with torch.enable_grad():
        fwd_t = _median_time(lambda: torch.func.functional_call(layer.module, state, tuple(xs)), dev, warmup,
                             repeats)
        outs = tuple(torch.func.functional_call(layer.module, state, tuple(xs)))
    diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    wrt = [t for t in [*xs, *state.values()] if isinstance(t, torch.Tensor) and t.requires_grad]
    bwd_t, gouts = 0.0, None
    if diff and wrt:
        gouts = [torch.ones_like(o) for o in diff]
        bwd_t = _median_time(lambda: torch.autograd.grad(diff, wrt, gouts, retain_graph=True, allow_unused=True),
                             dev, warmup, repeats)
    outs = diff = gouts = None  # free the timing graph (the lambda's cells) before the memory run
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    outs, rf, rb, live = run_once(layer, state, xs)
    peak = max(live, default=0)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev) - base
    mem = _layer_memory(graph, layer, xs, outs, later)
    flops = [sum(o.flops for o in rf.ops), sum(o.flops for o in rb.ops)]
    outs = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)
    return [fwd_t, bwd_t, *mem, max(peak, 0), *flops], outs


def _measure(graph: LayerGraph, inputs: dict, dev: torch.device, warmup: int, repeats: int,
             progress: bool) -> CostTable:
    """CostTable from running each layer alone on `dev`."""
    env: dict[str, Any] = {k: v.to(dev) for k, v in inputs.items()}
    later = _later_inputs(graph)
    rows, start = [], time.perf_counter()
    for layer in graph.layers:
        _progress(progress, layer.index, len(graph.layers), start, "measuring")
        row, outs = _measure_layer(graph, layer, [env[n] for n in layer.inputs], later[layer.index], dev,
                                   warmup, repeats)
        env.update(zip(layer.outputs, outs))
        rows.append(row)
    _progress(progress, len(graph.layers), len(graph.layers), start, "measuring")
    cols = list(zip(*rows))
    keys = ("fwd", "bwd", "param_bytes", "grad_bytes", "act_bytes", "saved_bytes", "peak_bytes",
            "fwd_flops", "bwd_flops")
    return CostTable.from_lists(**dict(zip(keys, cols)), names=[layer.name for layer in graph.layers])


def estimate_costs(graph: LayerGraph, example: Any, *, mode: str = "measure", device: str | torch.device | None = None,
                   hardware: Hardware | None = None, microbatches: int = 1, symbolic: bool = False,
                   warmup: int = 1, repeats: int = 5, progress: bool = True, memory_budget: int | None = None):
    """Per-layer, per-microbatch costs of a traced model.

    Args:
        graph: from `rpcompile.passes.trace`.
        example: one global batch (as given to trace); costs are for its first of
            `microbatches` slices along dim 0.
        mode: "measure" (run each layer on `device`) or "predict" (count ops on `meta`,
            roofline on `hardware`; works for models built on `meta`).
        device: measure mode's device (default CUDA if available, else CPU).
        hardware: predict mode's Hardware (required there), e.g. `Hardware.preset("rtx4090")`.
        microbatches: how many microbatches the example is split into.
        symbolic: predict only; return a `SymbolicCosts` (costs as sympy expressions in B, S).
        warmup, repeats: measure mode's timing loop (median of `repeats`).
        progress: print "layer i/L, elapsed" to stderr when it is a terminal.
        memory_budget: device bytes per worker; if even one layer per stage does not fit it, refuse
            (pass it for the graph that will be partitioned, i.e. after `shard_lm_head`).
    Returns:
        A CostTable (or a SymbolicCosts if `symbolic`).
    Raises:
        ValueError: bad mode, missing hardware, indivisible batch, an uncountable layer (named), or a
            layer that does not fit `memory_budget` (names the layer, each term's bytes and the budget).

    >>> t = estimate_costs(g, batch, mode="predict", hardware=Hardware.preset("rtx4090"))
    >>> print(t)   # one row per layer, totals at the bottom
    """
    if mode not in ("measure", "predict"):
        raise ValueError(f"mode must be 'measure' or 'predict', got {mode!r}")
    if mode == "predict" and hardware is None:
        raise ValueError("mode='predict' needs hardware=, e.g. Hardware.preset('rtx4090') or Hardware.measure()")
    inputs = split_microbatch(graph, example, microbatches)
    if symbolic:
        if mode != "predict":
            raise ValueError("symbolic=True needs mode='predict'")
        from rpcompile.passes.symbolic import symbolic_costs
        return symbolic_costs(graph, inputs, hardware, progress=progress)
    if mode == "predict":
        table = _predict(graph, inputs, hardware, progress)
    else:
        dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        table = _measure(graph, inputs, dev, warmup, repeats, progress)
    if memory_budget is not None:
        from rpcompile.passes._seqlen import memory_refusal
        why = memory_refusal(table, memory_budget)
        if why is not None:
            raise ValueError(f"estimate_costs: {why}; shorten the sequences (rpcompile.max_seq_len) or raise the "
                             f"budget")
    return table
