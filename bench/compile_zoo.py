"""Seconds inside `rpcompile.compile` for the tests' Hugging Face zoo models, now and at a git revision before
(issue 31: the planner is part of every compile, which must be no slower than before).

Each compile runs in a fresh process (costs measured on the CPU, the default), for the current tree and for
a copy of the tree at `--before` (`_common.tree_at`), alternating between the two, `--runs` times each; the
table gives the median seconds of each and their ratio, and the plans each chose (a plan may differ: the
trees rank measured costs with different ties, 5% before and `rpcompile.pipeline.measured_tie` now).

Python's cyclic collector: importing torch and transformers and building a model leave ~430k objects, and
the full collections (~0.2-0.3 s each here) they make due fall wherever the collector's counters happen to
cross its thresholds: at 217a999 all three while the model is built, now two there and the third inside
`compile`. So each tree is timed twice per run: once after a `gc.collect()` (the passes' own work, the main
columns) and once right after building the model, as a user's script runs, with the full collections'
seconds inside the timed call beside, the seconds of model building and `compile` together, and the number
of full collections in each.

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
import gc, json, sys, time, torch, rpcompile, models
full = {"n": 0, "s": 0.0, "start": 0.0}  # the full (generation 2) collections so far, and their seconds
def clock(phase, info):
    if info["generation"] != 2:
        return
    if phase == "start":
        full["start"] = time.perf_counter()
    else:
        full["n"] += 1
        full["s"] += time.perf_counter() - full["start"]
gc.callbacks.append(clock)
t0 = time.perf_counter()
model = getattr(models, sys.argv[1])(seed=0)
if sys.argv[2] == "collect":
    gc.collect()
built, n_built, s_built = time.perf_counter(), full["n"], full["s"]
c = rpcompile.compile(model, gpus=2, example=models.lm_batch(batch=4, seq=16), microbatches=2, seed=0)
done = time.perf_counter()
gc.callbacks.remove(clock)
print(json.dumps({"seconds": done - built, "gc": full["s"] - s_built, "build_and_compile": done - t0,
                  "full_in_build": n_built, "full_in_compile": full["n"] - n_built, "plan": c.plan.to_str()}))
c.close()
"""


def compile_once(model: str, tree: str | None, collect: bool) -> dict:
    """One fresh-process compile of a zoo model on the current tree (None) or the tree at `tree`, after a
    `gc.collect()` if `collect`."""
    path = os.pathsep.join([tree or ROOT, os.path.join(ROOT, "tests")])
    r = subprocess.run([sys.executable, "-c", CHILD, model, "collect" if collect else "as-built"],
                       capture_output=True, text=True, timeout=900,
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
            runs = {(t, c): [] for t in (None, tree) for c in (True, False)}
            for _ in range(args.runs):  # interleaved: both trees see about the same load
                for key, out in runs.items():
                    out.append(compile_once(model, *key))
            med = {k: {f: statistics.median(r[f] for r in v)
                       for f in ("seconds", "gc", "build_and_compile", "full_in_build", "full_in_compile")}
                   for k, v in runs.items()}
            now, before, now_ab, before_ab = med[None, True], med[tree, True], med[None, False], med[tree, False]
            rows.append([model, f"{now['seconds']:.2f}", f"{before['seconds']:.2f}",
                         f"{now['seconds'] / before['seconds']:.2f}",
                         f"{now_ab['seconds']:.2f} ({now_ab['gc']:.2f})", f"{before_ab['seconds']:.2f} ({before_ab['gc']:.2f})",
                         f"{now_ab['build_and_compile']:.2f} / {before_ab['build_and_compile']:.2f}",
                         f"{now_ab['full_in_build']:g}+{now_ab['full_in_compile']:g} / "
                         f"{before_ab['full_in_build']:g}+{before_ab['full_in_compile']:g}",
                         " ; ".join(sorted({r["plan"] for v in (runs[None, True], runs[None, False]) for r in v})),
                         " ; ".join(sorted({r["plan"] for v in (runs[tree, True], runs[tree, False]) for r in v}))])
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    table = tabulate(rows, headers=["model", "compile s (now)", f"compile s ({args.before})", "now / before",
                                    "as built: now s (full GC s)", f"as built: {args.before} s (full GC s)",
                                    f"as built: model build + compile s, now / {args.before}",
                                    f"full GCs in build+compile, now / {args.before}",
                                    "plans now", f"plans at {args.before}"], tablefmt="github", disable_numparse=True)
    print(table)
    load = os.getloadavg()
    if not args.no_doc:
        write_doc("compile_zoo.md", "## compile_zoo: `rpcompile.compile` of the tests' transformers models, now and "
                  f"before\n\n{machine_line()}  \nload average at the end: {load[0]:.2f}, {load[1]:.2f}, "
                  f"{load[2]:.2f} ({os.cpu_count()} cores, shared)\n\n"
                  f"Seconds inside `rpcompile.compile` (gpus=2, 2 microbatches, batch 4 x 16, costs measured on "
                  f"the CPU), median of {args.runs} fresh processes per tree and mode, the trees alternating: "
                  f"after a `gc.collect()`, and (the 'as built' columns) right after building the model, with "
                  f"the seconds of full (generation 2) collections inside the call in brackets, the seconds "
                  f"from before building the model to the end of `compile`, and how many full collections "
                  f"fell in the building and how many in `compile` (medians).\n\n" + table)


if __name__ == "__main__":
    main()
