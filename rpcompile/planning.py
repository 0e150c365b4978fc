"""Plan a model for a machine you may not have: predicted costs, our plan vs bound-stage baselines.

Used by `python -m rpcompile plan` and the examples. Everything here runs on
the `meta` device: no weight is allocated.
"""
from __future__ import annotations

from dataclasses import dataclass

from tabulate import tabulate

from rpcompile.hardware import Hardware
from rpcompile.hostmem import HostBytes, check_host_memory
from rpcompile.optim import AdamW


@dataclass(frozen=True, slots=True)
class PlanResult:
    """What `plan_model` found, as plain data."""

    model: str            # preset name or config path
    params: int           # parameter count
    plan: object          # the chosen StagePlan (prints as its table)
    program: object       # the emitted Program
    costs: object         # the predicted CostTable
    rows: tuple           # (schedule, iteration s, tokens/s, bubble, steady bubble, peak GiB, fits) per schedule
    max_seq: int | None   # longest sequence that fits (None if it could not be computed)
    tokens: int           # tokens per iteration
    host: HostBytes       # host memory the run needs, by category (`rpcompile.hostmem`)
    host_memory: int      # host memory of the target machine (or the override)

    @property
    def host_bytes(self) -> int:
        """Total host bytes the run needs."""
        return self.host.total

    def table(self) -> str:
        """Our plan and the baselines side by side."""
        return tabulate(self.rows, headers=["schedule", "iteration (s)", "tokens/s", "bubble (sync)",
                                            "bubble (steady)", "peak GiB/GPU", "fits the GPU"],
                        floatfmt=("", ".3f", ",.0f", ".1%", ".1%", ".1f", ""))


def plan_model(model: str, *, gpus: int = 8, hardware: str | Hardware = "rtx4090", seq: int = 2048,
               microbatches: int = 16, staleness: int = 1, frozen_base: bool = False,
               host_memory: int | None = None) -> PlanResult:
    """Build `model` on meta, predict its costs on `hardware`, plan, simulate, compare.

    Args:
        model: a name from `rpcompile.presets.MODELS` or a config.json path.
        gpus, hardware, seq, microbatches, staleness: the target run (one sequence per microbatch).
        frozen_base: plan a LoRA-style run: every matrix is frozen, only the 1-D weights (norms)
            train. LoRA adapters are small enough that their bytes and FLOPs are left out.
        host_memory: host bytes of the target machine, overriding the hardware preset's.
    Returns:
        A PlanResult; `.table()` compares our schedule with GPipe, 1F1B, interleaved and looped-BFS.
    Raises:
        ValueError: the run does not fit the host memory (`rpcompile.hostmem.check_host_memory`: the
            parameters' state is checked before planning, the saved activations once the plan is known).
    """
    import torch
    from rpcompile import passes
    from rpcompile.api import Options, plan_pipeline
    from rpcompile.presets import build_meta, example_batch
    from rpcompile.runtime import simulate, steady_iterations
    from rpcompile.runtime.baselines import baselines

    hw = Hardware.preset(hardware) if isinstance(hardware, str) else hardware
    if host_memory is not None:
        hw = hw.replace(host_memory=host_memory)
    net = build_meta(model)
    if frozen_base:
        for p in net.parameters():
            p.requires_grad_(p.dim() == 1)
    state = dict(staleness=staleness, optimizer=AdamW(), dtype=torch.bfloat16, hardware=hw, limit=host_memory)
    check_host_memory(net, microbatches=microbatches, **state)  # the parameters' state alone, before planning
    example = example_batch(net.config.vocab_size, microbatches, seq)
    opts = Options(gpus=gpus, microbatches=microbatches, staleness=staleness,
                   optimizer=None, dtype=torch.bfloat16, loss_fn=None, layers=None,
                   lm_head_shards="auto", hardware=hw, memory_budget=None, backend="host", seed=0)
    graph, costs, plan, program, m = plan_pipeline(net, example, opts, mode="predict")
    host = check_host_memory(graph, costs, plan, microbatches=m, gpus=gpus, round_size=program.round_size, **state)
    tokens = microbatches * seq
    rows = []
    ours_sync = simulate(passes.emit(plan, gpus=gpus, microbatches=m, round_size=program.round_size,
                                      staleness=0, costs=costs), costs, hw)
    ours = simulate(program, costs, hw, iterations=steady_iterations(program))
    rows.append(("rpcompile (RoundPipe)", ours.steady_iteration_time, tokens / ours.steady_iteration_time,
                 ours_sync.bubble_ratio, ours.steady_bubble, max(ours.peak_memory) / 2**30,
                 _fits(ours, hw)))
    for name, prog in baselines(costs, gpus=gpus, microbatches=m).items():
        t = simulate(prog, costs, hw)
        rows.append((name, t.iteration_time, tokens / t.iteration_time, t.bubble_ratio, t.bubble_ratio,
                     max(t.peak_memory) / 2**30, _fits(t, hw)))
    try:
        from rpcompile import max_seq_len
        longest = max_seq_len(graph, hw, gpus=gpus)
    except Exception:  # reported as "n/a": planning still succeeded
        longest = None
    n_params = sum(v.shape.numel() if hasattr(v.shape, "numel") else _numel(v.shape)
                   for v in graph.params.values())
    return PlanResult(model, n_params, plan, program, costs, tuple(rows), longest, tokens, host, hw.host_memory)


def _fits(timeline, hw: Hardware) -> str:
    """'yes' if every worker's simulated peak fits the device memory, else 'no (OOM)'."""
    return "yes" if max(timeline.peak_memory) <= hw.device_memory else "no (OOM)"


def _numel(shape) -> int:
    """Product of a shape's sizes."""
    n = 1
    for s in shape:
        n *= s
    return n
