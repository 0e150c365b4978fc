"""The compiler pipeline: the passes compile() runs, in order, and what a checkpoint freezes of them.

    trace -> shard_lm_head -> estimate_costs -> partition -> emit -> verify -> check_host_memory

`Frozen` records the decisions that depend on measurements (the LM-head
sharding, the cost table, the plan and the round size), so loading a
checkpoint rebuilds the very same program instead of re-measuring a noisy
machine and maybe planning differently.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from rpcompile import passes
from rpcompile.batch import batch_size, check_batch
from rpcompile.hostmem import HostBytes, check_host_memory, host_bytes
from rpcompile.ir.costs import CostTable
from rpcompile.ir.graph import LayerGraph
from rpcompile.ir.hardware import Hardware
from rpcompile.ir.plan import StagePlan
from rpcompile.options import Options, default_microbatches
from rpcompile.passes.cost.stage_memory import memory_refusal
from rpcompile.passes.partition.host_lean import host_lean
from rpcompile.passes.partition.timing import default_round_size
from rpcompile.passes.trace import sublayer_units
from rpcompile.runtime import simulate, steady_iterations
from rpcompile.runtime.host.assign import assign_buffers, unshared

__all__ = ["plan_pipeline", "compile_passes", "host_need", "Frozen", "frozen_of", "MEASURED_TIE", "HOST_MEASURED_TIE",
           "measured_tie"]

# With measured costs, plans whose predicted iteration time is within this share of the fastest (even plan)
# are ties (`partition`'s tie rule: the fewest stages, then the most fused layers, then the nearest to an even
# layout; issue 26). Measured times move by a few percent between processes on a loaded machine (the decoder
# blocks' forward / backward ratio by up to 7%, sub-millisecond layers by up to 2x), which flipped near-tied
# plans (bench/plan_stability.py: the demo's two best plans were -2.9% to +3.5% apart by 15 processes' costs;
# a 3% tie still flipped 1 run of 10); the tie makes the choice stable, and a plan with fewer stages also
# hands fewer activations between workers, which the compute-only objective does not price. Predicted costs
# are deterministic and are ranked by time alone (only equal times tie).
MEASURED_TIE = 0.05
# Costs measured on the CPU (host workers) are ranked with a wider tie (issue 31). The CPU that times the layers
# is shared with everything else on the machine, and under load the layers' ratios move by far more than on a
# GPU: a small Qwen3 in 29 sub-blocks on a 2-core machine with busy loops measured its attention at 6 to 15
# times a norm and its MLP at 3.5 to 8 times from one process to the next, and the 5% tie gave 2-4 distinct
# plans in 5 processes. With 20% every process got one plan, and so did the demo and the 62-unit Llama
# (`bench/plan_stability.py`, docs/bench/plan_stability.md). The price: the plan may be up to 20% slower by
# the compute-only objective than the fastest measured plan (10-16% on that Qwen3: 3 forward stages instead
# of 7, which hand fewer activations between workers); the bench shows it per run.
HOST_MEASURED_TIE = 0.2


def measured_tie(device: str | torch.device) -> float:
    """The tie `compile` ranks costs measured on `device` with: `HOST_MEASURED_TIE` on the CPU, else `MEASURED_TIE`.

    >>> measured_tie("cpu"), measured_tie("cuda:0")
    (0.2, 0.05)
    """
    return HOST_MEASURED_TIE if torch.device(device).type == "cpu" else MEASURED_TIE


@dataclass(frozen=True)
class Frozen:
    """The compiler's measured decisions, as plain data (saved in checkpoints)."""

    plan: str            # StagePlan.to_str()
    round_size: int      # microbatches per round
    microbatches: int    # per iteration
    costs: dict          # CostTable.to_lists() of the (sharded) graph
    head: dict | None    # shard_lm_head keyword arguments that reproduce the graph; None: not sharded
    layers: list | None = None  # the layer units traced with, when not the default (sub-blocks)


def frozen_of(graph: LayerGraph, costs: CostTable, program: Any, layers: list | None = None) -> Frozen:
    """What to save so that `plan_pipeline(..., frozen=...)` rebuilds `program` exactly."""
    return Frozen(program.plan.to_str(), program.round_size, program.microbatches, costs.to_lists(),
                  _head_args(graph), None if layers is None else list(layers))


