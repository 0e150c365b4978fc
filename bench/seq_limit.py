"""`max_seq_len` against the admission boundary (issue 47, criterion 2): is the printed limit what `plan` admits?

For each model (8x rtx4090, 16 microbatches, the preset's 512 GiB of host memory), side by side in one run:

- the `max_seq_len` that `python -m rpcompile plan --seq 2048` prints, with the package of `--before` (loaded
  from git with `_common.tree_at`, in its own process) and with today's;
- the admission boundary: the longest N such that `plan --seq N` is admitted (device and host checks), found
  by a bisection over `plan_model(..., seq=N, seq_limit=False)` (what `plan --seq N` runs), starting from
  the printed limit and doubling the step outwards until the answer changes;
- whether `plan --seq` admits the printed N and refuses N + 1;
- with `--below K`, whether K lengths evenly spaced below the boundary are admitted too (the bisection assumes so).

Each admission at these lengths takes 1-15 s (tracing and counting at that length, partition, emit, the buffer
assignment), so the whole run takes several minutes.

    python bench/seq_limit.py [--before REV] [--models qwen3-1.7b llama3.1-8b] [--below K] [--out seq_limit.md]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_line, tree_at, write_doc  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ("--gpus", "8", "--hardware", "rtx4090", "--microbatches", "16")
MODELS = {"qwen3-1.7b": (), "llama3.1-8b": (), "qwen3-235b-a22b": ("--frozen-base",), "gpt-oss-20b": ()}


def printed_limit(model: str, extra: tuple, tree: str | None) -> int:
    """The `max_seq_len` line of `plan --seq 2048`, run with the package at `tree` (None: today's)."""
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree
    out = subprocess.run([sys.executable, "-m", "rpcompile", "plan", "--model", model, "--seq", "2048", *ARGS,
                          *extra], capture_output=True, text=True, env=env, cwd=tree or ROOT)
    found = re.search(r"^max_seq_len on .*?: ([\d,]+) tokens", out.stdout, re.M)
    if found is None:
        raise SystemExit(f"plan {model} {' '.join(extra)} printed no max_seq_len:\n{out.stdout}\n{out.stderr}")
    return int(found.group(1).replace(",", ""))


def admits(model: str, extra: tuple, seq: int, log: list) -> bool:
    """Whether `plan --seq seq` admits the run (today's tree): `plan_model` without its own limit."""
    from rpcompile.models.planning import plan_model
    t = time.perf_counter()
    try:
        plan_model(model, gpus=8, hardware="rtx4090", seq=seq, microbatches=16, frozen_base="--frozen-base" in extra,
                   seq_limit=False)
        ok = True
    except ValueError:
        ok = False
    log.append((seq, ok, time.perf_counter() - t))
    return ok


def boundary(model: str, extra: tuple, start: int, log: list) -> int:
    """The longest admitted length, searched from `start`: a step doubled outwards until admission changes,
    then a bisection (assumes that plan admits every length below one it admits)."""
    if admits(model, extra, start, log):
        lo, step = start, 1
        while admits(model, extra, lo + step, log):
            lo, step = lo + step, 2 * step
        hi = lo + step
    else:
        hi, step = start, 1
        while not admits(model, extra, max(hi - step, 1), log):
            if hi - step <= 1:
                return 0
            hi, step = hi - step, 2 * step
        lo = max(hi - step, 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if admits(model, extra, mid, log) else (lo, mid)
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default="HEAD", help="the git revision to compare with (default HEAD)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--out", default="seq_limit.md", help="docs/bench/ file to write ('' to print only)")
    ap.add_argument("--below", type=int, default=0, metavar="K",
                    help="also try K lengths evenly spaced in [3/4 of the boundary, the boundary): the bisection "
                         "assumes plan admits every length below one it admits; these check it")
    args = ap.parse_args()
    tree = tree_at(args.before)
    rows, logs = [], []
    try:
        for model in args.models:
            extra = MODELS[model]
            before, after = printed_limit(model, extra, tree), printed_limit(model, extra, None)
            log: list = []
            edge = boundary(model, extra, after, log)
            at = next(ok for s, ok, _ in log if s == after)
            past = next((ok for s, ok, _ in log if s == after + 1), None)
            if past is None:
                past = admits(model, extra, after + 1, log)
            tried = [edge * 3 // 4 + i * (edge - edge * 3 // 4) // args.below for i in range(args.below)]
            below = sum(admits(model, extra, s, log) for s in tried if s > 0)
            rows.append([f"{model} {' '.join(extra)}".strip(), f"{before:,}", f"{after:,}", f"{edge:,}",
                         "yes" if at else "no", "no" if not past else "yes", f"{after / edge:.4f}" if edge else "-",
                         f"{below}/{len(tried)}" if tried else "-", len(log),
                         f"{sum(t for *_, t in log) / len(log):.1f}"])
            logs.append((model, log))
            print(rows[-1], flush=True)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    head = ["model", f"max_seq_len before ({args.before})", "after", "admission boundary", "plan admits it",
            "plan admits it + 1", "after / boundary", "admitted below", "admissions", "s each"]
    text = "\n\n".join([
        "### seq_limit: the printed `max_seq_len` against the admission boundary (issue 47, criterion 2)",
        machine_line(),
        "`plan --seq 2048` (8x rtx4090, 16 microbatches, 512 GiB of host memory): the `max_seq_len` it prints "
        f"with the package at `{args.before}` and today's; the longest `--seq` that `plan` admits (bisection over "
        "`plan_model(..., seq_limit=False)`, today's tree); `plan --seq` at the printed limit and one token "
        "past it" + (f"; and how many of {args.below} lengths evenly spaced below the boundary, from 3/4 of it, "
                     "are admitted too (`--below`)." if args.below else "."),
        tabulate(rows, headers=head, tablefmt="github"),
        "Admissions tried (length: admitted?):\n\n" + "\n".join(
            f"- {m}: " + ", ".join(f"{s:,} {'yes' if ok else 'no'}" for s, ok, _ in log) for m, log in logs)])
    print(text)
    if args.out:
        print("wrote", write_doc(args.out, text))


if __name__ == "__main__":
    main()
