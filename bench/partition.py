"""Planning time and plan quality of `partition` vs the RoundPipe reference heuristic.

    python bench/partition.py

Writes the table to docs/bench/partition.md (the lead assembles docs/BENCHMARKS.md).
"""
from __future__ import annotations

import datetime
import os
import platform
import random
import statistics
import sys
import time

import torch
from tabulate import tabulate

from rpcompile import CostTable, StagePlan
from rpcompile.passes import partition
from rpcompile.passes.timing import iteration_time

GPUS, MICROBATCHES, STALENESS = 8, 16, 1


def realistic(layers: int, seed: int = 0) -> CostTable:
    """Embedding (tiny), decoder layers fwd 1 ms / bwd 2 ms +-10%, LM head 3x a layer."""
    rng = random.Random(seed)
    fwd = [1e-5] + [1e-3 * rng.uniform(0.9, 1.1) for _ in range(layers - 2)] + [3e-3]
    bwd = [2e-5] + [2e-3 * rng.uniform(0.9, 1.1) for _ in range(layers - 2)] + [6e-3]
    return CostTable.from_lists(fwd=fwd, bwd=bwd)


def _greedy(w: list[float], cap: float) -> list[int]:
    sizes, acc = [], None
    for x in w:
        if acc is not None and acc + x <= cap * (1 + 1e-12):
            sizes[-1] += 1
            acc += x
        else:
            sizes.append(1)
            acc = x
    return sizes


def roundpipe_reference(c: CostTable) -> StagePlan:
    """t_max in [max layer, 1.1 x max layer], greedy grouping, cost max(S, N) x t_max."""
    wb = [a + b for a, b in zip(c.fwd, c.bwd)]
    lo = max(wb)
    best = None
    for i in range(11):
        cap = lo * (1 + 0.01 * i)
        for f in range(1, c.num_layers + 1):
            if sum(wb[-f:]) > cap:
                break
            n = c.num_layers - f
            fs, bs = _greedy(list(c.fwd[:n]), cap), _greedy(wb[:n][::-1], cap)
            s = len(fs) + 1 + len(bs)
            cost = max(s, GPUS) * cap
            if best is None or cost < best[0]:
                best = (cost, StagePlan.from_sizes(fs if n else [], f, bs if n else []))
    return best[1]


def main() -> None:
    rows = []
    for layers in (28, 32, 64, 94, 1000):
        c = realistic(layers)
        runs = 3 if layers >= 1000 else 7
        times, plan = [], None
        for _ in range(runs):
            t0 = time.perf_counter()
            plan = partition(c, gpus=GPUS, microbatches=MICROBATCHES, staleness=STALENESS)
            times.append(time.perf_counter() - t0)
        kw = dict(gpus=GPUS, microbatches=MICROBATCHES, staleness=STALENESS)
        ours = iteration_time(plan, c, **kw)
        ref_plan = roundpipe_reference(c)
        ref = iteration_time(ref_plan, c, **kw)
        rows.append([layers, f"{statistics.median(times) * 1e3:.1f}", plan.num_stages, f"{ours * 1e3:.2f}",
                     ref_plan.num_stages, f"{ref * 1e3:.2f}", f"{ours / ref:.3f}"])
    table = tabulate(rows, headers=["layers", "plan ms (median)", "stages", "iteration ms",
                                    "ref stages", "ref iteration ms", "ours / ref"], tablefmt="github")
    print(table)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    out = os.path.join(os.path.dirname(__file__), "..", "docs", "bench", "partition.md")
    with open(out, "w") as fh:
        fh.write(f"## partition: planning time and plan quality\n\n`python {' '.join(sys.argv)}` on "
                 f"{datetime.date.today()}, {cpu}, {os.cpu_count()} cores, torch {torch.__version__}. "
                 f"{GPUS} GPUs, {MICROBATCHES} microbatches, staleness {STALENESS}; ref = RoundPipe "
                 f"reference heuristic (t_max in [max layer, 1.1 max layer], greedy, max(S, N) x t_max).\n\n"
                 f"{table}\n\nNo memory budget here: under staleness 1 consecutive iterations overlap on "
                 f"different workers, so with unlimited memory the fastest plans fuse about half the model "
                 f"(no recompute there) into 3 stages. With a real per-GPU budget those plans do not fit and "
                 f"`partition` picks among the plans that do.\n")


if __name__ == "__main__":
    main()
