"""Seconds inside `rpcompile.compile` for the tests' Hugging Face zoo models, now and at a git revision before
(issue 31: the planner is part of every compile, which must be no slower than before).

Each compile runs in a fresh process (costs measured on the CPU, the default), for the current tree and for
a copy of the tree at `--before` (`_common.tree_at`), alternating between the two, `--runs` times each; the
table gives the median seconds of each and their ratio, and the plans each chose (a plan may differ: the
trees rank measured costs with different ties, 5% before and `rpcompile.pipeline.measured_tie` now).

    python bench/compile_zoo.py [--runs 3] [--before 217a999]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_line, tree_at, write_doc  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("llama", "qwen3", "qwen3_moe", "gpt2")  # tests/models.py: tiny transformers models, random weights

CHILD = """
import json, sys, time, torch, rpcompile, models
model = getattr(models, sys.argv[1])(seed=0)
t = time.perf_counter()
c = rpcompile.compile(model, gpus=2, example=models.lm_batch(batch=4, seq=16), microbatches=2, seed=0)
print(json.dumps({"seconds": time.perf_counter() - t, "plan": c.plan.to_str()}))
c.close()
"""


def compile_once(model: str, tree: str | None) -> dict:
    """One fresh-process compile of a zoo model on the current tree (None) or the tree at `tree`."""
    path = os.pathsep.join([tree or ROOT, os.path.join(ROOT, "tests")])
    r = subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True, timeout=900,
                       cwd=tree or ROOT, env={**os.environ, "PYTHONPATH": path})
    if r.returncode:
        raise RuntimeError(f"compile of {model} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--before", default="217a999")
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args()
    tree = tree_at(args.before)
    rows = []
    try:
        for model in MODELS:
            now, old = [], []
            for _ in range(args.runs):  # interleaved: both trees see about the same load
                now.append(compile_once(model, None))
                old.append(compile_once(model, tree))
            a = statistics.median(r["seconds"] for r in now)
            b = statistics.median(r["seconds"] for r in old)
            rows.append([model, f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}", " ; ".join(sorted({r["plan"] for r in now})),
                         " ; ".join(sorted({r["plan"] for r in old}))])
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    table = tabulate(rows, headers=["model", "compile s (now)", f"compile s ({args.before})", "now / before",
                                    "plans now", f"plans at {args.before}"], tablefmt="github", disable_numparse=True)
    print(table)
    load = os.getloadavg()
    if not args.no_doc:
        write_doc("compile_zoo.md", "## compile_zoo: `rpcompile.compile` of the tests' transformers models, now and "
                  f"before\n\n{machine_line()}  \nload average at the end: {load[0]:.2f}, {load[1]:.2f}, "
                  f"{load[2]:.2f} ({os.cpu_count()} cores, shared)\n\n"
                  f"Seconds inside `rpcompile.compile` (gpus=2, 2 microbatches, batch 4 x 16, costs measured on "
                  f"the CPU), median of {args.runs} fresh processes per tree, the trees alternating.\n\n" + table)


if __name__ == "__main__":
    main()