def _head_args(graph: LayerGraph) -> dict | None:
    """The shard_lm_head arguments a sharded graph was made with (its shard count and token chunk)."""
    shards = [lay for lay in graph.layers if ".shard" in lay.name and lay.name.rsplit(".shard", 1)[1].isdigit()]
    if not shards:
        return None
    chunk: Any = "auto"
    fused = False
    for node in shards[0].module.graph.nodes:  # the chunk is an argument of the shard's kernel call
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "chunked_lse":
            chunk = node.args[5] if len(node.args) > 5 else node.kwargs.get("chunk", "auto")
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "fused_ce":
            chunk, fused = node.args[6], True
    return {"shards": len(shards), "chunk": chunk, **({"fused": True} if fused else {})}


def _rebuild(model: torch.nn.Module, example: Any, opts: Options, frozen: Frozen):
    """plan_pipeline with the frozen decisions: trace and shard as before, emit the saved plan, verify, and
    check the host memory (a checkpoint may be loaded on a smaller machine)."""
    units = frozen.layers if frozen.layers is not None else opts.layers
    graph = passes.trace(model, example, loss_fn=opts.loss_fn, layers=units)
    if frozen.head:
        graph = passes.shard_lm_head(graph, **frozen.head)
    costs = CostTable.from_lists(**frozen.costs)
    plan = StagePlan.from_str(frozen.plan)
    program = passes.emit(plan, gpus=opts.gpus, microbatches=frozen.microbatches, round_size=frozen.round_size,
                          staleness=opts.staleness, costs=costs, readers=_shared_readers(graph))
    passes.verify(program, costs=costs, memory_budget=_budget(opts))
    assignment = assign_buffers(graph, program, opts.dtype)
    _check_host(graph, costs, plan, opts, frozen.microbatches, frozen.round_size, program, assignment)
    return graph, costs, plan, program, frozen.microbatches, frozen.layers, None, assignment


def _budget(opts: Options) -> int | None:
    """Device bytes per worker a plan's stages may use: the option (else 90% of the hardware's memory)
    less the hardware's cuBLAS workspaces (`Hardware.stage_budget`); without hardware the option, or none."""
    if opts.hardware is not None:
        return opts.hardware.stage_budget(opts.memory_budget)
    return opts.memory_budget


def plan_pipeline(model: torch.nn.Module, example: Any, opts: Options, *, mode: str = "measure",
                  frozen: Frozen | None = None):
    """The compiler proper: trace -> shard_lm_head -> estimate_costs -> partition -> emit -> verify ->
    check_host_memory.

    Args:
        model, example, opts: what `compile` was given.
        mode: "measure" the layers or "predict" their costs (on meta).
        frozen: the decisions of an earlier compile (from a checkpoint): the same head sharding,
            costs, plan and round size are used, nothing is measured, so the program is the same.
    Returns:
        (graph, costs, plan, program, microbatches)
    """
    return compile_passes(model, example, opts, mode=mode, frozen=frozen)[:5]


def compile_passes(model: torch.nn.Module, example: Any, opts: Options, *, mode: str = "measure",
                   frozen: Frozen | None = None, emitted: Callable[[CostTable, Any, Any], None] | None = None):
    """`plan_pipeline`, also returning the layer units it traced with (None: the default detection), the
    simulated Timeline that chose the round size (None without a hardware target or when rebuilt) and the
    program's host `BufferAssignment` (`runtime.host.assign`: what the runtime allocates for it).

    `emitted(costs, plan, program)`, if given, is called once the program is chosen and emitted, before it is
    verified and its host buffers are placed (`plan_model` starts its comparison rows there, in a child
    process, while this one goes on); not on the `frozen` path."""
    m = frozen.microbatches if frozen else opts.microbatches or default_microbatches(batch_size(example), opts.gpus)
    check_batch(example, m)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}  # measuring runs the layers: keep
    try:                                                                 # running statistics as they were
        return _rebuild(model, example, opts, frozen) if frozen else _passes(model, example, opts, m, mode, emitted)
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers and b.device.type != "meta":
                    b.copy_(buffers[n])


