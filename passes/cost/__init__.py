"""The `estimate_costs` pass: LayerGraph + example -> CostTable (per layer, per microbatch).

The third pass of the pipeline (trace -> shard_lm_head -> estimate_costs -> partition -> emit -> verify).
This folder holds it and what it is built from:

    count.py         counting a layer's aten ops and memory on `meta` (predict mode's raw data)
    recorder.py      the op recorder of both modes: FLOPs and bytes per aten op, live device memory
    symbolic.py      costs as exact formulas in the microbatch size B and sequence length S
    seqlen.py        `max_seq_len`: the longest sequence whose training fits, and the term that stops it
    seqlen_model.py  what that search asks at each length: the device and host bytes of a plan
    stage_memory.py  a stage's device bytes by term, and the refusal message when no plan fits
    host_bytes.py    host memory of a run: what the host state and the activation store hold

Two modes:
- "measure": run each layer alone on a device with the microbatch inputs that the
  previous layers produced, time forward and backward (robust to a loaded machine:
  see Note: timing) and account the memory it really allocates.
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
    `meta.attention.py`). A chunk loop (the sequence-chunked LM head) is one op
    per loop position with summed FLOPs and bytes and one launch per iteration.
    FLOPs come from `meta.attention.FLOP_RULES` and `meta.moe.GROUPED_MM_FLOPS`, else torch's
    `flop_registry`.

    Memory columns (both modes): `act_bytes` = outputs read by a later layer;
    `saved_bytes` = the layer's inputs (kept for the recompute); `peak_bytes` =
    the most bytes live at once on top of the layer's parameters and inputs
    during its forward + backward: autograd's saved tensors, outputs, output
    gradients, every backward transient and the input gradients (parameter
    gradients are `grad_bytes`). Both modes follow every storage's lifetime
    with the same recorder (`recorder.py`), on meta or on real tensors; on
    CUDA measure mode reads the allocator's peak above the layer's resident
    state instead. A layer that cannot run on `meta` (data-dependent ops) is
    retried with fake tensors, then for real on the CPU with random weights if
    its parameters are small (a warning names it); otherwise a ValueError
    names it.

Note: timing (measure mode). The same model compiled in fresh processes on a
    loaded machine must get the same plan, so the times are made robust:
    - Layers that run the same ops (the recorded op sequence: names, FLOPs,
      bytes, dtypes, forward and backward) are timed once and share the
      times: identical decoder blocks get equal costs, not equal-up-to-noise.
    - A sample is one forward and then one backward of that forward, as in
      training; after warm-up passes, `repeats` passes are timed. On the
      CPU a pass samples every distinct layer in turn, so all of them (and a
      layer's forward and backward) are timed under the same load: their
      ratios decide the stage groupings. On CUDA each distinct layer is
      timed when it is reached, so only its weights are on the device.
    - Load only adds time, so a sample more than 50% above the fastest of its
      kind is an outlier: that layer is sampled again (up to 3 rounds), and
      the time is the median of the samples that are not outliers.
    - On the CPU the timing runs with `cpu_threads` intra-op threads (default
      1) and, with one thread, counts the CPU time of the timing thread
      (`time.thread_time`): on a loaded machine an intra-op worker thread
      waits a scheduler tick (4-8 ms) for a core at every parallel region,
      which made small layers 10-100x slow at random; waiting is not the
      layer's cost. One core per layer is also what each of N host workers
      gets on N cores; with fewer workers than cores, layers that would use
      several cores are priced as if they had one.
    - On CUDA: the wall clock, with a synchronize around each call.
    `bench/plan_stability.py` checks it (`docs/bench/plan_stability.md`).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch

from rpcompile.ir.costs import CostTable
from rpcompile.ir.graph import Layer, LayerGraph
from rpcompile.ir.hardware import Hardware, fp16_gemms
from rpcompile.passes.cost.stage_memory import memory_refusal
from rpcompile.passes.cost.symbolic import symbolic_costs
from rpcompile.passes.cost.count import (LayerCount, OpCount, _later_inputs, _layer_memory, _leaf, _progress,
                                     _random_cpu, _state, count_layers, run_once, split_microbatch)
from rpcompile.passes.cost.recorder import op_rate, priced

__all__ = ["estimate_costs", "OpCount", "LayerCount", "count_layers", "split_microbatch", "layer_times"]


def layer_times(ops: Sequence[OpCount], hardware: Hardware, fp16_accumulation: bool = False) -> float:
    """Predicted seconds of a sequence of ops: per-op roofline plus a launch latency per kernel (see module Note).

    Args:
        ops: recorded ops (`count_layers`); a fused region counts in the form `hardware` runs (`priced`).
        hardware: prices them.
        fp16_accumulation: fp16 GEMMs run at the fp16-accumulate rate (`recorder.op_rate`).
    Returns:
        Seconds.
    """
    run = priced(ops, hardware)
    return (sum(hardware.roofline(o.flops, o.bytes, op_rate(o, fp16_accumulation)) for o in run)
            + sum(o.launches for o in run) * hardware.op_latency)


def _flops(ops: Sequence[OpCount]) -> int:
    """FLOPs of recorded ops, a fused region counted once."""
    return sum(o.flops for o in ops if o.form != "fused")


def _predict(graph: LayerGraph, inputs: dict, hardware: Hardware, progress: bool,
             fp16_accumulation: bool = False, counted: dict | None = None) -> CostTable:
    """CostTable from counted ops priced on `hardware` (`counted`: as `count_layers`)."""
    counts = count_layers(graph, inputs, progress=progress, counted=counted)
    priced: dict[int, float] = {}  # id of an ops tuple -> its time: layers counted once share theirs

    def times(ops: Sequence[OpCount]) -> float:
        if id(ops) not in priced:
            priced[id(ops)] = layer_times(ops, hardware, fp16_accumulation)
        return priced[id(ops)]
    return CostTable.from_lists(
        fwd=[times(c.fwd_ops) for c in counts], bwd=[times(c.bwd_ops) for c in counts],
        param_bytes=[c.param_bytes for c in counts], grad_bytes=[c.grad_bytes for c in counts],
        act_bytes=[c.act_bytes for c in counts], saved_bytes=[c.saved_bytes for c in counts],
        peak_bytes=[c.peak_bytes for c in counts], names=[layer.name for layer in graph.layers],
        fwd_flops=[_flops(c.fwd_ops) for c in counts], bwd_flops=[_flops(c.bwd_ops) for c in counts])


def _robust_times(samplers: Sequence[Callable[[], tuple[float, ...]]], warmup: int, repeats: int, *,
                  tol: float = 0.5, rounds: int = 3, cap_s: float = 3.0) -> list[list[float]]:
    """Robust seconds of each sampler's kinds (see `estimate_costs`, Note: timing).

    A sampler times one call of each of its kinds (a layer: one forward, then one backward of
    that forward) and returns the seconds. `warmup` untimed passes, then `repeats` timed passes;
    a pass calls every sampler once, in order, so all are timed under the same load. Load only
    adds time, so a sample more than `tol` above the fastest of its kind is an outlier: the
    sampler is called again for each pass holding one, up to `rounds` times, and each kind's
    result is the median of its samples that are not outliers. A sampler that has spent `cap_s`
    seconds is called no more (after at least 2 passes if `repeats` >= 2; at least 1 pass).
    """
    repeats = max(1, repeats)
    for _ in range(warmup):
        for sample in samplers:
            sample()
    runs: list[list[tuple[float, ...]]] = [[] for _ in samplers]
    spent = [0.0] * len(samplers)

    def call(k: int) -> tuple[float, ...]:
        got = samplers[k]()
        spent[k] += sum(got)
        return got

    for _ in range(repeats):
        for k in range(len(samplers)):
            if spent[k] <= cap_s or len(runs[k]) < 2:
                runs[k].append(call(k))
    out = []
    for k, r in enumerate(runs):
        for _ in range(rounds):
            fastest = [min(col) for col in zip(*r)]
            slow = [i for i, got in enumerate(r) if any(t > (1 + tol) * f for t, f in zip(got, fastest))]
            if not slow or spent[k] > cap_s:
                break
            for i in slow:
                r[i] = call(k)
        out.append([statistics.median([t for t in col if t <= (1 + tol) * min(col)]) for col in zip(*r)])
    return out


def _layer_sampler(layer: Layer, state: dict, xs: list, dev: torch.device,
                   clock: Callable[[], float], split: bool = False) -> Callable[[], tuple[float, float]]:
    """A sampler for `_robust_times`: (seconds of one forward, seconds of the backward of that forward).

    The output gradients (ones) are made between the two, untimed; a layer with nothing to
    differentiate has a backward of 0 s. With `split` (a layer that takes gradients in its forward,
    `meta.regions.grad_region`), a forward without autograd is timed too: it is the forward (what an
    F stage runs), and the rest of the forward with autograd counts with the backward.
    """
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda d: None)
    wrt = [t for t in [*xs, *state.values()] if isinstance(t, torch.Tensor) and t.requires_grad]

    def sample() -> tuple[float, float]:
        fwd, bwd = timed()
        if not split:
            return fwd, bwd
        with torch.no_grad():
            sync(dev)
            t0 = clock()
            torch.func.functional_call(layer.module, state, tuple(xs))
            sync(dev)
            plain = clock() - t0
        return plain, max(fwd - plain, 0.0) + bwd

    def timed() -> tuple[float, float]:
        with torch.enable_grad():
            sync(dev)
            t0 = clock()
            outs = tuple(torch.func.functional_call(layer.module, state, tuple(xs)))
            sync(dev)
            t1 = clock()
            diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
            if not (diff and wrt):
                return t1 - t0, 0.0
            gouts = [torch.ones_like(o) for o in diff]
            sync(dev)
            t2 = clock()
            torch.autograd.grad(diff, wrt, gouts, allow_unused=True)
            sync(dev)
            return t1 - t0, clock() - t2

    return sample


def _measure_layer(graph: LayerGraph, layer: Layer, inputs: list, later: set[str], dev: torch.device,
                   clock: Callable[[], float]) -> tuple[list, tuple, tuple, Callable[[], tuple[float, float]]]:
    """([param, grad, act, saved, peak bytes, fwd flops, bwd flops], outputs, op key, timing sampler).

    The op key is the recorded op sequence (forward, backward) and which inputs need gradients:
    layers with equal keys run the same kernels and are timed once.
    """
    state = _state(layer, lambda t: _random_cpu(t).to(dev) if t.is_meta else t.detach().to(dev))
    grads = [graph.values[n].requires_grad if n in graph.values else False for n in layer.inputs]
    xs = [_leaf(t, g) if isinstance(t, torch.Tensor) else t for t, g in zip(inputs, grads)]
    sampler = _layer_sampler(layer, state, xs, dev, clock)
    if dev.type == "cuda":  # lazy initialisation (cuBLAS workspaces) must not count in the memory run
        sampler()
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    outs, rf, rb, live = run_once(layer, state, xs)
    if rf.grad_ops:  # gradients taken in the forward: time the forward an F stage runs apart
        sampler = _layer_sampler(layer, state, xs, dev, clock, split=True)
    peak = max(live, default=0)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev) - base
    mem = _layer_memory(graph, layer, xs, outs, later)
    bwd_ops = tuple(rf.grad_ops) + tuple(rb.ops)  # forward-time gradients count with the backward
    flops = [_flops(rf.ops), _flops(bwd_ops)]
    outs = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)
    return [*mem, max(peak, 0), *flops], outs, (tuple(rf.ops), bwd_ops, tuple(grads)), sampler


def _measure(graph: LayerGraph, inputs: dict, dev: torch.device, warmup: int, repeats: int,
             progress: bool, cpu_threads: int | None = None) -> CostTable:
    """CostTable from running each layer alone on `dev` (timing: see `estimate_costs`, Note: timing).

    On CUDA each distinct layer is timed when it is reached (its weights then leave the device);
    on the CPU all distinct layers are timed together at the end, pass by pass.
    """
    env: dict[str, Any] = {k: v.to(dev) for k, v in inputs.items()}
    later = _later_inputs(graph)
    rows, keys, start = [], [], time.perf_counter()
    times: dict[tuple, list[float]] = {}  # op key -> [fwd s, bwd s]
    pending: dict[tuple, Callable[[], tuple[float, float]]] = {}  # CPU: timed together at the end
    threads, clock = torch.get_num_threads(), time.perf_counter
    if dev.type == "cpu" and cpu_threads:
        torch.set_num_threads(cpu_threads)
        if cpu_threads == 1:  # all the work runs on this thread: count its CPU time, not the wall clock
            clock = time.thread_time
    try:
        for layer in graph.layers:
            _progress(progress, layer.index, len(graph.layers), start, "measuring")
            row, outs, key, sampler = _measure_layer(graph, layer, [env[n] for n in layer.inputs],
                                                     later[layer.index], dev, clock)
            if key not in times and key not in pending:
                if dev.type == "cuda":
                    times[key] = _robust_times([sampler], warmup, repeats)[0]
                else:
                    pending[key] = sampler
            env.update(zip(layer.outputs, outs))
            rows.append(row)
            keys.append(key)
        times.update(zip(pending, _robust_times(list(pending.values()), warmup, repeats)))
    finally:
        torch.set_num_threads(threads)
    _progress(progress, len(graph.layers), len(graph.layers), start, "measuring")
    cols = list(zip(*[[*times[k], *row] for k, row in zip(keys, rows)]))
    names = ("fwd", "bwd", "param_bytes", "grad_bytes", "act_bytes", "saved_bytes", "peak_bytes",
             "fwd_flops", "bwd_flops")
    return CostTable.from_lists(**dict(zip(names, cols)), names=[layer.name for layer in graph.layers])


def estimate_costs(graph: LayerGraph, example: Any, *, mode: str = "measure", device: str | torch.device | None = None,
                   hardware: Hardware | None = None, microbatches: int = 1, symbolic: bool = False,
                   warmup: int = 1, repeats: int = 5, progress: bool = True, memory_budget: int | None = None,
                   cpu_threads: int | None = 1, fp16_accumulation: bool = False, counted: dict | None = None):
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
        warmup, repeats: measure mode's timing loop (warm-up passes, then the median of `repeats`
            passes, outliers timed again; see Note: timing).
        progress: print "layer i/L, elapsed" to stderr when it is a terminal.
        memory_budget: device bytes per worker; if even one layer per stage does not fit it, refuse
            (pass it for the graph that will be partitioned, i.e. after `shard_lm_head`).
        cpu_threads: intra-op threads while timing on the CPU (default 1: the thread's CPU time is
            counted; None: torch's setting and the wall clock).
        fp16_accumulation: the run accumulates fp16 GEMMs in fp16: predict mode prices them at the
            hardware's "float16/float16" rate, measure mode on CUDA times them with the flag on.
        counted: predict mode (not symbolic): the layers counted so far, as `count_layers`'s (one dict
            across calls on graphs of the same model and batch runs each distinct layer once).
    Returns:
        A CostTable (or a SymbolicCosts if `symbolic`).
    Raises:
        ValueError: bad mode, missing hardware, indivisible batch, an uncountable layer (named), or a
            layer that does not fit `memory_budget` (names the layer, each term's bytes and the budget).

    >>> import torch; from transformers import LlamaConfig, LlamaForCausalLM
    >>> _ = torch.manual_seed(0)
    >>> llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=128, attn_implementation="eager"))
    >>> from rpcompile.passes import trace
    >>> ids = torch.randint(0, 128, (2, 16)); batch = {"input_ids": ids, "labels": ids}
    >>> g = trace(llama, batch)
    >>> t = estimate_costs(g, batch, mode="predict", hardware=Hardware.preset("rtx4090"))
    >>> print(t)   # one row per layer, totals at the bottom  # doctest: +ELLIPSIS
    #    layer               fwd       bwd       params     grads ...
    0    model.embed_tokens  0.050 ms  0.005 ms  16.0 KiB   16.0 KiB ...
    4    lm_head             0.025 ms  0.020 ms  16.0 KiB   16.0 KiB ...
         total               0.626 ms  0.857 ms  104.6 KiB  104.6 KiB ...
    """
    if mode not in ("measure", "predict"):
        raise ValueError(f"mode must be 'measure' or 'predict', got {mode!r}")
    if mode == "predict" and hardware is None:
        raise ValueError("mode='predict' needs hardware=, e.g. Hardware.preset('rtx4090') or Hardware.measure()")
    inputs = split_microbatch(graph, example, microbatches)
    if symbolic:
        if mode != "predict":
            raise ValueError("symbolic=True needs mode='predict'")
        return symbolic_costs(graph, inputs, hardware, progress=progress, fp16_accumulation=fp16_accumulation)
    if mode == "predict":
        table = _predict(graph, inputs, hardware, progress, fp16_accumulation, counted)
    else:
        dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        with fp16_gemms(dev.type == "cuda" and fp16_accumulation):
            table = _measure(graph, inputs, dev, warmup, repeats, progress, cpu_threads)
    if memory_budget is not None:
        why = memory_refusal(table, memory_budget)
        if why is not None:
            raise ValueError(f"estimate_costs: {why}; shorten the sequences (rpcompile.max_seq_len) or raise the "
                             f"budget")
    return table
