"""Wall time of `python -m rpcompile plan --model M` for the five paper models (issue 7: < 30 s each).

Each model runs in a fresh process, as a user would, on the `meta` device; the
table also gives the process's peak resident memory, to show no weights were
allocated (qwen3-235b-a22b has 470 GB of bf16 weights).

    python bench/plan_cli.py
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_line, write_doc  # noqa: E402

MODELS = ("qwen3-1.7b", "llama3.1-8b", "gpt-oss-20b", "qwen3-32b", "qwen3-235b-a22b")


def run(model: str) -> list:
    """One CLI run: [model, wall s, peak RSS GiB, plan line, tokens/s line]."""
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "rpcompile", "plan", "--model", model], capture_output=True,
                         text=True, timeout=600)
    wall = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    if out.returncode:
        return [model, f"{wall:.1f}", f"{rss:.2f}", "FAILED: " + out.stderr.strip().splitlines()[-1], ""]
    ours = next((line for line in out.stdout.splitlines() if line.startswith("rpcompile (RoundPipe)")), "")
    tokens = ours.split()[3] if ours else "?"
    stages = next((line.split(":")[1].split(",")[0].strip() for line in out.stdout.splitlines()
                   if line.startswith("plan ")), "?")
    return [model, f"{wall:.1f}", f"{rss:.2f}", stages, tokens]


def main() -> None:
    rows = [run(m) for m in MODELS]
    table = tabulate(rows, headers=["model", "wall s (whole process)", "max RSS GiB so far", "plan",
                                    "simulated tokens/s"], tablefmt="github")
    print(table)
    write_doc("plan_cli.md", "## plan_cli: `python -m rpcompile plan` for the paper models\n\n" + machine_line()
              + "\n\n8x rtx4090, seq 2048, 16 microbatches (the CLI defaults); each model in a fresh process, "
              "imports included. Target: under 30 s each, no weights allocated. RSS is the largest of the "
              "child processes so far.\n\n" + table)


if __name__ == "__main__":
    main()
