"""Trace time of a 12-layer ~134M-parameter Llama (hidden 768, FFN 2048, vocab 32000).

Run: `python bench/trace.py`. Prints a table with the median of several traces
(after one warm-up trace, which pays one-time import costs).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from models import lm_batch, llama_134m, param_count  # noqa: E402
from rpcompile.passes import trace  # noqa: E402


def bench(runs: int = 7, batch: int = 8, seq: int = 512) -> list[list[object]]:
    """Rows of (model, params, device, example, layers, median ms, min ms)."""
    rows = []
    for device in ("cpu", "meta"):
        model = llama_134m(device)
        example = lm_batch(batch=batch, seq=seq, vocab=32000)
        trace(model, example)  # warm-up
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            graph = trace(model, example)
            times.append(time.perf_counter() - t0)
        rows.append(["llama-134M", f"{param_count(model) / 1e6:.1f}M", device, f"{batch}x{seq}",
                     len(graph.layers), f"{statistics.median(times) * 1e3:.1f}", f"{min(times) * 1e3:.1f}"])
    return rows


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import machine_line, write_doc

    torch.set_num_threads(min(2, torch.get_num_threads()))
    head = ["model", "params", "weights on", "example", "layers", "trace median ms", "min ms"]
    table = tabulate(bench(), headers=head, tablefmt="github")
    print(table)
    write_doc("trace.md", "## trace: time to trace a 134M-parameter Llama\n\n" + machine_line()
              + "\n\nMedian of 7 runs after a warm-up (the first trace in a process also pays torch's one-time "
              "imports). Target: under 0.2 s on a 2-core machine.\n\n" + table)
