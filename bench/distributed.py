"""Data parallelism across processes (issue #9): measured 1 vs 2 processes here, simulated 2 x 8 x RTX 4090.

    python bench/distributed.py            # writes docs/bench/distributed.md (~2 min on 2 cores)

Measured: TinyLlama on host workers, the same global batch per iteration; one
process (all microbatches) vs two gloo processes on localhost (half the batch
and half the microbatches each, per-layer gradient all-reduce on the host), the
machine's cores split evenly between the processes. tokens/s = global tokens /
mean step time of rank 0 (after warm-up; the last step includes the flush).

Simulated: llama3.1-8b planned by `rpcompile.models.planning.plan_model` (8 x RTX 4090,
seq 2048, 16 microbatches per node, staleness 1), then `simulate(...,
nodes=k)`: each layer group's fp32 gradient ring all-reduce (2(k-1)/k * bytes /
bw + 2(k-1) * latency) is added to its host optimizer step. Steady-state time
per iteration; tokens/s over all k nodes (each node runs its own batch).
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch
from tabulate import tabulate

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BATCH, SEQ, MBS, GPUS, STEPS, WARMUP = 8, 128, 4, 2, 6, 2
BUDGET = 12 * 2**20  # bytes per host worker: small enough to split the model into stages
MODEL = dict(vocab=256, dim=128, layers=4, heads=4, kv_heads=4, ffn=344, max_seq=SEQ)


def _batch(seed: int) -> dict:
    ids = torch.randint(0, MODEL["vocab"], (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def worker(out: str) -> None:
    """One process: compile (dist when WORLD_SIZE > 1), time the steps, write rank 0's result."""
    import rpcompile
    from rpcompile.runtime.distributed import shard
    from rpcompile.models.zoo import LlamaConfig, TinyLlama
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    local = lambda i: shard(_batch(i), rank, world)  # noqa: E731
    c = rpcompile.compile(TinyLlama(LlamaConfig(**MODEL)), gpus=GPUS, example=local(0), microbatches=MBS // world,
                          optimizer=rpcompile.AdamW(lr=1e-4, impl="foreach"), backend="host", dist=world > 1,
                          memory_budget=BUDGET)
    times = []
    for i in range(WARMUP + STEPS):
        t0 = time.perf_counter()
        loss = c.step(local(i))
        if i == WARMUP + STEPS - 1:
            c._runtime.flush()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"tokens_per_s": BATCH * SEQ / (sum(times[WARMUP:]) / STEPS), "loss": loss,
                       "plan": c.plan.to_str()}, f)
    c.close()


def measured(world: int) -> dict:
    """Run `worker` as `world` processes (torchrun's env) and return rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        code = f"import sys; sys.path.insert(0, 'bench'); from distributed import worker; worker({out!r})"
        procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(
            os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
            for r in range(world)]
        for p in procs:
            if p.wait(timeout=600):
                raise RuntimeError(f"bench worker exited with {p.returncode}")
        return json.load(open(out))


def simulated() -> list[list]:
    """Steady tokens/s of llama3.1-8b on k x 8 x RTX 4090 for a few networks."""
    from rpcompile.ir.hardware import Hardware
    from rpcompile.models.planning import plan_model
    from rpcompile.runtime import simulate, steady_iterations
    hw = Hardware.preset("rtx4090")
    r = plan_model("llama3.1-8b", gpus=8, hardware=hw, seq=2048, microbatches=16)
    k = steady_iterations(r.program)
    base = None
    rows = []
    for nodes, net, bw in ((1, "-", 12.5e9), (2, "100 Gb/s (12.5 GB/s)", 12.5e9), (2, "25 GB/s (200 Gb/s)", 25e9),
                           (4, "25 GB/s (200 Gb/s)", 25e9)):
        t = simulate(r.program, r.costs, hw.replace(net_bandwidth=bw, net_latency=10e-6), iterations=k, nodes=nodes)
        tps = nodes * r.tokens / t.steady_iteration_time
        base = base or tps
        rows.append([f"{nodes} x 8 x RTX 4090", net, f"{t.steady_iteration_time:.3f}", f"{tps:,.0f}",
                     f"{tps / (nodes * base):.0%}"])
    return rows, r.plan.to_str(), r.params


def main() -> None:
    one, two = measured(1), measured(2)
    mrows = [["1 process", f"{GPUS} host workers, {MBS} microbatches", f"{one['tokens_per_s']:,.0f}", "1.00",
              one["plan"]],
             ["2 processes (gloo)", f"{GPUS} host workers, {MBS // 2} microbatches each",
              f"{two['tokens_per_s']:,.0f}", f"{two['tokens_per_s'] / one['tokens_per_s']:.2f}", two["plan"]]]
    mtable = tabulate(mrows, headers=["run", "per process", "tokens/s", "ratio", "plan"], disable_numparse=True)
    srows, plan, params = simulated()
    stable = tabulate(srows, headers=["cluster", "network", "iteration (s)", "tokens/s", "scaling efficiency"],
                      disable_numparse=True)
    cpu = f"{os.cpu_count()} cores"
    head = (f"# distributed (data parallel) benchmark\n\ncommand: `python bench/distributed.py`  \n"
            f"date: {datetime.date.today()}  \nmachine: {cpu}, torch {torch.__version__}  \n\n"
            f"## Measured on this machine\n\nTinyLlama dim {MODEL['dim']}, {MODEL['layers']} layers, vocab "
            f"{MODEL['vocab']}; global batch {BATCH} x seq {SEQ} in {MBS} microbatches per iteration, staleness 1, "
            f"{STEPS} timed steps after {WARMUP} warm-up; cores split evenly between processes\n\n```\n{mtable}\n```\n\n"
            f"## Simulated: llama3.1-8b ({params / 1e9:.1f} B params), plan {plan}\n\n"
            f"8 x RTX 4090 per node, seq 2048, 16 microbatches per node per iteration, staleness 1; the fp32 "
            f"gradient of each layer group is ring all-reduced on the host optimizer lane before its step "
            f"(latency 10 us)\n\n```\n{stable}\n```\n")
    print(head)
    out = os.path.join(ROOT, "docs", "bench", "distributed.md")
    with open(out, "w") as f:
        f.write(head)


if __name__ == "__main__":
    main()
