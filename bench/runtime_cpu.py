"""CPU benchmark of the runtime: tokens/s of the compiled model vs eager PyTorch, measured vs simulated bubble.

    python bench/runtime_cpu.py            # writes docs/bench/runtime_cpu.md (< 5 min on 2 cores)

Eager baseline: the same Llama with torch.utils.checkpoint per decoder layer (HF
gradient checkpointing, use_reentrant=False) and torch.optim.AdamW(fused=True),
mean loss over the same microbatches. Compiled: `Runtime` on host workers
(gpus = 1, 2, 4), staleness 1, AdamW(impl="fused"). The measured bubble is
1 - compute-lane busy time / (N * span) of the last step's timeline; the
simulated one is `rpcompile.runtime.simulate` on measured per-layer costs and
the "cpu" hardware preset.
"""
from __future__ import annotations

import datetime
import os
import platform
import sys
import time

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import models  # noqa: E402
from rpcompile import AdamW, StagePlan  # noqa: E402
from rpcompile.passes import emit, trace  # noqa: E402
from rpcompile.runtime.executor import Runtime  # noqa: E402
from rpcompile.runtime.optimizer import HostState  # noqa: E402
from rpcompile.runtime.stage_exec import split_batch  # noqa: E402

CFG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=8, vocab_size=4096, max_position_embeddings=512)
BATCH, SEQ, MBS, STEPS, WARMUP = 8, 128, 4, 6, 2
PLANS = {1: "3|4|3", 2: "2,1|4|1,2", 4: "1,1,1|4|1,1,1"}  # 7 layers: embed, 4 blocks, norm, lm_head


def _batches(n: int) -> list[dict]:
    return [models.lm_batch(batch=BATCH, seq=SEQ, seed=s, vocab=CFG["vocab_size"]) for s in range(n)]


def eager_tokens_per_s(graph) -> float:
    """Eager PyTorch with per-decoder-layer activation checkpointing and fused AdamW."""
    model = models.llama(**CFG)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    times = []
    for b in _batches(WARMUP + STEPS):
        t0 = time.perf_counter()
        loss = sum(model(**mb).loss for mb in split_batch(graph, b, MBS)) / MBS
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return BATCH * SEQ / (sum(times[WARMUP:]) / STEPS)


def compiled(graph, gpus: int, costs, hardware) -> tuple[float, float, float | None]:
    """(tokens/s, measured bubble, simulated bubble or None) of the runtime on `gpus` host workers."""
    plan = StagePlan.from_str(PLANS[gpus])
    prog = emit(plan, gpus=gpus, microbatches=MBS, staleness=1)
    state = HostState.from_graph(graph, optimizer=AdamW(lr=1e-4, impl="fused"))
    times, bubbles = [], []
    with Runtime(graph, prog, state, backend="host", timeout=120) as rt:
        for b in _batches(WARMUP + STEPS):
            t0 = time.perf_counter()
            rt.step(b)
            times.append(time.perf_counter() - t0)
            recs = rt.last_timeline
            span = max(r[4] for r in recs) - min(r[3] for r in recs)
            busy = sum(r[4] - r[3] for r in recs if r[2] == "compute")
            bubbles.append(1 - busy / (gpus * span))
        t0 = time.perf_counter()
        rt.flush()
        times[-1] += time.perf_counter() - t0
    sim = None
    if costs is not None:
        from rpcompile.runtime import simulate
        sim = simulate(prog, costs, hardware, iterations=1).bubble_ratio
    return BATCH * SEQ / (sum(times[WARMUP:]) / STEPS), sum(bubbles[WARMUP:]) / STEPS, sim


def main() -> None:
    torch.manual_seed(0)
    model = models.llama(**CFG)
    example = _batches(1)[0]
    graph = trace(model, example)
    try:
        from rpcompile.hardware import Hardware
        from rpcompile.passes.cost import estimate_costs
        costs = estimate_costs(graph, example, mode="measure", device="cpu", microbatches=MBS, warmup=1,
                               repeats=3, progress=False)
        hardware = Hardware.preset("cpu")
    except Exception as exc:  # noqa: BLE001 - the simulator column is optional
        print(f"no simulation: {exc}", file=sys.stderr)
        costs = hardware = None
    eager = eager_tokens_per_s(graph)
    rows = [["eager + checkpoint + AdamW(fused)", "-", f"{eager:,.0f}", "1.00", "-", "-"]]
    for gpus in (1, 2, 4):
        tps, bub, sim = compiled(graph, gpus, costs, hardware)
        rows.append([f"rpcompile gpus={gpus} ({PLANS[gpus]})", gpus, f"{tps:,.0f}", f"{tps / eager:.2f}",
                     f"{100 * bub:.1f}%", "-" if sim is None else f"{100 * sim:.1f}%"])
    table = tabulate(rows, headers=["run", "workers", "tokens/s", "ratio vs eager", "bubble (measured)",
                                    "bubble (simulate)"], disable_numparse=True)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    head = (f"# runtime_cpu benchmark\n\ncommand: `python bench/runtime_cpu.py`  \n"
            f"date: {datetime.date.today()}  \nCPU: {cpu}, {os.cpu_count()} cores  \n"
            f"torch {torch.__version__}, threads {torch.get_num_threads()}  \n"
            f"model: Llama hidden {CFG['hidden_size']}, {CFG['num_hidden_layers']} layers, vocab "
            f"{CFG['vocab_size']}; batch {BATCH} x seq {SEQ}, {MBS} microbatches, {STEPS} timed steps after "
            f"{WARMUP} warm-up; float32\n\n```\n{table}\n```\n")
    print(head)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "bench", "runtime_cpu.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(head)


if __name__ == "__main__":
    main()
