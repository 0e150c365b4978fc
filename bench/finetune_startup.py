"""Start-up of `python -m rpcompile finetune` on a tiny model: where the whole process's time goes, before and after.

A 2-layer Qwen2 of the shape of TRL's tiny test model (Qwen2.5's 151,665-token vocabulary, hidden 8,
tied embeddings; the test fixtures' small tokenizer) and 64 short two-turn chats, `--val-size 0.1`, every
other flag at its default (--seq 512, packing whole, 2 host workers, 4 microbatches, one epoch: 3 steps, an
eval at step 0 and at the end). Each run is a fresh process, as a user starts it. The
"before" column runs the code of another git revision (default 217a999, the tree before issue 35) from
a detached worktree, in the same session, interleaved with "after" (this tree) run by run; the table
gives each phase's median over the repeats.

Phases (seconds of the process, each counted once: a phase nested in another is subtracted from it):
imports (interpreter start to the command's first line: torch, rpcompile), tokenizer + config
(transformers' import comes here), data (read, tokenize, pack), preflight (the model on meta, traced,
costed and planned before any weight loads), weights (from_pretrained), compile = trace + costs +
plan (the rest of compile: runtime start), eval, steps, export, other (the run's own lines), and the
interpreter's start and exit (the process's wall time less all of those).

    python bench/finetune_startup.py                 # 3 interleaved repeats, writes docs/bench/finetune_startup.md
    python bench/finetune_startup.py --repeats 5 --before 217a999
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from tabulate import tabulate

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from _common import machine_line, write_doc  # noqa: E402

PHASES = ("imports", "tokenizer + config", "data", "preflight", "weights", "compile: trace", "compile: costs",
          "compile: plan", "compile: other", "eval", "steps", "export", "other", "interpreter start + exit")

# The child: maps rpcompile (and its passes/runtime folders, as pyproject's package-dir does) to TREE, times
# the phases by wrapping the run's functions (those a revision lacks are skipped), runs the command.
CHILD = r'''
import time; T0 = time.perf_counter()
import importlib.util, json, os, sys
TREE, ARGS, OUT = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
class _Tree:
    def find_spec(self, name, path=None, target=None):
        for pkg, folder in (("rpcompile.passes", "passes"), ("rpcompile.runtime", "runtime"), ("rpcompile", "rpcompile")):
            if name == pkg or name.startswith(pkg + "."):
                base = os.path.join(TREE, folder, *name[len(pkg):].lstrip(".").split(".")) if name != pkg else \
                    os.path.join(TREE, folder)
                if os.path.isdir(base):
                    return importlib.util.spec_from_file_location(name, os.path.join(base, "__init__.py"),
                                                                  submodule_search_locations=[base])
                return importlib.util.spec_from_file_location(name, base + ".py") if os.path.isfile(base + ".py") \
                    else None
        return None
sys.meta_path.insert(0, _Tree())
from rpcompile.cli.main import main
import rpcompile.finetune.run as run, rpcompile.finetune.loop as loop, rpcompile.passes as passes
import rpcompile.pipeline as pipeline
times, stack = {}, []
def wrap(owner, attr, phase):
    real = getattr(owner, attr, None)
    if real is None:
        return
    def timed(*a, **k):
        name = ((stack[0][0] + ": ") if stack else "") + phase[1:] if phase.startswith(":") else phase
        stack.append([name, 0.0]); t = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            took = time.perf_counter() - t
            _, inner = stack.pop()
            times[name] = times.get(name, 0.0) + took - inner
            if stack:
                stack[-1][1] += took
    setattr(owner, attr, timed)
for attr in ("load_tokenizer", "check_model"):
    wrap(run, attr, "tokenizer + config")
wrap(run, "_datasets", "data"); wrap(run, "preflight", "preflight"); wrap(run, "load_model", "weights")
wrap(run, "_start", "compile"); wrap(run, "export", "export")
wrap(passes, "trace", ":trace"); wrap(passes, "estimate_costs", ":costs"); wrap(pipeline, "_plan_and_emit", ":plan")
wrap(run, "evaluate_loss", "eval"); wrap(loop, "evaluate_loss", "eval"); wrap(loop.Loop, "_step", "steps")
T1 = time.perf_counter()
rc = main(["finetune", *ARGS])
T2 = time.perf_counter()
times["imports"] = T1 - T0
times["other"] = (T2 - T1) - sum(v for k, v in times.items() if k != "imports")
json.dump({"rc": rc, "times": times}, open(OUT, "w"))
'''


def fixture(folder: str) -> tuple[str, str]:
    """The tiny Qwen2 folder (the shape of TRL's test model: Qwen2.5's vocabulary, hidden 8, 2 layers, tied
    embeddings) with the tests' small tokenizer, and the 64 chats."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    import hf_fixtures as fx
    from finetune.test_transformers_recipe import short_chats
    model, tok = os.path.join(folder, "qwen2"), fx.tokenizer()
    cfg = Qwen2Config(vocab_size=151665, hidden_size=8, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(model)
    tok.save_pretrained(model)
    return model, fx.write_jsonl(os.path.join(folder, "chat.jsonl"), short_chats(64))


def one_run(tree: str, model: str, data: str, out: str) -> dict:
    """One fresh `finetune` process on `tree`'s code: {"wall": s, phase: s}."""
    args = ["--model", model, "--data", data, "--out", out, "--val-size", "0.1", "--no-progress", "--overwrite"]
    res = out + ".json"
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, tree, json.dumps(args), res], capture_output=True, text=True,
                          timeout=900)
    wall = time.perf_counter() - t
    if done.returncode or not os.path.exists(res):
        raise SystemExit(f"{tree}: finetune failed:\n{done.stderr[-3000:]}")
    got = json.load(open(res))
    phases = {"compile: " + k.split(": ", 1)[1] if k.startswith("compile: ") else k: v
              for k, v in got["times"].items()}
    phases["compile: other"] = phases.pop("compile", 0.0)
    for k in [k for k in phases if k.startswith("preflight: ")]:  # the meta plan's passes count as preflight
        phases["preflight"] = phases.get("preflight", 0.0) + phases.pop(k)
    phases["interpreter start + exit"] = wall - sum(phases.values())  # what the child cannot time itself
    return {"wall": wall, **phases}


