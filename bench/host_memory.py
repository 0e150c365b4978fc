"""Host memory before and after the buffer-assignment pass (issue 47): `plan`'s transfer buffers, and the RSS
of a CPU run.

1. `python -m rpcompile plan` (8x rtx4090, 16 microbatches) for the paper models at seq 2,048 and
   qwen3-1.7b at 65,536, on today's tree and on the tree before the pass (`--before`, loaded from git
   with `_common.tree_at`), side by side in the same run: the transfer buffers and the whole host need
   as `plan` prints them. After the pass the downloads live in one arena: the table gives its size next
   to the heaviest set of buffers found that can be live at once (`BufferAssignment.peak`: the worst
   point of the program in its own order, or a greedy clique of the live ranges that overlap; a lower
   bound of any assignment), and what they would hold one buffer each.
2. A CPU run of a small Llama cut into sub-blocks (host workers, at a sequence length where the transfer
   buffers are most of the host memory), each tree in a fresh process: peak RSS (`ru_maxrss`) before and
   after, against the difference the two trees' own counts predict.

    python bench/host_memory.py [--before REV] [--no-plan] [--no-rss] [--out host_memory.md]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_line, tree_at, write_doc  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEFORE = "ba7a80a^"  # the tree before issue 47's first commit
ROWS = [("qwen3-1.7b", 2048, ()), ("llama3.1-8b", 2048, ()), ("gpt-oss-20b", 2048, ()),
        ("qwen3-32b", 2048, ("--host-memory", "1024")), ("qwen3-235b-a22b", 2048, ("--frozen-base",)),
        ("qwen3-1.7b", 65536, ())]
ARGS = ("--gpus", "8", "--hardware", "rtx4090", "--microbatches", "16")

# The child of part 1 (today's tree): the assignment of the program `plan` chooses, as JSON.
ARENA = r"""
import json, sys, torch
from rpcompile.api import Options
from rpcompile.ir.hardware import Hardware
from rpcompile.models.presets import build_meta, example_batch
from rpcompile.pipeline import compile_passes
model, seq, frozen, mem = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
hw = Hardware.preset("rtx4090").replace(host_memory=mem * 2**30)
net = build_meta(model, dtype=torch.bfloat16)
if frozen:
    for p in net.parameters():
        p.requires_grad_(p.dim() == 1)
opts = Options(gpus=8, microbatches=16, staleness=1, optimizer=None, dtype=torch.bfloat16, loss_fn=None,
               layers=None, lm_head_shards="auto", hardware=hw, memory_budget=None, backend="host", seed=0,
               fp16_accumulation=False, fused_head=False)
out = compile_passes(net, example_batch(net.config.vocab_size, 16, seq), opts, mode="predict")
a = out[-1]
print(json.dumps({"arena": a.arena, "peak": a.peak, "unshared": a.total, "buffers": len(a.buffers),
                  "round": out[3].round_size}))
"""

# The child of part 2 (either tree): a CPU run of a sub-block Llama, its peak RSS and its counted buffers.
RUN = r"""
import json, resource, sys, torch
import rpcompile
from rpcompile.models.zoo import LlamaConfig, TinyLlama
from rpcompile.passes.trace import sublayer_units
from rpcompile.runtime.host.buffers import transfer_bytes
torch.manual_seed(0)
cfg = LlamaConfig(vocab=256, dim=256, layers=4, heads=4, kv_heads=2, ffn=512, max_seq=SEQ)
model = TinyLlama(cfg)
ids = torch.randint(0, 256, (16, SEQ))
batch = {"input_ids": ids, "labels": ids}
with rpcompile.compile(model, gpus=2, example=batch, microbatches=16, backend="host", memory_budget=32768 * SEQ,
                       layers=sublayer_units(model)) as c:
    for _ in range(3):
        c.step(batch)
    c.flush()
    need = transfer_bytes(c.graph, c.program, c.state.dtype).total
    print(json.dumps({"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "buffers": need,
                      "layers": len(c.graph.layers), "plan": c.plan.to_str()}))
