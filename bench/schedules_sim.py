"""Simulated bubble of the RoundPipe schedule vs bound-stage pipeline baselines (issue 5).

    python bench/schedules_sim.py

A 32-layer decoder plus an LM head twice a layer's time, 8 GPUs, 16 microbatches.
Three settings: compute only (free transfers and optimizer), rtx4090 PCIe with the
issue's 1 ms / 2 ms layer times, and rtx4090 PCIe with roofline layer times for
a Llama-8B-like layer at seq 2048 (bf16). Writes docs/bench/schedules_sim.md.
"""
from __future__ import annotations

import datetime
import os
import platform
import sys
import time

import torch
from tabulate import tabulate

from rpcompile import CostTable
from rpcompile.ir.hardware import Hardware
from rpcompile.passes.codegen import emit
from rpcompile.passes.partition.timing import default_round_size, steady_state_window
from rpcompile.runtime import simulate
from rpcompile.runtime.sim.baselines import baselines

GPUS, MICROBATCHES, LAYERS = 8, 16, 32
INF = float("inf")
# A Llama-3-8B-like decoder layer (hidden 4096, MLP 14336, GQA 8 KV heads) at seq 2048, bf16.
LAYER_PARAMS = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336   # ~218M
HEAD_PARAMS = 128256 * 4096                                            # ~525M
ACT = 2048 * 4096 * 2                  # hidden state at a cut: 16.8 MB
AUTOGRAD = 270 * 10**6                 # tensors autograd keeps for one layer's backward (flash attention)
ROOFLINE_FWD = (2 * LAYER_PARAMS * 2048 + 4 * 2048**2 * 4096) / (330e12 * 0.6)  # ~4.9 ms on an rtx4090


def model(fwd: float) -> CostTable:
    """32 layers of fwd / 2 fwd seconds, then the LM head at twice a layer's time; Llama-8B-like bytes."""
    p = [2 * LAYER_PARAMS] * LAYERS + [2 * HEAD_PARAMS]
    return CostTable.from_lists(fwd=[fwd] * LAYERS + [2 * fwd], bwd=[2 * fwd] * LAYERS + [4 * fwd],
                                param_bytes=p, grad_bytes=p, act_bytes=[ACT] * LAYERS + [0],
                                saved_bytes=[ACT] * (LAYERS + 1), peak_bytes=[AUTOGRAD] * (LAYERS + 1),
                                names=[f"layer{i}" for i in range(LAYERS)] + ["lm_head"])


def our_plan(costs: CostTable):
    """(plan, how it was made): the partition pass when present, else a hand-written balanced plan."""
    try:
        from rpcompile.passes.partition import partition
        return partition(costs, gpus=GPUS, microbatches=MICROBATCHES), "rpcompile.passes.partition"
    except ImportError:
        from rpcompile import StagePlan
        return StagePlan.from_str("6,6,5,5,5,5|1|2" + ",2" * 15 + ",1,1"), "hand-written StagePlan"


def row(setting, name, program, costs, hw, plan_text):
    """Simulate one iteration alone and the steady state; one table row."""
    one = simulate(program, costs, hw)
    k, _ = steady_state_window(GPUS, program.plan.num_stages, program.rounds)
    many = simulate(program, costs, hw, iterations=k)
    return [setting, name, plan_text.replace("|", " / "), f"{one.iteration_time * 1e3:.1f}", f"{one.bubble_ratio:.2%}",
            f"{many.steady_iteration_time * 1e3:.1f}", f"{many.steady_bubble:.2%}",
            f"{many.exposed_comm / k * 1e3:.1f}", f"{max(many.peak_memory) / 2**30:.1f}"
            + (" (> 24 GB)" if max(many.peak_memory) > 24e9 else "")], many


