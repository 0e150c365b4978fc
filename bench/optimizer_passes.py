"""The host side pass by pass (landing, statistics, copy, update), this tree against another revision's.

Usage:
    python bench/optimizer_passes.py [--before 3126498] [--params 48e6] [--groups 24] [--runs 3] [--reps 7]
                                     [--threads 1] [--out optimizer_passes.md]

For each parameter state (fp32; bf16 moments; + bf16 master; + bf16 gradients), one iteration of the
staleness-1 host side over every group, as the runtime runs it (and `bench/optimizer.py` times it), split into
its four calls: `accumulate_grad` (the gradient lands, bf16 in), `grads_complete`, `copy` (master -> bf16
compute copy) and `step` (AdamW, clipping at 1.0). A tree with alternating compute copies
(`HostState.alternate`, unsharded state) has no copy pass: the step writes the copies (its `copy` is 0); an
older one copies before the step. Each side runs in a child process of its own (`--before` from a copy of the
package at REV, `_common.tree_at`), alternating `--runs` times, so both see the machine alike; a cell is the
median over the runs of each run's median of `--reps` iterations after one warm-up. Each side builds its own
kernels (the first run of a revision builds them, before its timing starts).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_line, tree_at, write_doc  # noqa: E402
import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

PASSES = ("land", "complete", "copy", "step")
CHILD = r"""
import json, statistics, sys, time, torch
torch.set_num_threads(THREADS)
import rpcompile
from rpcompile.runtime.host.optimizer import HostState
BF = torch.bfloat16
MODES = {"fp32": {}, "bf16 moments": dict(state_dtype=BF), "bf16 moments+master": dict(state_dtype=BF, master_dtype=BF),
         "bf16 moments+master+grads": dict(state_dtype=BF, master_dtype=BF, grad_dtype=BF)}
total, groups, reps = TOTAL, GROUPS, REPS
gen = torch.Generator().manual_seed(0)
grads = [torch.randn(total // groups, generator=gen).to(BF) for _ in range(groups)]
out = {}
for mode, lean in MODES.items():
    params = {f"layer{l}.weight": torch.nn.Parameter(torch.randn(total // groups)) for l in range(groups)}
    st = HostState(params, {n: (l,) for l, n in enumerate(params)}, groups, dtype=BF,
                   optimizer=rpcompile.AdamW(lr=1e-4, max_grad_norm=1.0, **lean))
    assert st.kernels is not None, "the kernels did not build"
    del params
    times = {k: [] for k in ("land", "complete", "copy", "step")}
    alternating = hasattr(st, "alternate") and st.alternate(0)  # the runtime's staleness-1 path where the tree has it
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        for l, g in enumerate(grads):
            st.accumulate_grad(f"layer{l}.weight", g)
        t1 = time.perf_counter()
        for l in reversed(range(groups)):
            st.grads_complete(l)
        t2 = time.perf_counter()
        for l in reversed(range(groups)):
            if not alternating:
                st.copy(l)
        t3 = time.perf_counter()
        for l in reversed(range(groups)):
            st.step(l)
        t4 = time.perf_counter()
        if rep:  # the first is the warm-up
            for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[k].append(dt)
    out[mode] = {k: statistics.median(v) for k, v in times.items()}
    del st
print(json.dumps(out))
"""


def run_side(path: str | None, args: argparse.Namespace) -> dict:
    """One child run: {mode: {pass: seconds}}, with the package at `path` first on sys.path (None: this tree's)."""
    code = (CHILD.replace("THREADS", str(args.threads)).replace("TOTAL", str(int(args.params)))
            .replace("GROUPS", str(args.groups)).replace("REPS", str(args.reps)))
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=tempfile.gettempdir())  # not this checkout: `-c` puts the working folder first on sys.path
    # (a side's package must come from PYTHONPATH, or from the installed tree for this one)
    if done.returncode != 0:
        raise SystemExit(f"optimizer_passes: a child run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="3126498", help="the revision to compare with (default 3126498: before the "
                    "gradient's first landing and the update's writes were streamed)")
    ap.add_argument("--params", type=float, default=48e6, help="fp32 parameters in all (default 48e6)")
    ap.add_argument("--groups", type=int, default=24, help="layer groups, one tensor each (default 24)")
    ap.add_argument("--runs", type=int, default=3, help="child runs per side, alternating (default 3)")
    ap.add_argument("--reps", type=int, default=7, help="timed iterations per child run (default 7)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in the children (default 1)")
    ap.add_argument("--out", default="optimizer_passes.md", help="docs/bench file ('' prints only)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # what machine_line reports: the children's count
    tree = tree_at(args.before)
    try:
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for _ in range(args.runs):
            runs["before"].append(run_side(tree, args))
            runs["after"].append(run_side(None, args))
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    rows = []
    for mode in runs["after"][0]:
        cell = {side: {p: statistics.median(r[mode][p] for r in runs[side]) * 1e3 for p in PASSES} for side in runs}
        for p in (*PASSES, "all"):
            b = sum(cell["before"].values()) if p == "all" else cell["before"][p]
            a = sum(cell["after"].values()) if p == "all" else cell["after"][p]
            rows.append((mode if p == "land" else "", p, b, a, f"{b / a:.2f}" if max(a, b) >= 0.05 else ""))  # a
            # pass of no work on both sides (the copy where the step writes it): no ratio of timer noise
    table = tabulate(rows, headers=["state", "pass", f"{args.before} ms", "this tree ms", "speed-up"],
                     floatfmt=("", "", ".1f", ".1f", ""), tablefmt="github")
    fp32 = {side: sum(statistics.median(r["fp32"][p] for r in runs[side]) for p in PASSES) for side in runs}
    lean = "\n".join(
        f"- {mode}: {fp32['after'] / sum(statistics.median(r[mode][p] for r in runs['after']) for p in PASSES):.2f}x "
        f"the fp32 state's whole host side (at {args.before}: "
        f"{fp32['before'] / sum(statistics.median(r[mode][p] for r in runs['before']) for p in PASSES):.2f}x)"
        for mode in runs["after"][0] if mode != "fp32")
    text = (f"# The host side pass by pass, against {args.before}\n\n"
            f"{machine_line()}  \n"
            f"{args.params / 1e6:.0f}M parameters in {args.groups} groups, bf16 gradients in, AdamW with clipping, "
            f"the staleness-1 path (alternating copies where a tree has them, else the copy before the step); "
            f"{args.threads} torch thread(s); each side in its own child "
            f"process, alternating, {args.runs} runs of {args.reps} iterations\n\n{table}\n\n{lean}\n")
    print(write_doc(args.out, text) if args.out else text)


if __name__ == "__main__":
    main()