def worktree(rev: str) -> str:
    """A detached worktree of `rev` (made once under the temp folder)."""
    path = os.path.join(tempfile.gettempdir(), f"rpcompile-bench-{rev}")
    if not os.path.isdir(path):
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, rev], check=True, capture_output=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="217a999", help="git revision of the 'before' column (default 217a999)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each, interleaved (default 3)")
    a = ap.parse_args()
    before = worktree(a.before)
    with tempfile.TemporaryDirectory() as d:
        model, data = fixture(d)
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        load = []
        for i in range(a.repeats):
            for name, tree in (("before", before), ("after", ROOT)):
                load.append(os.getloadavg()[0])
                runs[name].append(one_run(tree, model, data, os.path.join(d, f"{name}{i}")))
                print(f"{name} run {i + 1}: {runs[name][-1]['wall']:.1f} s", flush=True)
    med = {n: {k: statistics.median(r.get(k, 0.0) for r in rs) for k in ("wall", *PHASES)} for n, rs in runs.items()}
    rows = [[k, f"{med['before'][k]:.2f}", f"{med['after'][k]:.2f}"] for k in PHASES]
    rows.append(["whole process (wall, median)", f"{med['before']['wall']:.2f}", f"{med['after']['wall']:.2f}"])
    rows.append(["after / before", "", f"{med['after']['wall'] / med['before']['wall']:.2f}"])
    walls = {n: ", ".join(f"{r['wall']:.1f}" for r in rs) for n, rs in runs.items()}
    table = tabulate(rows, headers=["phase (s, median)", f"before ({a.before})", "after"], tablefmt="github")
    notes = (f"runs (s): before {walls['before']}; after {walls['after']}. 1-minute load average at each start: "
             f"{', '.join(f'{x:.1f}' for x in load)} (the machine is shared: the columns are interleaved run by run)")
    print(table + "\n\n" + notes)
    write_doc("finetune_startup.md", "## finetune_startup: where a tiny `finetune` run's time goes\n\n"
              + machine_line() + "\n\n" + __doc__.split("\n\n")[1].replace("\n", " ") + "\n\n" + table + "\n\n"
              + notes)


if __name__ == "__main__":
    main()
