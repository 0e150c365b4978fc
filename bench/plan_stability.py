"""Plan stability (issues 14 and 26): a model compiled in fresh processes on a loaded machine.

Starts a background load (one busy-looping process per core, 2 by default), then
compiles the demo model (`rpcompile.cli.demo` with `rpcompile.models.demo`: the 4-layer Llama, 2 workers, 4
microbatches, 8 MiB budget; costs measured on the CPU) or the sub-block model
(an 8-layer Llama whose blocks do not fit 4 MiB, planned as 62 sub-blocks) in
`--runs` fresh `python -c` processes one after the other, and prints each run's plan, round size,
compile seconds and measured times, and side by side the plan `partition` ranks
by time alone (tie = 0) from the same costs, with how much slower (predicted)
compile's plan is than that one (compile ranks measured costs with
`rpcompile.pipeline.MEASURED_TIE`). Exits 1 if the plans differ; then a second
table gives each run's predicted iteration time (`passes.iteration_time`, from
that run's measured costs) of every plan seen, to show how near the tie is.
Each model has its own section of docs/bench/plan_stability.md: a run replaces
its model's section and keeps the other.

    python bench/plan_stability.py                 # 5 runs, 2 busy processes, the demo's section of the doc
    python bench/plan_stability.py --model sub-blocks --runs 6   # the sub-block model's section
    python bench/plan_stability.py --load 0 --runs 3 --no-doc   # quiet machine, no doc
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time

from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_line, write_doc  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import json, sys, time, torch, rpcompile
from rpcompile.models.demo import DemoConfig, batches, corpus
from rpcompile.models.zoo import LlamaConfig, TinyLlama
cfg = DemoConfig()
torch.manual_seed(cfg.seed)
if sys.argv[1] == "demo":
    model = TinyLlama(LlamaConfig(vocab=256, dim=128, layers=4, heads=4, kv_heads=2, ffn=344, max_seq=cfg.seq),
                      seed=cfg.seed)
    example, budget = next(batches(corpus(), cfg)), int(cfg.memory_mib * 2**20)
else:  # sub-blocks: 8 layers whose blocks do not fit 4 MiB, so compile plans their sub-blocks (62 units)
    model = TinyLlama(LlamaConfig(vocab=512, dim=128, layers=8, heads=4, kv_heads=2, ffn=344, max_seq=64), seed=0)
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
    example, budget = {"input_ids": ids, "labels": ids}, 4 * 2**20
t = time.perf_counter()
c = rpcompile.compile(model, gpus=cfg.gpus, example=example, microbatches=cfg.microbatches,
                      optimizer=rpcompile.AdamW(lr=cfg.lr, weight_decay=0.0), seed=cfg.seed, memory_budget=budget)
seconds = time.perf_counter() - t
from rpcompile.passes import partition
alone = partition(c.costs, gpus=cfg.gpus, microbatches=cfg.microbatches, round_size=c.program.round_size,
                  memory_budget=budget, staleness=1)
print(json.dumps({"plan": c.plan.to_str(), "round": c.program.round_size, "seconds": seconds,
                  "alone": alone.to_str(),
                  "over": c.plan.report.iteration_time / alone.report.iteration_time - 1,
                  "fwd_ms": [round(x * 1e3, 2) for x in c.costs.fwd],
                  "bwd_ms": [round(x * 1e3, 2) for x in c.costs.bwd]}))
c.close()
"""


def _cell(plan: str) -> str:
    """A plan string for a markdown table cell ('|' would end the cell)."""
    return plan.replace("|", " / ")


def _times(ms: list[float], most: int = 12) -> str:
    """Per-layer milliseconds for a table cell (the first `most` and a count of the rest)."""
    return " ".join(f"{x:g}" for x in ms[:most]) + (f" ... ({len(ms) - most} more)" if len(ms) > most else "")