"""


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f}"


def _plan(model: str, seq: int, extra: tuple, tree: str | None) -> dict:
    """Transfer buffers and host need (bytes) as `plan` prints them, run with the package at `tree` (None: today's)."""
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree
    out = subprocess.run([sys.executable, "-m", "rpcompile", "plan", "--model", model, "--seq", str(seq), *ARGS,
                          *extra], capture_output=True, text=True, env=env, cwd=tree or ROOT)
    line = next((x for x in out.stdout.splitlines() if x.startswith("host memory:")), None)
    if line is None:
        raise SystemExit(f"plan {model} --seq {seq} {' '.join(extra)} failed:\n{out.stdout}\n{out.stderr}")
    total = int(re.search(r"\((\d+) bytes", line).group(1))
    moved = re.search(r"transfer buffers ([\d,.]+) (GiB|MiB)", line)
    scale = 2**30 if moved.group(2) == "GiB" else 2**20
    return {"total": total, "buffers": float(moved.group(1).replace(",", "")) * scale}


def _arena(model: str, seq: int, extra: tuple) -> dict:
    mem = int(extra[extra.index("--host-memory") + 1]) if "--host-memory" in extra else 512
    out = subprocess.run([sys.executable, "-c", ARENA, model, str(seq), "1" if "--frozen-base" in extra else "0",
                          str(mem)], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def plan_table(before: str) -> str:
    tree = tree_at(before)
    rows = []
    try:
        for model, seq, extra in ROWS:
            old, new, a = _plan(model, seq, extra, tree), _plan(model, seq, extra, None), _arena(model, seq, extra)
            name = " ".join([model, *extra])
            rows.append((name, f"{seq:,}", _gib(old["buffers"]), _gib(new["buffers"]),
                         f"{new['buffers'] / old['buffers']:.2f}x", _gib(a["unshared"]), _gib(a["arena"]),
                         _gib(a["peak"]), f"{a['arena'] / max(a['peak'], 1):.3f}", a["round"],
                         _gib(old["total"]), _gib(new["total"]), f"{new['total'] / old['total']:.2f}x"))
            print(rows[-1], flush=True)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    return tabulate(rows, headers=["model", "seq", "transfer buffers before GiB", "after GiB", "after/before",
                                   "downloads one each GiB", "arena GiB", "live at once GiB (at least)",
                                   "arena/peak", "R", "host need before GiB", "after GiB", "after/before"],
                    tablefmt="github", disable_numparse=True)


def _run(tree: str | None, seq: int) -> dict:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree
    out = subprocess.run([sys.executable, "-c", RUN.replace("SEQ", str(seq))], capture_output=True, text=True,
                         env=env, cwd=tree or ROOT)
    if out.returncode:
        raise SystemExit(f"the CPU run failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def rss_table(before: str, seq: int, repeats: int) -> str:
    tree = tree_at(before)
    rows = []
    try:
        for k in range(repeats):  # alternate the trees: both see about the same machine
            old, new = _run(tree, seq), _run(None, seq)
            predicted, measured = old["buffers"] - new["buffers"], old["rss"] - new["rss"]
            rows.append((k + 1, new["layers"], new["plan"], f"{old['buffers'] / 2**20:,.1f}",
                         f"{new['buffers'] / 2**20:,.1f}", f"{predicted / 2**20:,.1f}", f"{old['rss'] / 2**20:,.1f}",
                         f"{new['rss'] / 2**20:,.1f}", f"{measured / 2**20:,.1f}", f"{measured / predicted:.2f}"))
            print(rows[-1], flush=True)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    return tabulate(rows, headers=["run", "layers", "plan", "counted buffers before MiB", "after MiB",
                                   "predicted drop MiB", "peak RSS before MiB", "after MiB", "measured drop MiB",
                                   "measured / predicted"], tablefmt="github", disable_numparse=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default=BEFORE, help="git revision of the tree before the pass")
    ap.add_argument("--no-plan", action="store_true", help="skip part 1 (the paper models)")
    ap.add_argument("--no-rss", action="store_true", help="skip part 2 (the CPU run)")
    ap.add_argument("--seq", type=int, default=1024, help="sequence length of the CPU run")
    ap.add_argument("--repeats", type=int, default=2, help="before/after pairs of the CPU run")
    ap.add_argument("--out", default="host_memory.md", help="docs/bench file to write ('' : print only)")
    args = ap.parse_args()
    parts = [f"### host_memory: the buffer-assignment pass, before and after (issue 47)\n\n{machine_line()}\n"]
    if not args.no_plan:
        parts.append("`plan` (8x rtx4090, 16 microbatches): transfer buffers and the whole host need as printed, "
                     f"before (`{args.before}`) and after; the arena of the chosen program\n\n" + plan_table(args.before))
    if not args.no_rss:
        parts.append(f"CPU run (2 host workers, 16 microbatches of 1 x {args.seq} tokens, TinyLlama dim 256 cut "
                     "into sub-blocks, 3 steps), peak RSS of a fresh process per tree\n\n"
                     + rss_table(args.before, args.seq, args.repeats))
    text = "\n\n".join(parts)
    print(text)
    if args.out:
        print("wrote", write_doc(args.out, text))


if __name__ == "__main__":
    main()
