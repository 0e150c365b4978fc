"""`shard_lm_head`'s automatic choices: how many vocabulary shards, how many tokens per chunk.

Note:
    Shards (K) balance time: the head's forward + backward should take about as
    long as a median other layer, so that no stage is dominated by it.

    The chunk bounds memory: a shard's live working set while it runs one
    chunk is `LOGIT_BYTES` bytes per logit of the chunk (chunk x ceil(V/K)
    logits): the matmul's output in the training dtype, its fp32 copy, the
    exponentials and, in the backward, their gradients. `LOGIT_BYTES` is
    measured (see `tests/test_long_seq_head.py`). The chunk is the largest
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


def auto_shards(graph: LayerGraph, costs: CostTable | None, vocab: int) -> int:
    """K for shards="auto": head fwd+bwd / median fwd+bwd of the other layers (else parameter bytes), rounded up.

    >>> auto_shards(graph, CostTable.from_lists([1, 1, 3], [2, 2, 6]), vocab=100)  # doctest: +SKIP
    3
    """
    if costs is not None:
        if costs.num_layers != len(graph.layers):
            raise ValueError(f"costs has {costs.num_layers} layers, the graph {len(graph.layers)}; "
                             f"pass the CostTable of the unsharded graph")
        load = [f + b for f, b in zip(costs.fwd, costs.bwd)]
    else:
        load = [sum(graph.params[p].bytes for p in layer.params) for layer in graph.layers]
    rest = [x for x in load[:-1] if x > 0]
    ratio = load[-1] / statistics.median(rest) if rest else 0.0
    return max(1, min(vocab, math.ceil(ratio * (1 - 1e-9))))


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