def _passes(model: torch.nn.Module, example: Any, opts: Options, m: int, mode: str, emitted=None):
    """The passes of `plan_pipeline`, in order.

    Note: layer units. Without `layers=`, the decoder blocks are the units. When one block does
    not fit a worker at this length (a backward stage holds its whole workspace), the blocks are
    cut into their sub-blocks (norms, attention, MLP: `passes.trace.sublayer_units`) and planned again,
    as `max_seq_len` assumes; only if that does not fit either is the run refused, with the layer,
    its bytes by term and the budget. The choice reads bytes only (`memory_refusal`: parameters and
    the recorded workspace, the same in every process) of a graph whose LM-head sharding comes from
    FLOPs (`shard_lm_head`, balance), so no measured time decides which units are traced.
    """
    budget = _budget(opts)
    graph, costs = _layers_and_costs(model, example, opts, m, mode, opts.layers, budget)
    why, units = _refusal(costs, budget), None
    if why is not None and opts.layers is None:
        try:
            units = sublayer_units(model)
        except ValueError:  # no list of decoder blocks to cut
            units = None
        if units is not None:
            graph, costs = _layers_and_costs(model, example, opts, m, mode, units, budget)
            why = _refusal(costs, budget)
    if why is not None:
        raise ValueError(f"the model does not fit a worker at this batch shape: {why}; use shorter sequences "
                         f"or fewer per microbatch (rpcompile.max_seq_len says how long fits), or a larger budget")
    # 4-5. choose the stage grouping (and, for a hardware target, the round size) and emit the program
    # (measured costs: on the device `estimate_costs` measured them on, CUDA if there is one, else the CPU)
    tie = measured_tie("cuda" if torch.cuda.is_available() else "cpu") if mode == "measure" else 0.0
    plan, program, timeline, assignment, bound = _plan_and_emit(graph, costs, opts, m, budget, tie=tie)
    if emitted is not None:
        emitted(costs, plan, program)
    # 6. check it: dependencies, coverage, the per-layer rules R1-R5, device memory
    passes.verify(program, costs=costs, memory_budget=budget)
    # 7. place the host buffers of the values crossing cuts in one arena by their live ranges (unless choosing
    # the round size did already); then host memory
    assignment = assignment or assign_buffers(graph, program, opts.dtype, unplaced=bound)
    if timeline is None:  # a simulated program was chosen among those whose run fits the host: checked already
        _check_host(graph, costs, plan, opts, m, program.round_size, program, assignment)
    return graph, costs, plan, program, m, units, timeline, assignment


def _layers_and_costs(model, example, opts: Options, m: int, mode: str, layers, budget: int | None):
    """trace -> estimate_costs -> shard_lm_head -> estimate_costs, with the layer units `layers`."""
    # 1. trace the model into layers with explicit values across every cut
    graph = passes.trace(model, example, loss_fn=opts.loss_fn, layers=layers)
    if not any(v.requires_grad for v in graph.params.values()):
        raise ValueError(f"{type(model).__name__} has no trainable parameter (requires_grad is False for all "
                         f"{len(graph.params)}): nothing to train; unfreeze some (e.g. LoRA adapters)")
    # 2. per-layer FLOPs and bytes (counted on meta: the same numbers as a measurement's) and predicted times
    counted: dict = {}  # the layers the sharded graph shares with this one are not counted again in step 3
    with warnings.catch_warnings():
        if mode == "measure":  # a layer meta cannot run is counted on the CPU: the measurement says so once
            warnings.simplefilter("ignore", UserWarning)
        probe = passes.estimate_costs(graph, example, mode="predict", microbatches=m,
                                      hardware=opts.hardware or Hardware.preset("cpu"),
                                      fp16_accumulation=opts.fp16_accumulation, counted=counted)
    # 3. cut the LM head + loss into vocabulary shards (run in token chunks sized by the budget), cost them;
    #    "auto" shards by FLOPs, or by predicted times: a measured time never changes the layer graph, so
    #    only the final graph is measured (the unsharded head's full logits never run here)
    sharded = _shard_head(graph, opts.lm_head_shards, probe, budget, balance="time" if mode == "predict" else "flops",
                          fused=opts.fused_head)
    if sharded is graph and mode == "predict" and opts.hardware is not None:
        return graph, probe
    graph = sharded
    return graph, passes.estimate_costs(graph, example, mode=mode, hardware=opts.hardware, microbatches=m,
                                        fp16_accumulation=opts.fp16_accumulation, counted=counted)


