"""Wall time of `python -m rpcompile plan --model M` for the five paper models, beside a fresh `import torch,
transformers` and the same command on the tree before issue 31, all timed in the same run (issue 31: at most
3 s plus that import, the same plan and max_seq_len as before; issue 7: < 30 s each).

Each model runs in a fresh process, as a user would, on the `meta` device (8x rtx4090, seq 2048, 16
microbatches). qwen3-32b and qwen3-235b-a22b do not fit the rtx4090 preset's 512 GiB of host memory
(549 GiB and 3,941 GiB of parameter state; the command refuses them before planning, before issue 31 as
well), so they are also planned with --host-memory 1024 / 8192; qwen3-235b-a22b also with --frozen-base,
the paper's configuration (issue 46: at most 3 s plus the import as well). The current
tree's command runs 3 times per row, each run right after a fresh `import torch, transformers`, and the
row compares the two medians (the machine's speed drifts by tens of percent over minutes here: a pair run
side by side sees about the same). The "before" command runs on a copy of the tree at `--before`
(`_common.tree_at`), once, right after, so both see about the same load, and so does the tree at `--same-as` (after issue 33, whose costs the
command prints since): its plan line must be today's, and its max_seq_len line too but where issues 47 and 48
changed how the host memory is counted (the column says which line differs). A fresh process that imports
torch and transformers and builds the model on meta with transformers alone (median of 3 per model) shows
the share of the time that is transformers' (its modeling module's imports, deferred by `import
transformers`). The table also gives the process's CPU seconds (user + system, its children included: less
sensitive to the load than the wall clock).

Every tree is byte-compiled first (`compileall`), as `pip install` leaves a package and as Python's first
import does where it may write: this machine sets PYTHONDONTWRITEBYTECODE=1, under which each command would
compile rpcompile's modules from source again (about 0.3-0.5 s here), while torch and transformers load theirs.

    python bench/plan_cli.py [--before REV] [--same-as REV] [--no-before] [--only TEXT] [MODEL ...]

A subset (models named, or `--only TEXT`: the rows whose model and flags contain TEXT) prints its table
without writing docs/bench/plan_cli.md.
"""
from __future__ import annotations

import argparse
import compileall
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_line, tree_at, write_doc  # noqa: E402
from partition import GPUS, MICROBATCHES, STALENESS, Before, predicted_costs  # noqa: E402

MODELS = ("qwen3-1.7b", "llama3.1-8b", "gpt-oss-20b", "qwen3-32b", "qwen3-235b-a22b")
HOST = {"qwen3-32b": "1024", "qwen3-235b-a22b": "8192"}  # GiB: these refuse at the preset's 512 GiB
FROZEN = ("qwen3-235b-a22b",)  # also planned with --frozen-base: the paper's configuration (fits 512 GiB)
ARGS = ["--gpus", "8", "--hardware", "rtx4090", "--seq", "2048", "--microbatches", "16"]
BEFORE = "217a999"  # the tree before issue 31
SAME_AS = "3e652d2"  # after issue 33 (its costs: the output since), before this session's speed-ups