def main() -> None:
    t0 = time.perf_counter()
    hw = Hardware.preset("rtx4090")
    free = hw.replace(h2d_bandwidth=INF, d2h_bandwidth=INF, optimizer_bytes_per_s=INF, link_latency=0.0,
                      mem_bandwidth=INF)
    pcie = hw.replace(optimizer_bytes_per_s=INF, mem_bandwidth=INF)
    roof = f"{ROOFLINE_FWD * 1e3:.1f}/{2 * ROOFLINE_FWD * 1e3:.1f} ms"
    settings = [("compute only, 1/2 ms", model(1e-3), free),
                ("PCIe only, 1/2 ms", model(1e-3), pcie),
                (f"PCIe only, {roof}", model(ROOFLINE_FWD), pcie),
                (f"rtx4090 full, {roof}", model(ROOFLINE_FWD), hw)]
    rows, checks, source = [], [], ""
    for setting, costs, h in settings:
        plan, source = our_plan(costs)
        rr = default_round_size(GPUS, MICROBATCHES)
        for s in (0, 1):
            p = emit(plan, gpus=GPUS, microbatches=MICROBATCHES, round_size=rr, staleness=s, costs=costs)
            r, tl = row(setting, f"RoundPipe (ours), staleness {s}", p, costs, h, plan.to_str())
            rows.append(r)
            if s == 1:
                checks.append((setting, tl.steady_bubble))
        for name, p in baselines(costs, gpus=GPUS, microbatches=MICROBATCHES).items():
            rows.append(row(setting, name, p, costs, h, p.plan.to_str().split("|")[0] + "|" +
                            p.plan.to_str().split("|")[1])[0])
    table = tabulate(rows, headers=["setting", "schedule", "plan (fwd / fused / bwd sizes)", "iter ms (alone)",
                                    "bubble (alone)", "iter ms (steady)", "bubble (steady)",
                                    "exposed comm ms/iter", "peak GiB/GPU"], tablefmt="github")
    verdict = checks[0][1] < 0.045
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    text = (f"## schedules_sim: simulated bubble, RoundPipe vs bound-stage baselines\n\n"
            f"`python {' '.join(sys.argv)}` on {datetime.date.today()}, {cpu}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}; {time.perf_counter() - t0:.1f} s.\n\n"
            f"Model: {LAYERS} decoder layers (fwd t, bwd 2t per microbatch) + LM head (2t, 4t); Llama-8B-like "
            f"bytes at seq 2048 bf16 ({2 * LAYER_PARAMS / 1e6:.0f} MB parameters and {ACT / 1e6:.1f} MB "
            f"activations per layer cut, head {2 * HEAD_PARAMS / 1e9:.2f} GB). {GPUS} GPUs, {MICROBATCHES} "
            f"microbatches, round size {default_round_size(GPUS, MICROBATCHES)}. Our plan: {source}. "
            f"Hardware: Hardware.preset('rtx4090') (PCIe {hw.h2d_bandwidth / 1e9:.0f} GB/s per direction, "
            f"host Adam {hw.optimizer_bytes_per_s / 1e9:.0f} GB/s of fp32 master, 10 us per transfer). "
            f"'compute only': transfers and optimizer steps free; 'PCIe only': real transfers, free optimizer "
            f"steps; 'rtx4090 full': everything, where the host Adam ({2 * sum(model(1.0).param_bytes) / 1e9:.0f} "
            f"GB of fp32 master per step at {hw.optimizer_bytes_per_s / 1e9:.0f} GB/s = "
            f"{2 * sum(model(1.0).param_bytes) / hw.optimizer_bytes_per_s * 1e3:.0f} ms) bounds RoundPipe's "
            f"iteration from below; staleness 1 hides it behind the next iteration only up to that bound. "
            f"Baselines bind stages to GPUs (layers split evenly, head on "
            f"the last stage), recompute in the backward (F, then R + B), keep parameters, gradients and "
            f"Adam state on the GPU (step time from memory bandwidth) and move activations GPU->host->GPU "
            f"(no NVLink). Interleaved and looped BFS use 2 stages per GPU.\n\n"
            f"bubble = 1 - compute busy / (N x time), recompute counted as busy (baselines recompute every "
            f"stage, RoundPipe only the B stages, so compare iteration times too). 'alone' = one isolated "
            f"iteration, optimizer tail included; 'steady' = per iteration over back-to-back iterations "
            f"(steady_state_window). Peak memory counts resident state, parameter chunks, gradients, "
            f"activation buffers and autograd workspace (not the CUDA context or fragmentation).\n\n"
            f"{table}\n\n"
            f"Reading: with free transfers our steady bubble is the schedule's own; with PCIe, compute lanes "
            f"wait on activation uploads (exposed comm): every slot's first microbatch waits one D + U hop "
            f"behind its predecessor slot (a serial chain of S x rounds hops per iteration) and a U can queue "
            f"behind a non-preemptive parameter chunk of ~stage bytes / R. At 1 ms / 2 ms per Llama-8B-sized "
            f"layer, a forward slot uploads each layer's parameters in 13.6 ms but computes it in "
            f"8 ms (R = 8), so PCIe "
            f"bounds RoundPipe there; at roofline layer times it is mostly hidden.\n\n"
            f"Acceptance: our staleness-1 steady-state bubble (compute only) = {checks[0][1]:.2%} "
            f"{'<' if verdict else '>='} 4.5%: {'PASS' if verdict else 'FAIL'}.\n")
    print(text)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "bench", "schedules_sim.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
