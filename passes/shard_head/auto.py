"""`shard_lm_head`'s automatic choices: how many vocabulary shards, how many tokens per chunk.

Note:
    Shards (K) balance time: the head's forward + backward should take about as
    long as a median other layer, so that no stage is dominated by it. K shapes
    the layer graph, so it is read from deterministic quantities only: every
    process that compiles the model must trace the same layers. With
    `balance="flops"` (the default, and what compile uses for measured costs)
    the load of a layer is its forward + backward FLOPs (counted from the aten
    ops: exact, the same in every process); a measured time never decides it
    (rounding a measured ratio gave different layer counts in fresh processes,
    issue 26). With `balance="time"` it is the costs' forward + backward time,
    for predicted costs (a roofline of each op's FLOPs and bytes on a hardware
    model: deterministic too, and closer to the time than FLOPs alone, which
    miss the memory-bound elementwise work). Costs without FLOPs, a head
    without FLOPs, or no costs: parameter bytes.

    K is at most the number of the other layers (those with a load): a head
    hundreds of times a layer's work (a toy model's: Qwen2.5's 151,665-token
    vocabulary on hidden 8) would otherwise become hundreds of shard layers, each
    with a layer's fixed cost to measure, plan and run, and more shards than the
    rest of the model has layers cannot balance against anything (issue 35:
    452 shards took 2.5 minutes of a 3-step run; `bench/finetune_startup.py`).
    A real model's ratio is far below its layer count (Qwen3-1.7B: about 6 of 28).

    The chunk bounds memory: a shard's live working set while it runs one
    chunk is `LOGIT_BYTES` bytes per logit of the chunk (chunk x ceil(V/K)
    logits): the matmul's output in the training dtype, its fp32 copy, the
    exponentials and, in the backward, their gradients. `LOGIT_BYTES` is
    measured (see `tests/passes/shard_head/test_long_seq_head.py`). The chunk is the largest
    multiple of 64 tokens whose working set fits an eighth of the memory budget
    (the rest holds the stage's parameters, the hidden input and its
    gradient); without a budget, half the largest other layer's `peak_bytes`
    (the other half covers the shard's hidden input, its gradient and the
    weight slice), so the head is not the layer that binds; without either (or
    with costs that carry no memory columns), no chunking.
"""
from __future__ import annotations

import math
import statistics

from rpcompile.ir.costs import CostTable
from rpcompile.ir.graph import LayerGraph

__all__ = ["auto_shards", "auto_chunk", "LOGIT_BYTES"]

LOGIT_BYTES = 16  # live bytes per logit of a chunk during a shard's backward (measured 16.2-16.3; module Note)


def auto_shards(graph: LayerGraph, costs: CostTable | None, vocab: int, balance: str = "flops") -> int:
    """K for shards="auto": the head's load / the median load of the other layers, rounded up (module Note),
    and at most the number of those layers.

    The load is fwd + bwd FLOPs (`balance="flops"`) or time (`"time"`, for predicted costs); parameter
    bytes without costs or FLOPs. Layers of no load are left out of the median and of the count.

    >>> auto_shards(graph, CostTable.from_lists([1, 1, 3], [2, 2, 6], fwd_flops=[0, 4, 9],
    ...             bwd_flops=[0, 8, 18]), vocab=100)  # doctest: +SKIP
    3
    """
    if balance not in ("flops", "time"):
        raise ValueError(f"balance must be 'flops' or 'time', got {balance!r}")
    if costs is not None and costs.num_layers != len(graph.layers):
        raise ValueError(f"costs has {costs.num_layers} layers, the graph {len(graph.layers)}; "
                         f"pass the CostTable of the unsharded graph")
    load = _load(graph, costs, balance)
    rest = [x for x in load[:-1] if x > 0]
    ratio = load[-1] / statistics.median(rest) if rest else 0.0
    return max(1, min(vocab, len(rest), math.ceil(ratio * (1 - 1e-9))))  # at most one shard per other layer


def _load(graph: LayerGraph, costs: CostTable | None, balance: str) -> list[float]:
    """Per-layer load for `auto_shards`: times, FLOPs, else parameter bytes."""
    if costs is not None and balance == "time":
        return [f + b for f, b in zip(costs.fwd, costs.bwd)]
    if costs is not None and costs.fwd_flops is not None and costs.bwd_flops is not None:
        flops = [f + b for f, b in zip(costs.fwd_flops, costs.bwd_flops)]
        if flops[-1] > 0:
            return flops
    return [float(sum(graph.params[p].bytes for p in layer.params)) for layer in graph.layers]


def auto_chunk(costs: CostTable | None, memory_budget: int | None, tokens: int, shard_vocab: int) -> int | None:
    """Tokens per chunk for chunk="auto" (see module Note), at most `tokens`; None without a budget or costs.

    >>> auto_chunk(None, 2**30, tokens=10**6, shard_vocab=32000)
    256
    """
    if memory_budget is not None:
        budget = memory_budget // 8
    elif costs is not None and costs.num_layers > 1 and max(costs.peak_bytes[:-1]) > 0:
        budget = max(costs.peak_bytes[:-1]) // 2
    else:  # no budget and no memory in the costs: nothing to bound the chunk by
        return None
    rows = budget // (LOGIT_BYTES * max(1, shard_vocab))
    return max(1, min(tokens, rows if rows < 64 else rows // 64 * 64))
