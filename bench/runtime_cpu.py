"""CPU benchmark of the runtime: tokens/s of the compiled model vs eager PyTorch, measured vs simulated bubble.

    python bench/runtime_cpu.py              # writes docs/bench/runtime_cpu.md (~2-5 min on 2 cores)
    python bench/runtime_cpu.py --threads 1  # both sides with one intra-op thread
    python bench/runtime_cpu.py --quick      # fewer steps, costs measured once; prints, writes nothing

Eager baseline: the same Llama (same seed, train mode, dropout 0), each decoder layer wrapped in
`torch.utils.checkpoint(use_reentrant=False)`, a plain gradient-accumulation loop over the same 4
microbatches (backward per microbatch on loss / M) and `torch.optim.AdamW(fused=True)`. Compiled:
`Runtime` on host workers (gpus = 1, 2, 4) at the round size `compile` picks there (one worker: one
round of all M microbatches; more: `default_round_size`), and one worker at R = 1 beside it, staleness 1,
AdamW(impl="fused"). Both use the same `torch.set_num_threads` value. All variants live at once and their
steps are interleaved round-robin (eager, g1, g1 R=1, g2, g4, eager, ...), so machine-load changes on a shared host hit every variant alike;
we quote medians of the timed steps.

CUDA's issuing pattern (issue 22, 1d): two variants run again on host workers that issue as the CUDA
backend does (`backend="host-cuda"`: a stream's wait on unfinished host work queues the stream's later
work behind it, the issuer goes on) and as it did before (`"host-cuda-old"`: the issuer blocks there, so
everything behind it in program order waits). Their rows show the issuer's waits on host work
(`issue_waits`) and the seconds it spent blocked there, beside the compute lanes' idle share.

Bubble (the compute lanes' idle share), measured and simulated the same way: 1 - (compute-lane busy time of all workers) /
(N x end of the iteration's last worker instruction), from the step's start; the CPU optimizer tail
of staleness 1 is excluded on both sides. Simulated: `rpcompile.runtime.simulate` of the same Program
(one iteration) with per-layer costs measured on this machine (`estimate_costs(mode="measure")`) and
`rpcompile.measure_hardware("cpu")` (the optimizer lane at the kernels' rate).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
from tabulate import tabulate
from torch.utils.checkpoint import checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
import models  # noqa: E402
from _common import machine_line, write_doc  # noqa: E402
from rpcompile import AdamW, StagePlan  # noqa: E402
from rpcompile.passes import emit, trace  # noqa: E402
from rpcompile.runtime.executor import Runtime  # noqa: E402
from rpcompile.runtime.host.optimizer import HostState  # noqa: E402
from rpcompile.runtime.stage.batch import split_batch  # noqa: E402

CFG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=8, vocab_size=4096, max_position_embeddings=512)
BATCH, SEQ, MBS, STEPS, WARMUP = 8, 128, 4, 8, 2
# name -> (workers, plan, round size); 7 layers: embed, 4 blocks, norm, lm_head. Round sizes as compile picks
# them on host workers (one worker: one round of all M; more: default_round_size), and one worker at R = 1
# (rounds of one microbatch, what compile picked before) beside it.
VARIANTS = {"gpus=1": (1, "3|4|3", MBS), "gpus=1, R=1": (1, "3|4|3", 1), "gpus=2": (2, "2,1|4|1,2", None),
            "gpus=4": (4, "1,1,1|4|1,1,1", None)}
# the CUDA issuing pattern: these variants again, on host workers issuing as the CUDA backend does / did (1d)
ISSUE_MODES = {"cuda-blocking-old": "host-cuda-old", "cuda-blocking": "host-cuda"}
MODE_VARIANTS = ("gpus=1, R=1", "gpus=2")
for _v in MODE_VARIANTS:
    for _m in ISSUE_MODES:
        VARIANTS[f"{_v} [{_m}]"] = VARIANTS[_v]


def backend_of(variant: str) -> str:
    """The Runtime backend of a variant: "host", or the issuing mode named in its brackets."""
    return ISSUE_MODES[variant.split("[")[1][:-1]] if "[" in variant else "host"
AGREE = 0.15


def _batches(n: int) -> list[dict]:
    return [models.lm_batch(batch=BATCH, seq=SEQ, seed=s, vocab=CFG["vocab_size"]) for s in range(n)]


class _Checkpointed(torch.nn.Module):
    """A decoder layer run under torch.utils.checkpoint (non-reentrant); other attributes pass through."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):
        return checkpoint(self.layer, *args, use_reentrant=False, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)