def _cpu() -> float:
    """CPU seconds (user + system) of the finished children so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def byte_compile(*trees: str) -> None:
    """Write the bytecode of every module under `trees` (the package's source folders, or a `tree_at` copy)."""
    for tree in trees:
        if not compileall.compile_dir(tree, quiet=1):
            raise RuntimeError(f"byte-compiling {tree} failed")


def import_seconds() -> float:
    """Wall seconds of one fresh `python -c "import torch, transformers"`."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers"], check=True)
    return time.perf_counter() - t


def paired(model: str, extra: list[str], runs: int = 3) -> tuple[dict, float]:
    """(the median run of the current tree's command, the median of a fresh import run before each)."""
    pairs = [(import_seconds(), run(model, extra)) for _ in range(runs)]
    walls = sorted(pairs, key=lambda p: p[1]["wall"])
    return walls[len(walls) // 2][1], statistics.median(p[0] for p in pairs)


def build_seconds(model: str, runs: int = 3) -> float:
    """Median wall seconds of a fresh process that imports torch and transformers and builds `model` on meta
    with transformers alone (its modeling module imported, as `plan` must): the share no planner can skip.
    Without cyclic garbage collection, as `plan` runs."""
    from rpcompile.models.presets import MODELS
    cls, fields = MODELS[model]
    code = (f"import gc\ngc.disable()\nimport torch, transformers\ncfg = transformers.{cls}(**{fields!r})\n"
            "with torch.device('meta'):\n    transformers.AutoModelForCausalLM.from_config(cfg)")
    walls = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        walls.append(time.perf_counter() - t)
    return statistics.median(walls)


def run(model: str, extra: list[str], tree: str | None = None) -> dict:
    """One CLI run: wall and CPU seconds, the plan line, the max_seq_len line, tokens/s (or why it failed)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = tree
    t, c = time.perf_counter(), _cpu()
    out = subprocess.run([sys.executable, "-m", "rpcompile", "plan", "--model", model, *ARGS, *extra],
                         capture_output=True, text=True, timeout=1800, env=env, cwd=tree)
    got = dict(wall=time.perf_counter() - t, cpu=_cpu() - c)
    if out.returncode:
        return {**got, "failed": out.stderr.strip().splitlines()[-1]}
    lines = out.stdout.splitlines()
    ours = next((line for line in lines if line.startswith("rpcompile (RoundPipe)")), "")
    return {**got, "tokens": ours.split()[3] if ours else "?",
            "plan": next((line for line in lines if line.startswith("plan ")), "?"),
            "max_seq_len": next((line for line in lines if line.startswith("max_seq_len")), "?")}


def planners_agree(models: list[str], rev: str) -> dict[str, str]:
    """Per model, whether today's `partition` and the one at `rev` (a child process on that tree, as in
    bench/partition.py) give the same plan on today's predicted costs, at both round sizes `plan` tries."""
    from rpcompile.passes import partition
    before, out = Before(rev), {}
    try:
        for model in models:
            costs, budget = predicted_costs(model)
            same = []
            for rr in (8, 16):
                kw = dict(gpus=GPUS, microbatches=MICROBATCHES, round_size=rr, staleness=STALENESS,
                          memory_budget=budget)
                same.append(partition(costs, **kw).to_str() == before(costs, 1, **kw)[1].to_str())
            out[model] = " / ".join("yes" if x else "NO" for x in same)
    finally:
        before.close()
    return out


def _same(new: dict, ref: dict) -> str:
    """Whether two runs print the same plan and max_seq_len lines (or both refuse the same way); where they do
    not, which one differs (the max_seq_len line: its number, or only the explanation after it)."""
    if "failed" in new or "failed" in ref:
        if new.get("failed") == ref.get("failed"):
            return "failed alike"
        return "NO: both refused, in other words" if "failed" in new and "failed" in ref else "NO"
    if all(new.get(k) == ref.get(k) for k in ("plan", "max_seq_len")):
        return "yes"
    number = [str(x.get("max_seq_len")).split(" tokens")[0].rpartition(": ")[2] for x in (new, ref)]
    seq = "its explanation" if number[0] == number[1] else f"{number[1]} -> {number[0]} tokens"
    return "NO: " + ("plan line" if new.get("plan") != ref.get("plan") else f"max_seq_len ({seq})")


def _short(r: dict) -> tuple[str, str]:
    """(the plan's stage sizes, the max_seq_len length) of a run, for the table."""
    if "failed" in r:
        return "refused: " + r["failed"].split(": error: ")[-1][:90], ""
    return r["plan"].split(":", 1)[-1].strip(), r["max_seq_len"].split(": ", 1)[-1].split(";")[0]


def extras(model: str) -> list[list[str]]:
    """The extra flags of each row of `model`: none; --host-memory where the preset refuses it; --frozen-base."""
    return [[], *([["--host-memory", HOST[model]]] if model in HOST else []),
            *([["--frozen-base"]] if model in FROZEN else [])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(MODELS))
    ap.add_argument("--before", default=BEFORE, help="git revision to compare with (default %(default)s)")
    ap.add_argument("--no-before", action="store_true", help="do not run the command on the old trees")
    ap.add_argument("--only", default="", help="only the rows whose model and flags contain this text "
                    "(e.g. --only frozen); the doc is written only for every row of the five models")
    ap.add_argument("--same-as", default=SAME_AS, help="git revision whose output must be the same "
                    "(default %(default)s: the costs of issue 33, before this session's changes)")
    args = ap.parse_args()
    tree = None if args.no_before else tree_at(args.before)
    same_tree = None if args.no_before else tree_at(args.same_as)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        byte_compile(*(os.path.join(root, d) for d in ("rpcompile", "passes", "runtime")),
                     *(t for t in (tree, same_tree) if t))
        rows, built = [], {}
        for model in args.models:
            chosen = [extra for extra in extras(model) if args.only in " ".join([model, *extra])]
            if chosen:
                built[model] = build_seconds(model)
            for extra in chosen:
                new, imp = paired(model, extra)
                old = run(model, extra, tree) if tree else None
                ref = run(model, extra, same_tree) if same_tree else None
                rows.append((model, extra, new, imp, old, ref))
    finally:
        for t in (tree, same_tree):
            if t:
                shutil.rmtree(t, ignore_errors=True)
    agree = planners_agree(list(args.models), args.before) if tree else {}
    table = []
    for model, extra, new, imp, old, ref in rows:
        plan, longest = _short(new)
        row = [" ".join([model, *extra]), f"{new['wall']:.1f}", f"{new['cpu']:.1f}",
               f"{imp:.1f}", ("yes" if new["wall"] <= 3 + imp else "NO") + f" ({new['wall'] - imp:+.1f} s)",
               f"{built[model]:.1f} ({new['wall'] - built[model]:+.1f} s)"]
        if tree:
            row += [f"{old['wall']:.1f}", f"{old['cpu']:.1f}", f"{ref['wall']:.1f}", _same(new, ref),
                    agree[model]]
        table.append(row + [plan, longest, new.get("tokens", "")])
    heads = ["model", "wall s (median of 3)", "CPU s", "import torch, transformers s (median of 3, alternating)",
             "<= 3 s + import; beyond import",
             "import + transformers builds it on meta, s (ours beyond)"]
    if tree:
        heads += [f"wall s at {args.before}", f"CPU s at {args.before}", f"wall s at {args.same_as}",
                  f"same output as at {args.same_as}",
                  f"same plan as {args.before}'s partition on today's costs (R=8 / 16)"]
    heads += ["plan", "max_seq_len", "simulated tokens/s"]
    text = tabulate(table, headers=heads, tablefmt="github", disable_numparse=True)
    print(text)
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} ({os.cpu_count()} cores, shared)")
    if args.only or args.models != list(MODELS):
        return  # a subset: docs/bench/plan_cli.md keeps every row
    write_doc("plan_cli.md", "## plan_cli: `python -m rpcompile plan` for the paper models\n\n" + machine_line()
              + f"  \nload average at the end: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} "
              f"({os.cpu_count()} cores, shared)\n\n"
              f"`python -m rpcompile plan --model M {' '.join(ARGS)}`, each model in a fresh process, imports "
              f"included, 3 times per row, each right after a fresh `import torch, transformers` (medians of the "
              f"3; the target of issue 31: at most 3 s plus that import). The tree at {args.before} ran each command once right "
              f"after the current one, and the tree at {args.same_as} (after issue 33: the same costs) right after "
              f"that: its plan lines must be today's (since issues 47 and 48 count the host memory as the runtime allocates "
              f"it, the buffer arena and the undo copies of staleness 1, `max_seq_len` and the words after it may "
              f"differ: the column says which). The transformers column is a fresh process that imports torch "
              f"and transformers and builds the model on meta with transformers alone (median of 3, no cyclic "
              f"garbage collection, as `plan` runs; its modeling "
              f"module's imports, which `import transformers` defers, are most of it), and how much longer the "
              f"command took. qwen3-32b and qwen3-235b-a22b exceed the preset's 512 GiB of host "
              f"memory, so they are refused with the issue's exact command (before too) and planned again with "
              f"--host-memory. qwen3-235b-a22b is also planned with --frozen-base, the paper's configuration "
              f"(only the norms train: it fits the 512 GiB; its max_seq_len comes from the eager experts loop, "
              f"counted from its first 2-5 experts, `passes/cost/experts.py`); the partition check column is "
              f"the model's, without --frozen-base. No weights are allocated. Every tree was byte-compiled first, as `pip install` "
              f"leaves a package (this machine sets PYTHONDONTWRITEBYTECODE=1). The command's output differs from {args.before}'s since "
              f"issue 33 priced bf16 on GeForce cards at the fp32-accumulate rate (165.2 TFLOP/s on a 4090, "
              f"not 330): other costs, so other plans and tokens/s. Whether the planner itself still gives the "
              f"same plans is the last check column: today's predicted costs (`bench/partition.py`'s "
              f"`predicted_costs`) planned by today's `partition` and by {args.before}'s in a child process, "
              f"at both round sizes.\n\n" + text)


if __name__ == "__main__":
    main()
