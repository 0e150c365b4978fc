"""Planning time and plan quality of `partition`, against the RoundPipe reference heuristic, the planner before
issue 31 (loaded from git) and the RoundPipe paper's planning times, on synthetic models and the five paper models.

    python bench/partition.py [--before REV] [--runs 3] [--no-paper] [--no-before]

The paper models' costs are those `python -m rpcompile plan` predicts on 8x rtx4090 (seq 2048, 16
microbatches); they are read from tests/passes/partition/paper_costs.json (built with
`--rebuild-costs`, which needs transformers), so that a cost-model change does not move the planner's
benchmark. Targets (issue 31): each paper model at each round size in at most 50 ms (qwen3-235b-a22b: 1.5 s),
median of 3; synthetic 95 layers in at most 5 ms, 1001 layers in at most 100 ms; every plan's iteration time
at most the planner's before.

The "before" planner runs in a child process on a copy of the tree at REV (`git archive REV rpcompile passes
runtime`, laid out as the installed package: passes/ and runtime/ become rpcompile.passes and rpcompile.runtime),
so its modules never mix with the current ones; each plan is timed there the same way (median of `--runs`)
and its plan comes back as a string. Writes docs/bench/partition.md (the lead assembles docs/BENCHMARKS.md).

Both processes run with OMP_WAIT_POLICY=PASSIVE (unless it is set already): the torch batches of the
planner without its kernel and of the "before" planner leave OpenMP threads that spin, by default, for a
while after their work, and on this 2-core machine they took the cores from the next timed call (qwen3-32b
R=8 measured 51-53 ms right after them, 31-36 ms alone).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its threads (see the module doc)

from tabulate import tabulate  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_line, tree_at, write_doc  # noqa: E402

from rpcompile import CostTable, StagePlan  # noqa: E402
from rpcompile.passes import partition  # noqa: E402
from rpcompile.passes.partition import native  # noqa: E402
from rpcompile.passes.partition.timing import iteration_time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COSTS = os.path.join(ROOT, "tests", "passes", "partition", "paper_costs.json")
GPUS, MICROBATCHES, STALENESS = 8, 16, 1
BEFORE = "217a999"  # the planner before issue 31 (identical planner code to 9682b18, issue 26)
PAPER = {"qwen3-1.7b": 2.9, "llama3.1-8b": 2.9, "gpt-oss-20b": 2.6, "qwen3-32b": 5.0, "qwen3-235b-a22b": 1470.0}
TARGETS = {"synthetic 95": 5e-3, "synthetic 1001": 0.1, "qwen3-235b-a22b": 1.5}  # seconds; others 50 ms
TARGET = 50e-3

CHILD = """
import json, statistics, sys, time
from rpcompile import CostTable
from rpcompile.passes import partition
from rpcompile.passes.partition.timing import iteration_time
assert __import__("rpcompile").__file__.startswith(sys.argv[1]), "the old tree was not imported"
for line in sys.stdin:
    job = json.loads(line)
    costs, kw = CostTable.from_lists(**job["costs"]), job["kw"]
    times = []
    for _ in range(job["runs"]):
        t = time.perf_counter()
        plan = partition(costs, **kw)
        times.append(time.perf_counter() - t)
    kw.pop("memory_budget", None), kw.pop("tie", None)
    print(json.dumps([statistics.median(times), plan.to_str(), iteration_time(plan, costs, **kw)]), flush=True)
