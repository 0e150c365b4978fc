"""`max_seq_len`: the longest sequence whose training fits, and the term that stops it.

The search lives here; what it searches, the device and host bytes of a plan at a length (the two
constraints, what each counts and where the host term is an estimate), is `seqlen_model.py`'s
`SeqLenModel` and its module Note.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from rpcompile.ir.graph import LayerGraph
from rpcompile.ir.hardware import Hardware
from rpcompile.passes.cost.seqlen_model import SeqLenLimit, SeqLenModel
from rpcompile.passes.shard_head import shard_lm_head
from rpcompile.passes.cost.symbolic import SymbolicCosts, _default_inputs, chunk_unit, symbolic_costs

__all__ = ["SeqLenLimit", "max_seq_len", "seq_len_costs", "units_limit"]


def seq_len_costs(graph: LayerGraph, hardware: Hardware, *, memory_budget: int | None = None,
                  usable: float = 0.9, example: Any = None, optimizer: Any = None,
                  shard: tuple[int, int] | None = None, batch: int | None = None) -> SymbolicCosts:
    """The symbolic costs `max_seq_len` solves: `graph` with its LM head sharded and chunked first, as compile does.

    Args:
        graph: the traced model; a not yet sharded LM head is sharded into shards no bigger than
            the largest other layer and chunked for the device budget (`shard_lm_head(..., chunk="auto",
            memory_budget=)`).
        hardware: prices the ops; its device memory sets the default budget.
        memory_budget: device bytes per worker (default `usable * hardware.device_memory`), as `compile`'s
            option: the stages get it less the BLAS workspace (`Hardware.stage_budget`).
        example: a batch to fit at (default zeros shaped like the trace's).
        optimizer: the run's optimizer (default AdamW()): its state and master dtypes set the parameter
            state's host bytes.
        shard: (rank, world): the masters and moments are sharded over `world` servers and the parameter
            state's host bytes are server `rank`'s (`host_bytes(shard=)`); None: the whole state.
        batch: fit at this microbatch size only (`symbolic_costs(batch=)`: 4 counts of the model instead of 7,
            exact at that B); `max_seq_len` then takes that `microbatch_size` only. None: any B.
    Returns:
        A SymbolicCosts; pass it to `max_seq_len` as often as needed (it is the slow part).

    >>> sc = seq_len_costs(graph, Hardware.preset("rtx4090"))   # doctest: +SKIP
    """
    budget = hardware.stage_budget(memory_budget, usable)
    graph = _head_by_bytes(graph, budget)
    inputs = graph.flatten_inputs(example) if example is not None else _default_inputs(graph)
    return symbolic_costs(graph, inputs, hardware, optimizer=optimizer, shard=shard, batch=batch)


def max_seq_len(graph_or_costs: LayerGraph | SymbolicCosts, hardware: Hardware, *, gpus: int | None = None,
                example: Any = None, microbatch_size: int = 1, microbatches: int | None = None,
                memory_budget: int | None = None, host_memory: int | None = None, usable: float = 0.9,
                limit: int = 1 << 24, optimizer: Any = None, shard: tuple[int, int] | None = None,
                above: int = 0) -> SeqLenLimit:
    """Largest sequence length S whose training fits the device and host memory, and what binds.

    Args:
        graph_or_costs: a SymbolicCosts, or a LayerGraph (its LM head is sharded and chunked as
            `compile` does if it is not yet, then fitted in predict mode).
        hardware: device_memory, host_memory (and gpus if `gpus` is None).
        gpus: workers N (default `hardware.gpus`); it only changes the host term.
        example: for a LayerGraph, a batch to fit at (default zeros shaped like the trace's).
        microbatch_size: sequences per microbatch (B).
        microbatches: per iteration (default N); sets the round size, so the microbatches in flight.
        memory_budget: device bytes per worker (default `usable * hardware.device_memory`), as `compile`'s
            option: a stage must fit it less the BLAS workspace (`Hardware.stage_budget`), as compile's do.
        host_memory: host bytes (default `hardware.host_memory`), all of it available: the limit
            `compile` checks the run against (`rpcompile.hostmem`). The host term is an estimate, not that
            check's count (`seqlen_model`'s Note): near a host-bound limit, try the length with `plan --seq`.
        usable: the share of the device memory a worker may use (the default budget), as `compile`'s.
        limit: the largest S tried.
        optimizer: for a LayerGraph, the run's `rpcompile.AdamW` / `SGD` (default AdamW()): its state and
            master dtypes set the parameter state's host bytes (a SymbolicCosts has them already:
            `seq_len_costs(..., optimizer=)`).
        shard: for a LayerGraph, (rank, world) of a run whose masters and moments are sharded over `world`
            data-parallel servers: the host term counts server `rank`'s share, as the admission check of
            that run does (`rpcompile.hostmem.check_host_memory(shard=)`); a SymbolicCosts has it already.
        above: search the lengths above this one only (they are the ones this graph runs at: `compile` cuts
            the decoder blocks into sub-blocks only at lengths where a whole block no longer fits a worker,
            `rpcompile.models.presets.seq_len_limit`); the answer is `above` itself if `above + 1` does not fit.
    Returns:
        A SeqLenLimit: `.length` (0 if even S = 1 does not fit), `.binding` (the constraint the
        next length breaks and its largest term), `.bytes`, `.capacity`, `.terms`; `str()` reads well.

    >>> print(max_seq_len(graph, Hardware.preset("rtx4090"), gpus=8))   # doctest: +SKIP
    74,752 tokens; at 74,753 the device: backward stage of layer 5 ... needs 21.6 GiB > 21.6 GiB (...)
    """
    n_gpu = gpus or hardware.gpus
    device_cap = hardware.stage_budget(memory_budget, usable)
    host_cap = host_memory if host_memory is not None else hardware.host_memory
    if microbatch_size < 1 or n_gpu < 1:
        raise ValueError(f"microbatch_size and gpus must be >= 1, got {microbatch_size} and {n_gpu}")
    if above < 0 or above >= limit:
        raise ValueError(f"max_seq_len: above must be in [0, limit = {limit:,}), got {above!r}")
    sc = graph_or_costs
    if isinstance(sc, LayerGraph):
        sc = seq_len_costs(sc, hardware, memory_budget=memory_budget, usable=usable, example=example,
                           optimizer=optimizer, shard=shard, batch=microbatch_size)  # at this B alone: 4 counts
    elif optimizer is not None or shard is not None:
        arg = "optimizer=" if optimizer is not None else "shard="
        raise ValueError(f"max_seq_len: {arg} is for a LayerGraph; a SymbolicCosts has the parameter state of the "
                         "optimizer and shard it was fitted for (seq_len_costs(..., optimizer=, shard=))")
    if not isinstance(sc, SymbolicCosts):
        raise TypeError(f"max_seq_len needs a LayerGraph or SymbolicCosts, got {type(sc).__name__}")
    return _search(sc, microbatch_size, n_gpu, microbatches, device_cap, host_cap, limit, above)


def units_limit(blocks: LayerGraph, sub_blocks: Callable[[], LayerGraph | None], hardware: Hardware,
                **kwargs: Any) -> SeqLenLimit:
    """`max_seq_len` with the layer units compile uses at each length.

    Note: compile traces the decoder blocks as layers and cuts them into sub-blocks (norms, attention,
    MLP: `passes.trace.sublayer_units`) only at lengths where a whole block no longer fits a worker
    (`rpcompile.pipeline`); sub-blocks mean more cuts, so more saved inputs on the host per token. So the
    limit is found with whole blocks first; if the device is what stops them, the lengths above are searched
    with sub-blocks (`max_seq_len(above=)`), and the answer is where that stops (the whole-block length
    itself if the sub-blocks' host need is already too much one token above it).

    Args:
        blocks: the model traced with its decoder blocks as layers (the LM head sharded or not).
        sub_blocks: traces it cut into sub-blocks, called only if needed; None if it has no blocks to cut.
        hardware, kwargs: as `max_seq_len` (not `above`).
    """
    found = max_seq_len(blocks, hardware, **kwargs)
    if not found.binding.startswith("device"):
        return found  # the host (or the search limit) stops it while whole blocks still fit
    sub = sub_blocks()
    if sub is None:  # no decoder blocks to cut: compile refuses the longer lengths too
        return found
    past = max_seq_len(sub, hardware, above=found.length, **kwargs)
    if past.length > found.length:
        return past
    return replace(past, binding=f"{past.binding}, with the decoder blocks cut into sub-blocks (whole, they no "
                                 f"longer fit a worker)")


def _search(sc: SymbolicCosts, b: int, gpus: int, microbatches: int | None, device_cap: int, host_cap: int,
            limit: int, above: int) -> SeqLenLimit:
    """The longest S in (above, limit] that fits `SeqLenModel(sc)`: with the greedy windows' host term (a doubling
    then a bisection), then, where the host stops those, the lengths above with the partitioner's plan priced
    too (`SeqLenModel.host`; a step doubled from there, then a bisection). Assumes that a length fits when a longer
    one does."""
    model = SeqLenModel(sc, b, gpus, microbatches or gpus)

    def fits(s: int, partitioned: bool = False) -> bool:
        return model.explain(s, device_cap, host_cap, partitioned) is None

    if not fits(above + 1):
        return model.explain(above + 1, device_cap, host_cap)
    lo, hi = above + 1, 2 * (above + 1)
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    lo = _bisect(fits, lo, min(hi, limit + 1))
    found = model.explain(lo + 1, device_cap, host_cap) if lo < limit else None
    if found is not None and found.binding.startswith("host"):  # the greedy windows' host need stops them
        lo = _refine(model, lo, limit, device_cap, host_cap)
        found = model.explain(lo + 1, device_cap, host_cap, True) if lo < limit else None
    return found or SeqLenLimit(lo, f"the search limit {limit:,}", 0, 0)


def _refine(model: SeqLenModel, lo: int, limit: int, device_cap: int, host_cap: int) -> int:
    """The longest length in [lo, limit] that fits with the partitioner's plan priced too, given that lo fits.

    A partition per length tried is the cost (0.1-0.3 s for the paper models in sub-blocks), so the lengths
    tried are predicted: the plan the partitioner picks at the first length not known to fit keeps fitting
    (device and host, `SeqLenModel.holds`) up to some length, where the partitioner usually changes its plan;
    that length is tried, and the search goes on from the next, or bisects below it if it does not fit.
    Where a plan gives no prediction (it fits at its own length only), a step doubled, then a bisection.
    Assumes that a length fits when a longer one does.
    """
    end = limit + 1

    def fits(s: int) -> bool:
        return model.explain(s, device_cap, host_cap, True) is None

    while lo + 1 < end:
        s = lo + 1
        if not fits(s):
            return lo
        plan = model.partitioned(s, device_cap)
        if not model.holds(plan, s, device_cap, host_cap):  # no prediction from this plan
            step = 1
            while s + step < end and fits(s + step):
                s, step = s + step, 2 * step
            return _bisect(fits, s, min(s + step, end))
        far = _bisect(lambda x: model.holds(plan, x, device_cap, host_cap), s, end)
        if not fits(far):  # the partitioner's plan at `far` fits no more: the boundary is below it
            return _bisect(fits, s, far)
        lo = far
    return lo


def _bisect(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The longest length in [lo, hi) that fits, given that lo does and hi does not (or is past the limit)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _head_by_bytes(graph: LayerGraph, budget: int) -> LayerGraph:
    """`graph` with a not yet sharded LM head sharded into shards no bigger than the largest other layer and
    chunked for `budget`; `graph` itself if its head is sharded already or it has no supported LM head."""
    if chunk_unit(graph) is not None:
        return graph
    head = graph.param_bytes(graph.layers[-1])
    largest = max((graph.param_bytes(lay) for lay in graph.layers[:-1]), default=0)
    try:
        return shard_lm_head(graph, max(1, -(-head // max(largest, 1))), chunk="auto", memory_budget=budget)
    except ValueError:  # no supported LM head: nothing to shard
        return graph
