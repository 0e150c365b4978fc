"""bench/runtime_cpu.py --quick, today's tree against an earlier revision's, pair by pair in one run.

    python bench/runtime_cpu_compare.py --before 217a999 --pairs 4

Each pair runs the earlier revision's own `bench/runtime_cpu.py --quick` (its package, bench and tests
from `git archive`, on PYTHONPATH, checked to be the one imported) and then this tree's, and reads the
compiled / eager tokens/s ratio at 1, 2 and 4 host workers (the plain rows: rounds of the default
size, the host backend). The two trees' eager baselines are the same code, so the ratios compare the
runtimes. Prints a table per pair and the medians, with the 1-minute load average at each start, and
writes docs/bench/runtime_cpu_compare.md.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_line, write_doc  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = ("1", "2", "4")
# a plain row of runtime_cpu.py's table: "| rpcompile gpus=N (plan, R=k) | N | tokens/s | vs eager | ..."
ROW = re.compile(r"^\| rpcompile gpus=(\d) \([^)\[]*\)\s*\|\s*\d+\s*\|\s*[\d,]+\s*\|\s*([\d.]+)")


def old_tree(rev: str) -> str:
    """The package, bench/ and tests/ of `rev` in a temporary folder, laid out as installed."""
    out = tempfile.mkdtemp(prefix="rpcompile-before-")
    tar = subprocess.run(["git", "archive", rev, "rpcompile", "passes", "runtime", "bench", "tests"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=tar, check=True)
    for part in ("passes", "runtime"):
        os.rename(os.path.join(out, part), os.path.join(out, "rpcompile", part))
    return out


def ratios(cwd: str, env: dict) -> dict[str, float]:
    """compiled / eager at each worker count, from one `runtime_cpu.py --quick` run in `cwd`."""
    out = subprocess.run([sys.executable, "bench/runtime_cpu.py", "--quick"], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(f"runtime_cpu.py in {cwd} failed:\n{out.stderr[-3000:]}")
    found = {}
    for line in out.stdout.splitlines():
        m = ROW.match(line)
        if m and m.group(1) not in found and "R=1)" not in line:
            found[m.group(1)] = float(m.group(2))
    return found


def load() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default="217a999", help="git revision to compare with")
    p.add_argument("--pairs", type=int, default=4, help="runs of each, alternating")
    args = p.parse_args()
    old = old_tree(args.before)
    try:
        old_env = dict(os.environ, PYTHONPATH=old)
        check = subprocess.run([sys.executable, "-c", "import rpcompile; print(rpcompile.__file__)"], cwd=old,
                               env=old_env, capture_output=True, text=True, check=True).stdout.strip()
        assert check.startswith(old), f"the old run imported {check}, not the tree of {args.before}"
        rows, got = [], {"before": [], "now": []}
        for i in range(1, args.pairs + 1):
            for name, cwd, env in (("before", old, old_env), ("now", ROOT, dict(os.environ))):
                start = load()
                r = ratios(cwd, env)
                got[name].append(r)
                rows.append([i, name if name == "now" else f"before ({args.before})", f"{start:.2f}",
                             *(r.get(w, float("nan")) for w in WORKERS)])
                print(rows[-1], flush=True)
        med = [["median", name if name == "now" else f"before ({args.before})", "",
                *(statistics.median(r[w] for r in got[name] if w in r) for w in WORKERS)]
               for name in ("before", "now")]
        head = ["pair", "tree", "load at start", *(f"compiled / eager, {w} worker(s)" for w in WORKERS)]
        table = tabulate(rows + med, headers=head, tablefmt="github", floatfmt=".2f")
        print(table)
        write_doc("runtime_cpu_compare.md", "\n".join([
            f"# runtime_cpu_compare: compiled / eager now and at {args.before}, pair by pair", "",
            machine_line(), "",
            "Each pair runs the old tree's `bench/runtime_cpu.py --quick` and then this tree's; the ratio is the "
            "compiled model's tokens/s over eager PyTorch's (checkpoint per layer, fused AdamW) measured in the "
            "same run, at 1, 2 and 4 host workers (rounds of the default size).", "", table]))
    finally:
        shutil.rmtree(old, ignore_errors=True)


if __name__ == "__main__":
    main()
