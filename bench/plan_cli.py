"""Wall time of `python -m rpcompile plan --model M` for the five paper models, beside a fresh `import torch,
transformers` timed in the same run (issue 31: at most 3 s plus that import; issue 7: < 30 s each).

Each model runs in a fresh process, as a user would, on the `meta` device (8x rtx4090, seq 2048, 16
microbatches); the import baseline is the median of 3 fresh processes, measured before and after the models
so that a change in the machine's load shows. The table also gives the process's peak resident memory, to
show no weights were allocated (qwen3-235b-a22b has 470 GB of bf16 weights).

    python bench/plan_cli.py [MODEL ...]
"""
from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time

from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_line, write_doc  # noqa: E402

MODELS = ("qwen3-1.7b", "llama3.1-8b", "gpt-oss-20b", "qwen3-32b", "qwen3-235b-a22b")
ARGS = ["--gpus", "8", "--hardware", "rtx4090", "--seq", "2048", "--microbatches", "16"]


def import_seconds(runs: int = 3) -> float:
    """Median wall seconds of a fresh `python -c "import torch, transformers"`."""
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch, transformers"], check=True)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def run(model: str) -> list:
    """One CLI run: [model, wall s, peak RSS GiB, plan, max_seq_len, tokens/s]."""
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "rpcompile", "plan", "--model", model, *ARGS], capture_output=True,
                         text=True, timeout=900)
    wall = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    if out.returncode:
        return [model, f"{wall:.1f}", f"{rss:.2f}", "FAILED: " + out.stderr.strip().splitlines()[-1], "", ""]
    ours = next((line for line in out.stdout.splitlines() if line.startswith("rpcompile (RoundPipe)")), "")
    tokens = ours.split()[3] if ours else "?"
    stages = next((line.split(":")[1].split(",")[0].strip() for line in out.stdout.splitlines()
                   if line.startswith("plan ")), "?")
    longest = next((line.split(": ", 1)[1].split(";")[0] for line in out.stdout.splitlines()
                    if line.startswith("max_seq_len")), "?")
    return [model, f"{wall:.1f}", f"{rss:.2f}", stages, longest, tokens]


def main() -> None:
    models = sys.argv[1:] or MODELS
    before = import_seconds()
    rows = [run(m) for m in models]
    after = import_seconds()
    base = max(before, after)
    for r in rows:
        r.insert(2, "yes" if float(r[1]) <= 3 + base else "NO")
    table = tabulate(rows, headers=["model", "wall s (whole process)", f"<= 3 s + import ({3 + base:.1f} s)",
                                    "max RSS GiB so far", "plan", "max_seq_len", "simulated tokens/s"],
                     tablefmt="github", disable_numparse=True)
    print(table)
    load = os.getloadavg()
    write_doc("plan_cli.md", "## plan_cli: `python -m rpcompile plan` for the paper models\n\n" + machine_line()
              + f"  \nload average at the end: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} (2 cores, shared)\n\n"
              f"`python -m rpcompile plan --model M {' '.join(ARGS)}`, each model in a fresh process, imports "
              f"included. A fresh `import torch, transformers` took {before:.2f} s before the models and "
              f"{after:.2f} s after (median of 3 each); target (issue 31): at most 3 s plus that. No weights are "
              f"allocated; RSS is the largest of the child processes so far.\n\n" + table)


if __name__ == "__main__":
    main()