def _spin() -> None:
    """Burn one core until terminated."""
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def compile_once(model: str = "demo") -> dict:
    """One fresh-process compile of `model` -> its plan, round size, seconds, per-layer times."""
    r = subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    if r.returncode:
        raise RuntimeError(f"compile failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _near_ties(results: list[dict]) -> str:
    """Each run's predicted iteration time (ms) of every distinct plan over as many layers (a different LM-head
    sharding gives another layer count: "-"), from that run's measured costs."""
    from rpcompile import CostTable, StagePlan
    from rpcompile.passes import iteration_time
    seen = list(dict.fromkeys((r["plan"], r["round"]) for r in results))
    rows = []
    for i, r in enumerate(results):
        costs = CostTable.from_lists(fwd=[x / 1e3 for x in r["fwd_ms"]], bwd=[x / 1e3 for x in r["bwd_ms"]])
        t = [iteration_time(StagePlan.from_str(p), costs, gpus=2, microbatches=4, round_size=rs, staleness=1)
             if StagePlan.from_str(p).num_layers == costs.num_layers else None for p, rs in seen]
        best = min(x for x in t if x is not None)
        rows.append([i + 1, _cell(r["plan"]),
                     *("-" if x is None else f"{x * 1e3:.2f} ({x / best - 1:+.1%})" for x in t)])
    return ("predicted iteration ms of each plan seen, from each run's measured costs (vs that run's best):\n\n"
            + tabulate(rows, headers=["run", "chosen", *(_cell(p) for p, _ in seen)], tablefmt="github"))


HEAD = "## plan_stability: fresh-process compiles on a loaded machine\n"
ABOUT = {
    "demo": ("The demo model",
             "`rpcompile.cli.demo` (data `rpcompile.models.demo`): 4-layer Llama, vocab 256, gpus=2, 4 microbatches, 8 MiB budget: 9 layers "
             "(the LM head in 2 vocabulary shards and a loss layer). History: before the robust timing "
             "(2026-12-01) 3 quiet runs gave 3 plans; with the robust timing but plans ranked by time alone "
             "(960a9bb) 2 distinct of 5 (3,2/4/1,1,1,2 and 2,1,1,1/4/1,1,1,2, 0.1-2.2% apart); a tie of 3% "
             "still flipped 1 run of 10 (3.5% apart), 5% (`MEASURED_TIE`, issue 14) gave one plan in 10 of 10."),
    "sub-blocks": ("The sub-block model",
                   "an 8-layer Llama, hidden 128, vocab 512, batch 8 x 64, gpus=2, 4 microbatches, 4 MiB budget: "
                   "its blocks do not fit, so compile plans their 7 sub-blocks each (62 units with the LM head "
                   "in 3 shards and a loss layer). History (issue 26): with issue 14's tie rule (fewest stages, "
                   "then the fastest) 6 runs gave 6 distinct plans of 25 stages within about 3% of each other, "
                   "and in one attempt two runs traced 62 and 63 units, because `lm_head_shards=\"auto\"` "
                   "rounded a measured time ratio. Now the shard count comes from FLOPs, and the tied plan is "
                   "chosen by structure alone (fewest stages, most fused layers, nearest to an even layout), with "
                   "ties measured from the fastest even plan (`rpcompile.passes.partition`, Ties)."),
}


def _section(model: str, body: str) -> str:
    """One model's section of the doc, between markers so that a later run can replace it."""
    return f"<!-- model: {model} -->\n{body.strip()}\n<!-- end: {model} -->\n"


def write_section(model: str, body: str) -> None:
    """Replace `model`'s section of docs/bench/plan_stability.md (keeping the other's), in a fixed order."""
    path = os.path.join(ROOT, "docs", "bench", "plan_stability.md")
    old = open(path).read() if os.path.exists(path) else ""
    sections = {m: f"<!-- model: {m} -->\n{t}<!-- end: {m} -->\n"
                for m, t in re.findall(r"<!-- model: (\S+) -->\n(.*?)<!-- end: \1 -->\n", old, re.S)}
    sections[model] = _section(model, body)
    write_doc("plan_stability.md", HEAD + "\n" + "\n".join(sections[m] for m in ABOUT if m in sections))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--load", "--busy", type=int, default=2, help="busy-looping background processes (default 2)")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/bench/plan_stability.md")
    ap.add_argument("--model", choices=tuple(ABOUT), default="demo",
                    help="the demo (default), or an 8-layer Llama planned as 62 sub-blocks under a 4 MiB budget")
    args = ap.parse_args()
    spinners = [mp.Process(target=_spin, daemon=True) for _ in range(args.load)]
    for p in spinners:
        p.start()
    t0 = time.perf_counter()
    try:
        results = [compile_once(args.model) for _ in range(args.runs)]
    finally:
        for p in spinners:
            p.terminate()
            p.join()
    wall = time.perf_counter() - t0
    plans = {(r["plan"], r["round"]) for r in results}
    rows = [[i + 1, _cell(r["plan"]), len(r["fwd_ms"]), r["round"], f"{r['seconds']:.1f}", _cell(r["alone"]),
             f"{r['over']:+.1%}",
             _times(r["fwd_ms"]), _times(r["bwd_ms"])] for i, r in enumerate(results)]
    table = tabulate(rows, headers=["run", "plan", "layers", "round size", "compile s", "by time alone (tie 0)",
                                    "plan vs that", "measured fwd ms per layer", "measured bwd ms per layer"],
                     tablefmt="github")
    near = _near_ties(results) if len(plans) > 1 else ""
    verdict = (f"all {args.runs} plans equal: {results[0]['plan']} (round size {results[0]['round']})"
               if len(plans) == 1 else f"plans DIFFER: {len(plans)} distinct of {args.runs}")
    alone = {r["alone"] for r in results}
    verdict += f"; by time alone {len(alone)} distinct"
    print(table, "", verdict, near, f"wall {wall:.0f} s", sep="\n")
    if not args.no_doc:
        title, about = ABOUT[args.model]
        write_section(args.model,
                      f"### {title}\n\n" + machine_line() + f"  \nwall time: {wall:.0f} s\n\n"
                      f"{about}\n\n{args.load} busy-looping background processes ran throughout (on top of "
                      f"whatever else shared the machine). Each run is a fresh `python -c` process compiling the "
                      f"model (costs measured on the CPU: warm-up, median of repeats, outliers re-measured; see "
                      f"`rpcompile.passes.cost`); `compile s` is the time inside `rpcompile.compile`; the column "
                      f"`by time alone` is the plan `partition` ranks by time alone (tie 0) from the same costs, "
                      f"and `plan vs that` how much slower compile's plan is by those costs.\n\n"
                      + table + f"\n\n{verdict}\n" + (f"\n{near}\n" if near else ""))
    return 0 if len(plans) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
