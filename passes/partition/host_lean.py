"""`host_lean`: a plan with its backward stages as wide as the device allows, for runs whose host is short.

The partitioner ranks plans by time alone. Each backward stage keeps one saved input per microbatch
on the host, from its forward to its backward, so at long sequences the plan it picks can need more
host memory than the server has while a plan with fewer, wider backward stages would fit. `compile`
then falls back to this one (`rpcompile.pipeline`): the partitioner's forward stages and fused stage,
and backward windows grown greedily from the last backward layer down, each as wide as a worker holds
(`widest_backward`: the backward-stage terms of `StagePlan.stage_memory`, with the prefetched stage
bounded by a parameter size), checked with `stage_memory` itself at the run's worker count. A plan
with fewer backward stages also holds fewer saved inputs inside its forward stages on the device, so
the forward stages that fitted still fit.

It is slower than the partitioner's plan (its backward stages are not balanced), and faster than no
run at all. `max_seq_len` counts with the same windows (`passes.cost.seqlen_model`).

    >>> from rpcompile.ir.costs import CostTable
    >>> c = CostTable.from_lists([1.0] * 5, [2.0] * 5, param_bytes=[10] * 5, grad_bytes=[10] * 5,
    ...                          saved_bytes=[4] * 5, act_bytes=[4] * 5)
    >>> host_lean(StagePlan.from_str("2,2|1|1,1,1,1"), c, gpus=2, memory_budget=90).to_str()
    '2,2|1|2,2'
"""
from __future__ import annotations

from rpcompile.ir.costs import CostTable
from rpcompile.ir.plan import StagePlan

__all__ = ["host_lean", "widest_backward"]


def widest_backward(costs: CostTable, cap: int | None, layers: int, fetch: int) -> list[int]:
    """Backward stage sizes in execution order over layers [0, layers), each window grown from its top layer
    down while its backward-stage bytes fit `cap` (None: no limit): its layers' parameters, gradients and
    workspace, `fetch` bytes prefetched, its saved input and the one uploaded next, its output gradient in and
    the next, and the gradient it sends down. A layer that does not fit alone is a stage of its own (the
    caller's exact check refuses the plan)."""
    pre = [0]
    for i in range(layers):
        pre.append(pre[-1] + costs.param_bytes[i] + costs.grad_bytes[i] + costs.peak_bytes[i])

    def need(lo: int, hi: int) -> int:
        return (pre[hi + 1] - pre[lo] + fetch + 2 * costs.saved_bytes[lo] + 2 * costs.act_bytes[hi]
                + (costs.act_bytes[lo - 1] if lo else 0))

    sizes, hi = [], layers - 1
    while hi >= 0:
        lo = hi
        while lo > 0 and (cap is None or need(lo - 1, hi) <= cap):
            lo -= 1
        sizes.append(hi - lo + 1)
        hi = lo - 1
    return sizes


def host_lean(plan: StagePlan, costs: CostTable, *, gpus: int, memory_budget: int | None) -> StagePlan | None:
    """`plan` with its backward stages replaced by the widest that fit the device (module doc), or None if that
    keeps no fewer backward stages or does not fit (`stage_memory` at `gpus` workers over `memory_budget`).

    The prefetch is first bounded by the largest layer's parameters, then, if the plan does not fit, by the
    largest stage's of that plan (the windows only narrow, so that bound holds for the second try)."""
    fused, layers = len(plan.fused), sum(len(s) for s in plan.bwd)
    fetch = max(costs.param_bytes)
    for _ in range(2):
        bwd = widest_backward(costs, memory_budget, layers, fetch)
        if len(bwd) >= len(plan.bwd):
            return None
        lean = StagePlan.from_sizes([len(s) for s in plan.fwd], fused, bwd)
        widest = max(fetch, *(_params(costs, r) for r in lean.bwd))
        lean = StagePlan.from_sizes(_split(costs, plan.fwd, widest), fused, bwd)
        if memory_budget is None or max(lean.stage_memory(costs, gpus=gpus)) <= memory_budget:
            return lean
        fetch = max(_params(costs, s.layers) for s in lean.stages)
    return None


def _params(costs: CostTable, layers: range) -> int:
    """The parameter bytes of `layers`."""
    return sum(costs.param_bytes[i] for i in layers)


def _split(costs: CostTable, fwd: tuple[range, ...], cap: int) -> list[int]:
    """Forward stage sizes: each of `fwd` cut, from its first layer up, into stages of at most `cap` parameter
    bytes (a layer over it alone), so that no forward stage prefetched by a backward one holds more parameters
    than the backward stages themselves."""
    sizes = []
    for r in fwd:
        n = have = 0
        for i in r:
            if n and have + costs.param_bytes[i] > cap:
                sizes.append(n)
                n = have = 0
            n, have = n + 1, have + costs.param_bytes[i]
        sizes.append(n)
    return sizes