"""


class Before:
    """`partition` as of git revision `rev`, in a child process on a copy of that tree (see the module doc)."""

    def __init__(self, rev: str):
        self.dir = tree_at(rev)
        env = {**os.environ, "PYTHONPATH": self.dir}
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, self.dir], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=self.dir)

    def __call__(self, costs: CostTable, runs: int, **kw) -> tuple[float, StagePlan, float]:
        """(median seconds, plan, iteration time) of the old `partition`."""
        self.proc.stdin.write(json.dumps({"costs": costs.to_lists(), "kw": kw, "runs": runs}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the old planner's process ended (see its stderr above)")
        seconds, plan, it = json.loads(line)
        return seconds, StagePlan.from_str(plan), it

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)


def realistic(layers: int, seed: int = 0) -> CostTable:
    """Embedding (tiny), decoder layers fwd 1 ms / bwd 2 ms +-10%, LM head 3x a layer: `layers` in all."""
    rng = random.Random(seed)
    fwd = [1e-5] + [1e-3 * rng.uniform(0.9, 1.1) for _ in range(layers - 2)] + [3e-3]
    bwd = [2e-5] + [2e-3 * rng.uniform(0.9, 1.1) for _ in range(layers - 2)] + [6e-3]
    return CostTable.from_lists(fwd=fwd, bwd=bwd)


def reference(costs: CostTable, **kw) -> StagePlan | None:
    """The RoundPipe reference heuristic's plan (family (a) of partition's guarantees); None if none fits."""
    mod = sys.modules["rpcompile.passes.partition"]
    ev = mod.Evaluator(costs, gpus=kw["gpus"], microbatches=kw["microbatches"], round_size=kw["round_size"],
                       staleness=kw["staleness"], memory=kw.get("memory_budget"))
    sizes = mod.reference_plan(costs, [a + b for a, b in zip(costs.fwd, costs.bwd)], kw["gpus"], ev)
    return None if sizes is None else StagePlan.from_sizes(*sizes)


def timed(fn, costs: CostTable, runs: int, **kw) -> tuple[float, StagePlan]:
    """(median seconds, plan) of `runs` calls."""
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        plan = fn(costs, **kw)
        times.append(time.perf_counter() - t)
    return statistics.median(times), plan


def row(name: str, costs: CostTable, runs: int, before: Before | None, **kw) -> list:
    """One table row: times (ours, reference, before, paper), target, iteration times and their ratios."""
    kw.setdefault("round_size", MICROBATCHES // 2)
    plain = {a: b for a, b in kw.items() if a != "memory_budget"}
    ours_s, ours = timed(partition, costs, runs, **kw)
    os.environ[native.SWITCH] = "0"  # the same planner without its C kernel (a machine with no C compiler)
    try:
        python_s, python_plan = timed(partition, costs, runs, **kw)
    finally:
        del os.environ[native.SWITCH]
    assert python_plan.to_str() == ours.to_str(), (name, python_plan.to_str(), ours.to_str())
    ref_s, ref = timed(reference, costs, runs, **kw)
    it = iteration_time(ours, costs, **plain)
    out = [name, costs.num_layers, kw["round_size"], f"{ours_s * 1e3:.1f}", f"{python_s * 1e3:.1f}",
           f"{ref_s * 1e3:.2f}"]
    if before is not None:
        before_s, _, old_it = before(costs, runs, **kw)
        out += [f"{before_s * 1e3:,.1f}", f"{before_s / ours_s:,.1f}x", f"{it / old_it:.6f}"]
    model = name.split(" R=")[0]
    paper = PAPER.get(model)
    target = TARGETS.get(name, TARGETS.get(model, TARGET))
    met = ("yes" if ours_s <= target else "NO") + f" (<= {target * 1e3:g} ms)"
    ratio = "none fits" if ref is None else f"{it / iteration_time(ref, costs, **plain):.4f}"
    return out + ["-" if paper is None else f"{paper:g}", met, ours.num_stages, f"{it * 1e3:.2f}", ratio]


def paper_tables() -> dict:
    """{model: (CostTable, memory budget)} from tests/passes/partition/paper_costs.json."""
    with open(COSTS) as f:
        data = json.load(f)
    return {m: (CostTable.from_lists(**d["costs"]), d["memory_budget"]) for m, d in data.items()}


def predicted_costs(model: str) -> tuple[CostTable, int]:
    """(the costs `python -m rpcompile plan --model model` predicts on 8x rtx4090 at seq 2048 with 16
    microbatches, the stage memory budget it plans with); needs transformers."""
    import torch
    from rpcompile.ir.hardware import Hardware
    from rpcompile.models.presets import build_meta, example_batch
    from rpcompile.options import Options
    from rpcompile.pipeline import plan_pipeline
    hw = Hardware.preset("rtx4090").replace(host_memory=2**50)  # the costs only: host memory is plan's check
    net = build_meta(model)
    opts = Options(gpus=GPUS, microbatches=MICROBATCHES, staleness=STALENESS, optimizer=None,
                   dtype=torch.bfloat16, loss_fn=None, layers=None, lm_head_shards="auto", hardware=hw,
                   memory_budget=None, backend="host", seed=0)
    _, costs, _, _, _ = plan_pipeline(net, example_batch(net.config.vocab_size, MICROBATCHES, 2048), opts,
                                      mode="predict")
    return costs, hw.stage_budget(None)


def rebuild_costs() -> None:
    """Write tests/passes/partition/paper_costs.json: the costs `plan` predicts (needs transformers)."""
    from rpcompile.ir.hardware import Hardware
    out = {}
    for model in PAPER:
        costs, _ = predicted_costs(model)
        out[model] = {"costs": costs.to_lists(), "memory_budget": int(0.9 * Hardware.preset("rtx4090").device_memory)}
    with open(COSTS, "w") as f:
        json.dump(out, f)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default=BEFORE, help="git revision of the planner to compare with")
    p.add_argument("--no-before", action="store_true", help="no before column")
    p.add_argument("--runs", type=int, default=3, help="calls per plan (median)")
    p.add_argument("--no-paper", action="store_true", help="skip the paper models")
    p.add_argument("--rebuild-costs", action="store_true", help="rebuild the paper models' costs first")
    args = p.parse_args(argv)
    if args.rebuild_costs:
        rebuild_costs()
    before = None if args.no_before else Before(args.before)
    kw = dict(gpus=GPUS, microbatches=MICROBATCHES, staleness=STALENESS)
    rows = []
    try:
        for layers in (29, 40, 64, 95, 1001):
            rows.append(row(f"synthetic {layers}", realistic(layers), max(args.runs, 9 if layers < 500 else 3),
                            before, **kw))
            print(rows[-1], flush=True)
        for model, (costs, budget) in ({} if args.no_paper else paper_tables()).items():
            for rr in (8, 16):  # `plan` tries both round sizes on a hardware target
                rows.append(row(f"{model} R={rr}", costs, args.runs, before, round_size=rr, memory_budget=budget,
                                **kw))
                print(rows[-1], flush=True)
    finally:
        if before is not None:
            before.close()
    head = ["model", "layers", "R", "ours ms", "ours, no C kernel ms", "ref ms"]
    if before is not None:
        head += [f"before ({args.before}) ms", "before / ours time", "ours / before iteration"]
    head += ["paper ms", "target met", "stages", "iteration ms", "ours / ref iteration"]
    table = tabulate(rows, headers=head, tablefmt="github", disable_numparse=True)
    print(table)
    load = os.getloadavg()
    write_doc("partition.md",
              "## partition: planning time and plan quality\n\n" + machine_line() + f"  \nload average at the end: "
              f"{load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} (2 cores, shared)\n\n"
              f"{GPUS} GPUs, {MICROBATCHES} microbatches, staleness {STALENESS}. Synthetic: embedding, decoder "
              f"layers (1 ms fwd, 2 ms bwd, +-10%) and an LM head 3x a layer, no memory budget, R = 8. Paper "
              f"models: the costs `python -m rpcompile plan` predicts on 8x rtx4090 (seq 2048; "
              f"tests/passes/partition/paper_costs.json), memory budget 90% of 24 GB, both round sizes. Times "
              f"are medians of {args.runs} calls (9 for the small synthetic models); ref = the RoundPipe reference "
              f"heuristic (partition's family (a)); before = `partition` at {args.before} in a child process on "
              f"that tree (`git archive`), timed the same way in the same run; paper = the RoundPipe paper's "
              f"planning times; iteration times by `iteration_time` (lower is better; ours / before <= 1 is the "
              f"acceptance).\n\n" + table + "\n\nSince issue 31 a plan is timed by the first and last "
              "microbatch of each slot and only until the state repeats, shifted, from one iteration or every few "
              "to the next (`passes/partition/steady.py`, within 1e-12 of `iteration_time`), the complete even "
              "family of a model of up to 40 layers all at once as step-major float64 tensor rows (`batch.py`), "
              "after dropping the plans whose busiest worker alone, or a side too big for the memory budget, "
              "rules them out; every plan that may tie is re-timed exactly: the plans are those of the planner "
              "before. Both recurrences and the batch run in C where the machine has a C compiler "
              "(`passes/partition/native.py` and its C files: the same floats bit for bit); \"ours, no C kernel\" "
              "is the same planner with `RPCOMPILE_PLANNER_KERNEL=0` (Python and torch), and gives the same "
              "plan (asserted). The cap walk's steps run in C too (caps.c). Both processes ran with "
              f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} (the script sets PASSIVE unless told "
              "otherwise: idle torch threads of one measurement then do not spin on the cores the next one "
              f"times on). Planner kernel on this machine: {'built' if native.load() is not None else 'NOT available'}.\n")


if __name__ == "__main__":
    main()
