"""Plan a model for a machine you may not have: predicted costs, our plan vs bound-stage baselines.

Used by `python -m rpcompile plan` and the examples. Everything here runs on
the `meta` device: no weight is allocated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from tabulate import tabulate

from rpcompile import passes
from rpcompile.api import Options
from rpcompile.pipeline import compile_passes
from rpcompile.models.background import Background
from rpcompile.models.presets import build_meta, example_batch, seq_len_limit
from rpcompile.hostmem import HostBytes, check_host_memory, host_bytes
from rpcompile.ir.hardware import Hardware
from rpcompile.ir.optim import AdamW
from rpcompile.runtime import simulate, steady_iterations
from rpcompile.runtime.sim.baselines import gpipe, interleaved_1f1b, looped_bfs, one_f_one_b


@dataclass(frozen=True, slots=True)
class PlanResult:
    """What `plan_model` found, as plain data."""

    model: str            # preset name or config path
    params: int           # parameter count
    plan: object          # the chosen StagePlan (prints as its table)
    program: object       # the emitted Program
    costs: object         # the predicted CostTable
    rows: tuple           # (schedule, iteration s, tokens/s, bubble, steady bubble, peak GiB, fits) per schedule;
                          # a baseline that cannot be built has None in the numbers and why in "fits"
    max_seq: object       # the longest sequence that fits and what binds it (`rpcompile.SeqLenLimit`), or None
    max_seq_why: str | None  # why max_seq could not be computed (None when it was)
    tokens: int           # tokens per iteration
    host: HostBytes       # host memory the run needs, by category (`rpcompile.hostmem`)
    host_memory: int      # host memory of the target machine (or the override)
    microbatch_size: int = 1  # sequences per microbatch
    servers: int = 1      # data-parallel servers W, each running this plan on its own microbatches
    state_whole: int = 0  # bytes of the whole masters + optimizer moments; with the state sharded over the
                          # servers `host` counts server 0's share of them (its largest; `host.servers` > 1)

    @property
    def host_bytes(self) -> int:
        """Total host bytes the run needs."""
        return self.host.total

    def table(self) -> str:
        """Our plan and the baselines side by side."""
        return tabulate(self.rows, headers=["schedule", "iteration (s)", "tokens/s", "bubble (sync)",
                                            "bubble (steady)", "peak GiB/GPU", "fits the GPU"],
                        floatfmt=("", ".3f", ",.0f", ".1%", ".1%", ".1f", ""), missingval="-")


def plan_model(model: str, *, gpus: int = 8, hardware: str | Hardware = "rtx4090", seq: int = 2048,
               microbatches: int = 16, staleness: int = 1, frozen_base: bool = False,
               host_memory: int | None = None, microbatch_size: int = 1, dtype: torch.dtype = torch.bfloat16,
               fp16_accumulation: bool = False, fused_head: bool = False,
               lm_head_shards: int | str = "auto", seq_limit: bool = True, parallel: bool = True,
               state_dtype: torch.dtype = torch.float32, master_dtype: torch.dtype = torch.float32,
               grad_dtype: torch.dtype = torch.float32, servers: int = 1, shard_state: bool = False) -> PlanResult:
    """Build `model` on meta, predict its costs on `hardware`, plan, simulate, compare.

    Args:
        model: a name from `rpcompile.models.presets.MODELS` or a config.json path.
        gpus, hardware, seq, microbatches, staleness: the target run.
        microbatch_size: sequences per microbatch (the example batch is microbatches x this).
        frozen_base: plan a LoRA-style run: every matrix is frozen, only the 1-D weights (norms)
            train. LoRA adapters are small enough that their bytes and FLOPs are left out.
        host_memory: host bytes of the target machine, overriding the hardware preset's.
        dtype, fp16_accumulation, fused_head: the recipe, as for `rpcompile.compile` (default bf16, the
            fp32-accumulate rate, the vocabulary-sharded head); the RoundPipe reference's is
            `dtype=torch.float16, fp16_accumulation=True, fused_head=True`.
        lm_head_shards: the LM head's shards, as for `rpcompile.compile` (default "auto").
        state_dtype: AdamW's moments, `rpcompile.AdamW(state_dtype=...)`: float32 (default) or bfloat16.
        master_dtype: AdamW's master weights, `rpcompile.AdamW(master_dtype=...)`: float32 (default) or bfloat16.
        grad_dtype: the host gradient buffers, `rpcompile.AdamW(grad_dtype=...)`: float32 (default) or bfloat16.
        servers: data-parallel servers W (default 1), each running this plan on its own microbatches; without
            `shard_state` each holds the whole parameter state, so the host memory is that of one.
        shard_state: the masters and optimizer moments are sharded over the servers (`compile(dist=True,
            shard_state=True)`; needs servers > 1): the host memory, its check and `max_seq` are server 0's
            (the largest share: `host_bytes(shard=(0, W))`).
        seq_limit: also find `max_seq` (the slow part); False leaves it None.
        parallel: find `max_seq` in a forked child process while this one plans (`Background`: Linux with
            more than one core; the same result either way); False: one after the other.
    Returns:
        A PlanResult; `.table()` compares our schedule with GPipe, 1F1B, interleaved and looped-BFS
        (a baseline that cannot be built for this run says why in its row); `.max_seq` is
        `rpcompile.models.presets.seq_len_limit` for the same machine, GPUs, microbatches and microbatch size.
    Raises:
        ValueError: a bad argument (named), or the run does not fit the host memory
            (`rpcompile.hostmem.check_host_memory`: the parameters' state is checked before planning,
            the saved activations once the plan is known).
    """
    for name, v in (("gpus", gpus), ("seq", seq), ("microbatches", microbatches),
                    ("microbatch_size", microbatch_size), ("servers", servers)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"plan_model: {name} must be a positive integer, got {v!r}")
    if staleness not in (0, 1) or isinstance(staleness, bool):
        raise ValueError(f"plan_model: staleness must be 0 or 1, got {staleness!r}")
    if shard_state and servers == 1:
        raise ValueError("plan_model: shard_state needs servers > 1 (the optimizer state is sharded over the "
                         "data-parallel servers), got servers=1")
    shard = (0, servers) if shard_state else None  # server 0 holds the largest share
    hw = Hardware.preset(hardware) if isinstance(hardware, str) else hardware
    if host_memory is not None:
        hw = hw.replace(host_memory=host_memory)
    net = build_meta(model, dtype=dtype)
    if frozen_base:
        for p in net.parameters():
            p.requires_grad_(p.dim() == 1)
    optimizer = AdamW(state_dtype=state_dtype, master_dtype=master_dtype, grad_dtype=grad_dtype)
    state = dict(staleness=staleness, optimizer=optimizer, dtype=dtype, hardware=hw, limit=host_memory, shard=shard)
    check_host_memory(net, microbatches=microbatches, **state)  # the parameters' state alone, before planning
    # the longest sequence, from the same model traced into sub-blocks (with a frozen base its experts run one
    # after the other there: `seq_len_limit`), found meanwhile in a child process if it may
    with Background(parallel and seq_limit, _seq_limit if seq_limit else _not_asked, model, hw, gpus=gpus,
                     microbatch_size=microbatch_size, microbatches=microbatches, frozen_base=frozen_base,
                     built=net, optimizer=state["optimizer"], shard=shard) as longest:
        return _plan(net, model, hw, state, longest, servers, gpus=gpus, seq=seq, microbatches=microbatches,
                     microbatch_size=microbatch_size, staleness=staleness, dtype=dtype,
                     lm_head_shards=lm_head_shards, fp16_accumulation=fp16_accumulation, fused_head=fused_head,
                     parallel=parallel)


def _plan(net, model: str, hw: Hardware, state: dict, longest: Background, servers: int, *, gpus: int, seq: int,
          microbatches: int, microbatch_size: int, staleness: int, dtype, lm_head_shards, fp16_accumulation: bool,
          fused_head: bool, parallel: bool = True) -> PlanResult:
    """`plan_model` once the model is built and its parameters' state fits: plan, simulate, compare; the
    longest sequence comes from `longest`. The comparison rows (our schedule at staleness 0, the baselines)
    need only the costs and the plan: they are simulated in a child process (`Background`, if `parallel`)
    while this one verifies the program and places its host buffers."""
    example = example_batch(net.config.vocab_size, microbatches * microbatch_size, seq)
    opts = Options(gpus=gpus, microbatches=microbatches, staleness=staleness,
                   optimizer=state["optimizer"], dtype=dtype, loss_fn=None, layers=None,  # its state's bytes
                   lm_head_shards=lm_head_shards, hardware=hw, memory_budget=None, backend="host", seed=0,
                   fp16_accumulation=fp16_accumulation, fused_head=fused_head, shard=state["shard"])
    tokens = microbatches * microbatch_size * seq
    jobs: list[Background] = []
    try:
        def emitted(costs, plan, program):
            jobs.append(Background(parallel, _comparison, costs, plan, program.round_size, gpus, program.microbatches,
                                   tokens, hw))
        graph, costs, plan, program, m, _, chosen, assignment = compile_passes(net, example, opts, mode="predict",
                                                                               emitted=emitted)
        host = check_host_memory(graph, costs, plan, microbatches=m, gpus=gpus, round_size=program.round_size,
                                 program=program, assignment=assignment, **state)
        k = steady_iterations(program)  # the round size was chosen by this simulation when its window is this one
        ours = chosen if chosen is not None and chosen.iterations == k else simulate(program, costs, hw, iterations=k)
        sync_bubble, baselines = jobs[0].result()
    finally:
        for job in jobs:
            job.close()
    rows = [("rpcompile (RoundPipe)", ours.steady_iteration_time, tokens / ours.steady_iteration_time,
             sync_bubble, ours.steady_bubble, max(ours.peak_memory) / 2**30, _fits(ours, hw)), *baselines]
    max_seq, why = longest.result()
    n_params = sum(v.shape.numel() if hasattr(v.shape, "numel") else _numel(v.shape)
                   for v in graph.params.values())
    whole = host_bytes(graph, microbatches=m, optimizer=state["optimizer"], dtype=dtype)
    return PlanResult(model, n_params, plan, program, costs, tuple(rows), max_seq, why, tokens, host,
                      hw.host_memory, microbatch_size, servers, whole.masters + whole.optimizer)


def _comparison(costs, plan, round_size: int, gpus: int, microbatches: int, tokens: int,
                hw: Hardware) -> tuple[float, list[tuple]]:
    """(the bubble of our schedule at staleness 0, the baselines' rows): what the plan is compared with."""
    sync = simulate(passes.emit(plan, gpus=gpus, microbatches=microbatches, round_size=round_size, staleness=0,
                                costs=costs), costs, hw)
    return sync.bubble_ratio, _baseline_rows(costs, gpus, microbatches, tokens, hw)


def _baseline_rows(costs, gpus: int, microbatches: int, tokens: int, hw: Hardware) -> list[tuple]:
    """One row per bound-stage baseline; one that cannot be built for this run says why in its own row."""
    builders = (("GPipe", gpipe), ("1F1B", one_f_one_b), ("interleaved 1F1B (V=2)", interleaved_1f1b),
                ("looped BFS (V=2)", looped_bfs))
    rows = []
    for name, build in builders:
        try:
            t = simulate(build(costs, gpus=gpus, microbatches=microbatches), costs, hw)
        except ValueError as exc:  # e.g. fewer layers than bound stages: the other rows still stand
            rows.append((name, None, None, None, None, None, f"n/a: {exc}"))
            continue
        rows.append((name, t.iteration_time, tokens / t.iteration_time, t.bubble_ratio, t.bubble_ratio,
                     max(t.peak_memory) / 2**30, _fits(t, hw)))
    return rows


def _seq_limit(model: str, hw: Hardware, built=None, **kwargs):
    """(`presets.seq_len_limit(model, hw, model=built, **kwargs)`, None), or (None, why it could not be computed)."""
    try:
        return seq_len_limit(model, hw, host_memory=hw.host_memory, model=built, **kwargs), None
    except Exception as exc:  # noqa: BLE001 - reported in the output: the plan itself still stands
        return None, f"{type(exc).__name__}: {exc}"


def _not_asked(*args, **kwargs) -> tuple[None, str]:
    """`_seq_limit`'s answer when max_seq is not asked for."""
    return None, "not asked for"


def _fits(timeline, hw: Hardware) -> str:
    """'yes' if every worker's simulated peak fits the device memory, else 'no (OOM)'."""
    return "yes" if max(timeline.peak_memory) <= hw.device_memory else "no (OOM)"


def _numel(shape) -> int:
    """Product of a shape's sizes."""
    n = 1
    for s in shape:
        n *= s
    return n