def _refusal(costs: CostTable, budget: int | None) -> str | None:
    """Why even one layer per stage does not fit `budget` (names the layer and its terms); None if it fits."""
    if budget is None:
        return None
    return memory_refusal(costs, budget)


def _plan_and_emit(graph: LayerGraph, costs: CostTable, opts: Options, m: int, budget: int | None,
                   tie: float = 0.0):
    """partition (with `tie`) + emit, at the round size chosen as the Note says: (plan, program, the
    chosen program's simulated Timeline or None without a hardware target, its BufferAssignment if checking
    the host memory built it, else None, and its `unshared` assignment if checking built that, else None:
    `assign_buffers` reuses its buffers).

    Note: round size. The partitioner's objective is the compute-only schedule time, and one round
    of all M microbatches uploads every stage's parameters once per iteration instead of M / R
    times. With a hardware target both round sizes (the default, `default_round_size`, and M) are
    emitted and the simulated faster one (with transfers and the CPU optimizer) wins, among those
    whose run fits the host memory (a round holds its microbatches' saved inputs on the host: at
    long sequences only the smaller round may fit). Without one,
    one worker takes R = M when the run still fits the host memory (one worker runs everything in
    order, so the compute time is that of any R, and the transfers shrink M / R-fold: on this
    2-core CPU 1.00-1.05x eager PyTorch instead of 0.82-0.96x at R = 1, `bench/runtime_cpu.py`;
    a round holds all M microbatches' saved inputs on the host, hence the check); more workers
    take the default.

    Note: host fallback. The partitioner ranks by time alone, and each backward stage keeps one saved
    input per microbatch in flight on the host. Where no round size's plan fits the host memory, each
    is tried again with its backward stages as wide as a worker holds (`host_lean`: fewer saved inputs),
    and the faster of those that fit wins (without a hardware target the first); its report's note says
    so. Only runs that would otherwise be refused change; `max_seq_len` counts with the same windows.
    """

    def emitted(r: int, plan: StagePlan | None = None):
        if plan is None:
            plan = passes.partition(costs, gpus=opts.gpus, microbatches=m, round_size=r, memory_budget=budget,
                                    staleness=opts.staleness, tie=tie)
        return plan, passes.emit(plan, gpus=opts.gpus, microbatches=m, round_size=r, staleness=opts.staleness,
                                 costs=costs, readers=_shared_readers(graph))
    default = default_round_size(opts.gpus, m)
    simulated = opts.hardware is not None
    if simulated:
        rounds = tuple(dict.fromkeys((default, m)))
    else:
        rounds = (m, default) if opts.gpus == 1 and m != default else (default,)
    best = None
    refused: dict[int, tuple] = {}  # round size -> the partitioner's plan, program and assignments: over the host
    for lean in (False, True):  # the partitioner's plans; if none fits the host, the host-lean ones
        for r in rounds:
            plan = None
            if lean:
                plan = host_lean(refused[r][0], costs, gpus=opts.gpus, memory_budget=budget)
                if plan is None:
                    continue
                plan = _lean_report(plan, refused[r][0], costs, opts, m, r, budget)
            plan, program = emitted(r, plan)
            fits, assignment, bound = _fits_host(graph, costs, plan, opts, m, r, program)
            if not fits:  # a round of r microbatches' saved inputs is more than the host holds: not a choice
                refused.setdefault(r, (plan, program, None, assignment, bound))
                continue
            if not simulated:  # without a hardware target the first that fits (the Note)
                return plan, program, None, assignment, bound
            k = steady_iterations(program) if opts.staleness else 1
            timeline = simulate(program, costs, opts.hardware, iterations=k)
            if best is None or timeline.steady_iteration_time < best[0]:
                best = (timeline.steady_iteration_time, plan, program, timeline, assignment, bound)
        if best is not None:
            return best[1:]
    return refused[default]  # nothing fits: the default round's plan, which the host check refuses by its bytes