def eager_stepper(graph):
    """A step(batch) function: eager Llama, per-layer checkpointing, gradient accumulation, fused AdamW."""
    model = models.llama(**CFG).train()
    assert all(not isinstance(m, torch.nn.Dropout) or m.p == 0 for m in model.modules())
    assert getattr(model.config, "attention_dropout", 0.0) == 0.0
    model.config.use_cache = False  # else train mode builds a KV cache and the recompute appends to it again
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = _Checkpointed(layers[i])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(batch: dict) -> float:
        total = 0.0
        for mb in split_batch(graph, batch, MBS):
            loss = model(**mb, use_cache=False).loss / MBS
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total
    return step


def bubble_of(records, gpus: int) -> tuple[float, float]:
    """(bubble, end of the last worker instruction) from (worker, lane, start, end) tuples of one iteration."""
    work = [(s, e) for w, lane, s, e in records if w >= 0]
    end = max(e for _, e in work)
    busy = sum(e - s for w, lane, s, e in records if w >= 0 and lane == "compute")
    return 1 - busy / (gpus * end), end


def simulated(prog, costs, hw, gpus: int) -> tuple[float, float]:
    """(bubble, worker-window seconds) of one simulated iteration, measured like the runtime's."""
    from rpcompile.runtime import simulate
    tl = simulate(prog, costs, hw.replace(gpus=gpus), iterations=1)
    return bubble_of([(r.worker, r.lane, r.start, r.end) for r in tl.records], gpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    ap.add_argument("--quick", action="store_true",
                    help="4 timed steps after 1 warm-up, costs measured once, the table printed and not written")
    args = ap.parse_args()
    steps, warmup = (4, 1) if args.quick else (STEPS, WARMUP)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    torch.manual_seed(0)
    model = models.llama(**CFG)
    example = _batches(1)[0]
    graph = trace(model, example)

    from rpcompile.machine import measure_hardware
    from rpcompile.passes.cost import estimate_costs

    def measure_costs():
        return estimate_costs(graph, example, mode="measure", device="cpu", microbatches=MBS, warmup=2,
                              repeats=5, progress=False)
    costs = measure_costs()
    hw = measure_hardware("cpu", gpus=1)

    progs = {v: emit(StagePlan.from_str(plan), gpus=g, microbatches=MBS, staleness=1, round_size=r)
             for v, (g, plan, r) in VARIANTS.items()}
    runtimes = {g: Runtime(graph, progs[g], HostState.from_graph(graph, optimizer=AdamW(lr=1e-4, impl="fused")),
                           backend=backend_of(g), timeout=300) for g in VARIANTS}
    eager = eager_stepper(graph)
    times: dict[str, list[float]] = {"eager": [], **{g: [] for g in VARIANTS}}
    meas: dict[str, list[tuple[float, float]]] = {g: [] for g in VARIANTS}
    counts: dict[str, list[dict]] = {g: [] for g in VARIANTS}  # Runtime.stats() of each timed step
    try:
        for k, batch in enumerate(_batches(warmup + steps)):
            order = ["eager", *VARIANTS]
            order = order[k % len(order):] + order[:k % len(order)]  # rotate who goes first
            for v in order:
                t0 = time.perf_counter()
                if v == "eager":
                    eager(batch)
                else:  # flush: the staleness-1 optimizer tail must not run into the next variant's timing
                    runtimes[v].step(batch)
                    runtimes[v].flush()
                dt = time.perf_counter() - t0
                if k >= warmup:
                    times[v].append(dt)
                    if v != "eager":
                        meas[v].append(bubble_of([r[1:] for r in runtimes[v].last_timeline], VARIANTS[v][0]))
                        counts[v].append(runtimes[v].stats())
        for rt in runtimes.values():
            rt.flush()
    finally:
        for rt in runtimes.values():
            rt.close()

    # Costs measured twice more after the timed steps; keep each layer's faster reading (on a shared host a
    # burst of load during one measurement inflates it several-fold; the minimum is the robust estimate).
    for _ in range(0 if args.quick else 2):
        again = measure_costs()
        costs = dataclasses.replace(costs, fwd=tuple(map(min, costs.fwd, again.fwd)),
                                    bwd=tuple(map(min, costs.bwd, again.bwd)))
    tps = {v: BATCH * SEQ / statistics.median(ts) for v, ts in times.items()}
    rows = [["eager: checkpoint per layer + AdamW(fused)", "-", f"{tps['eager']:,.0f}", "1.00",
             f"{statistics.median(times['eager']):.3f}", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-"]]
    notes = []
    for g, (n, plan, _) in VARIANTS.items():
        bub = statistics.median(b for b, _ in meas[g])
        win = statistics.median(w for _, w in meas[g])
        sbub, swin = simulated(progs[g], costs, hw, n)
        ok = abs(swin - win) <= AGREE * win and abs(sbub - bub) <= max(AGREE * bub, 0.02)
        label = f"rpcompile {g} ({plan.replace('|', ' / ')}, R={progs[g].round_size})"  # '|' would end a cell
        if "[" in g:
            label = f"rpcompile {g.split(' [')[0]} ({plan.replace('|', ' / ')}, R={progs[g].round_size}) [{g.split('[')[1]}"
        rows.append([label, n, f"{tps[g]:,.0f}", f"{tps[g] / tps['eager']:.2f}",
                     f"{statistics.median(times[g]):.3f}", f"{win:.3f}", f"{swin:.3f}", f"{100 * bub:.1f}%",
                     f"{100 * sbub:.1f}%", "yes" if ok else "NO",
                     f"{statistics.median(c['host_waits'] for c in counts[g]):.0f} "
                     f"(of {sum(1 for i in progs[g].instrs)} instrs)",
                     f"{statistics.median(c['issue_waits'] for c in counts[g]):.0f}",
                     f"{statistics.median(c['issue_blocked_s'] for c in counts[g]):.3f}",
                     f"{max(c['host_allocations'] + c['device_allocations'] for c in counts[g])}",
                     f"{statistics.median(c['bytes_to_device'] + c['bytes_to_host'] for c in counts[g]) / 2**20:.1f}"])
        if not ok:
            notes.append(g)
    table = tabulate(rows, headers=["run", "workers", "tokens/s (median)", "vs eager", "step s",
                                    "worker window s (measured)", "(simulated)", "bubble = compute idle (measured)",
                                    "bubble (simulated)", f"agree <= {AGREE:.0%}", "host waits / step",
                                    "issuer waits on host work / step", "issuer blocked s / step",
                                    "allocations / step (max)", "MiB moved / step"],
                     disable_numparse=True, tablefmt="github")
    how = "one measurement before the timed steps" if args.quick else \
        "per-layer min of one measurement before and two after the timed steps"
    cost_line = (f"measured per-microbatch costs ({how}): fwd {1e3 * sum(costs.fwd):.1f} ms, bwd {1e3 * sum(costs.bwd):.1f} "
                 f"ms over {len(costs.fwd)} layers (sum); measure_hardware: fp32 "
                 f"{hw.flops('float32') / 1e9:.0f} GFLOP/s, memcpy {hw.h2d_bandwidth / 1e9:.1f} GB/s, "
                 f"op latency {hw.op_latency * 1e6:.1f} us, optimizer {hw.optimizer_bytes_per_s / 1e9:.1f} GB/s")
    pred = MBS * sum(2 * f + b for f, b in zip(costs.fwd, costs.bwd))
    cost_line += (f"  \ncost sanity: these costs predict {pred:.3f} s of compute per 1-worker step "
                  f"(M x sum(2 fwd + bwd)); eager measured {statistics.median(times['eager']):.3f} s "
                  f"({pred / statistics.median(times['eager']):.1f}x). Well above 1x means the per-layer "
                  f"measurement itself was slowed by load (or by the cost pass) and the simulated column "
                  f"inherits that error.")
    ratio = tps["gpus=1"] / tps["eager"]
    verdict = (f"compiled(gpus=1) / eager = {ratio:.2f} (target >= 0.90: "
               f"{'met' if ratio >= 0.9 else 'NOT met'}).")
    gap = ("" if not notes else
           f"The simulator and the runtime disagree by more than {AGREE:.0%} for "
           f"{', '.join(map(str, notes))}. Why: the simulator treats each host worker as an independent device "
           f"with the single-worker costs measured above, but here the N worker compute lanes (plus the "
           f"transfer lanes and the CPU optimizer thread) share {os.cpu_count()} cores, each op using "
           f"{args.threads} intra-op threads: N host workers are not N devices. When two lanes compute at once "
           f"each runs slower, so measured busy time is inflated (the measured bubble looks smaller than the "
           f"real idle share of the machine) and the window is longer than predicted; with gpus=4 on 2 cores "
           f"the parallel speed-up the simulator assumes cannot exist. Python dispatch and lane hand-offs "
           f"between instructions (not in the cost table) add measured idle time at gpus=1. So on this machine "
           f"the CPU run validates the schedule's ordering and the protocol, not the simulator's timing model; "
           f"that needs real devices (bench/gpu.sh).\n")
    text = f"""# runtime_cpu benchmark

{machine_line()}  
model: Llama hidden {CFG['hidden_size']}, {CFG['num_hidden_layers']} layers, vocab {CFG['vocab_size']}; batch {BATCH} x seq {SEQ}, {MBS} microbatches, {steps} timed steps after {warmup} warm-up per variant, interleaved; float32; run time {time.perf_counter() - t_start:.0f} s  
{cost_line}

{table}

{verdict}
Host waits are the times the host blocked on device work in a step (`Runtime.stats()`), next to the
program's instruction count: the runtime queues work on the workers' streams and waits only for the
losses, a round's gradient downloads and the uploads a copy must not overwrite. Allocations are new pool
or pinned buffers in a timed step (after the warm-up steps): 0 means every transfer reused a buffer.
Agreement: simulated worker window within {AGREE:.0%} of the measured one and simulated bubble within
{AGREE:.0%} (relative, or 2 points) of the measured one.
{gap}
CUDA's issuing pattern ([cuda-blocking-old] / [cuda-blocking] rows): the issuer's waits on host work
(a parameter upload waiting for the COPY of its version, a gradient download for its staging buffer)
and the seconds it was blocked there. In the old pattern each such wait blocked the worker's only
issuing thread, and everything after it in program order (compute included) waited to be issued; with
the backlog (`runtime/streams/launch.py`) only the waiting stream's later work waits, and the issuer never blocks
on host work (0 and 0.000). On host workers the compute lanes keep a queue of already-issued work, so the
blocked seconds show in their idle share only when a wait outlasts that queue; on a GPU, where compute is
fast next to the host's accumulation and optimizer, it does more often.

Eager baseline, what was wrong before: the old script ran all eager steps first and all compiled steps
afterwards. On this shared 2-core machine other jobs come and go; with 2 OpenMP threads per op, a core
taken by another multi-threaded process makes every parallel region wait for a descheduled thread, and
single steps swing from 0.6 s to 6-12 s (seen in isolated runs of the same HF-checkpointed loop:
threads=2 median 5.7 s/step vs threads=1 0.9 s/step during a busy minute, 0.66 s vs 0.56 s a minute
later). The 4-6x gap was that load landing on the eager phase, not a slow path in eager PyTorch: the
model has no active dropout, HF's gradient checkpointing costs ~1.3-1.5x a no-checkpoint step (the
recompute), and the first step of a fresh model costs 3-6 s (one-time warm-up, excluded). Now eager uses
an explicit `torch.utils.checkpoint` per decoder layer, per-microbatch backward, fused AdamW, the same
thread count, and its steps are interleaved with the compiled ones. Numbers still move by +-30% between
runs here; compare only within one run.
"""
    print(text)
    if not args.quick:
        print("wrote", write_doc("runtime_cpu.md", text))


if __name__ == "__main__":
    main()