def _lean_report(lean: StagePlan, fastest: StagePlan, costs: CostTable, opts: Options, m: int, r: int,
                 budget: int | None) -> StagePlan:
    """`lean` (`host_lean` of `fastest`) with its report, whose note says why it was chosen."""
    def report(plan: StagePlan, note: str = ""):
        return passes.describe_plan(plan, costs, gpus=opts.gpus, microbatches=m, round_size=r,
                                    staleness=opts.staleness, memory_budget=budget, note=note)
    slower = report(lean).iteration_time / report(fastest).iteration_time
    note = (f"host-lean plan: the partitioner's {fastest.to_str()} keeps the saved inputs of {len(fastest.bwd)} "
            f"backward stages per microbatch in flight, more than the host memory holds; this one keeps "
            f"{len(lean.bwd)}, each backward stage as wide as a worker holds (compute time {slower:.2f}x)")
    return replace(lean, report=report(lean, note))


def _check_host(graph: LayerGraph, costs: CostTable, plan, opts: Options, m: int, round_size: int,
                program: Any = None, assignment: Any = None) -> None:
    """`check_host_memory` of the run at `round_size`, its transfer buffers counted from `program` and its
    buffer `assignment` (raises ValueError naming the bytes when it does not fit)."""
    check_host_memory(graph, costs, plan, microbatches=m, staleness=opts.staleness, optimizer=opts.optimizer,
                      dtype=opts.dtype, hardware=opts.hardware, gpus=opts.gpus, round_size=round_size,
                      program=program, assignment=assignment, shard=opts.shard)


def host_need(graph: LayerGraph, costs: CostTable, plan, opts: Options, program: Any, assignment: Any) -> HostBytes:
    """The host bytes of a planned run, counted as the admission counts them: what its HostState and runtime
    allocate (`opts.shard`: one rank's share of sharded masters and moments)."""
    return host_bytes(graph, costs, plan, microbatches=program.microbatches, staleness=opts.staleness,
                      optimizer=opts.optimizer, dtype=opts.dtype, gpus=opts.gpus, round_size=program.round_size,
                      program=program, assignment=assignment, shard=opts.shard)


def _fits_host(graph: LayerGraph, costs: CostTable, plan, opts: Options, m: int, round_size: int,
               program: Any) -> tuple[bool, Any, Any]:
    """(whether the run fits the host memory at `round_size`, the program's BufferAssignment if this built it,
    else None, its `unshared` one): it fits at once if it fits with one buffer per value crossing a cut
    (`unshared`, an upper bound), else if it fits with the buffers assigned."""
    bound = unshared(graph, program, opts.dtype)
    try:  # no arena is larger than one buffer each: fitting with that is fitting
        _check_host(graph, costs, plan, opts, m, round_size, program, bound)
        return True, None, bound
    except ValueError:
        pass
    assignment = assign_buffers(graph, program, opts.dtype, unplaced=bound)
    try:
        _check_host(graph, costs, plan, opts, m, round_size, program, assignment)
    except ValueError:
        return False, assignment, bound
    return True, assignment, bound


def _shard_head(graph: LayerGraph, shards: int | str, costs: CostTable, budget: int | None = None,
                balance: str = "flops", fused: bool = False) -> LayerGraph:
    """shard_lm_head when the graph ends in a supported LM head; the graph itself otherwise."""
    if shards == 1 and not fused:
        return graph
    try:
        return passes.shard_lm_head(graph, shards=shards, costs=costs, memory_budget=budget, balance=balance,
                                    fused=fused)
    except ValueError:
        if shards == "auto" and not fused:  # no recognised LM head (e.g. a plain Sequential): nothing to shard
            return graph
        raise


def _shared_readers(graph: LayerGraph) -> dict[int, tuple[int, ...]]:
    """For tied parameters: optimizer layer (lowest owner) -> every layer that uses them."""
    out: dict[int, set[int]] = {}
    for owners in graph.param_owners().values():
        if len(owners) > 1:
            out.setdefault(min(owners), set()).update(owners)
    return {k: tuple(sorted(v)) for k, v in out.items()}
