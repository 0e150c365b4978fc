"""Fine-tuning data: the peak RSS growth of tokenizing and packing a 50,000-line JSONL (issue 25, item 5).

Each measurement runs in a fresh process: it loads the tokenizer (the tiny
byte-level BPE of tests/hf_fixtures.py with turn markers, saved once), resets
its peak RSS (`/proc/self/clear_refs`), prepares the data, and reports the peak
(VmHWM) minus the RSS just before. The bound the issue sets: 2 x the final
arrays (the token cache's ids, targets and offsets, and the packing layout) +
100 MiB.

    before       `read_documents` + the issue-24 `pack` (tests/packing_reference.py): every
                 document, every token list, then (sequences, seq) int64 tensors
    build        `prepare(..., cache_root=...)`: the streaming pass into a new token cache
    hit          `prepare` again: the cache read back (no tokenizer call)
    build, 2 proc  the parent process of a build with `num_proc=2` (the workers are forked
                 from a server process and measured apart from it: not counted here)

    python bench/data_memory.py                       # 50,000 lines of prompt/completion and of chat
    python bench/data_memory.py --lines 200000 --no-doc
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2**20
SEQ = 256
PATHS = ("before", "build", "hit", "build, 2 proc")

_CHILD = r"""
import json, os, sys
sys.path.insert(0, sys.argv[5])
from transformers import AutoTokenizer
from rpcompile.finetune.data import prepare, read_documents
import packing_reference

impl, data, folder, cache, seq = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[6])
tok = AutoTokenizer.from_pretrained(folder)

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024

base = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from the RSS now
if impl == "before":
    p = packing_reference.pack(read_documents(data, tok), tok, seq, "whole")
    tokens, arrays, cached = None, None, False
else:
    p = prepare(data, tok, seq=seq, cache_root=cache, num_proc=2 if "2 proc" in impl else 1)
    tokens, cached = p.cache.tokens, p.cached
    arrays = p.cache.nbytes + sum(a.nbytes for a in (p.starts, p.lengths, p.bounds, p.selection))
print(json.dumps({"growth": status("VmHWM:") - base, "arrays": arrays, "tokens": tokens, "cached": cached,
                  "sequences": len(p)}))
"""


def write_rows(path: str, kind: str, lines: int, seed: int = 0) -> str:
    """A JSONL of `lines` rows of varied length from the README's words: "pc" prompt/completion, "chat" messages."""
    import numpy as np
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        words = f.read().split()
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(lines):
            w = [words[j] for j in rng.integers(0, len(words), size=2 + int(rng.integers(0, 14)))]
            k = 1 + len(w) // 3
            prompt, reply = " ".join(w[:k]), " ".join(w[k:])
            row = {"prompt": prompt + "\n", "completion": reply} if kind == "pc" else \
                {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]}
            f.write(json.dumps(row) + "\n")
    return path


def tokenizer_folder(path: str) -> str:
    """Save the tests' tiny tokenizer with turn markers and a chat template to `path`; returns it."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import hf_fixtures
    hf_fixtures.turn_tokenizer().save_pretrained(path)
    return path


def measure(impl: str, data: str, folder: str, cache: str, seq: int = SEQ) -> dict:
    """One preparation (`impl`, one of PATHS) in a fresh process: peak RSS growth, arrays, tokens, ..."""
    r = subprocess.run([sys.executable, "-c", _CHILD, impl, data, folder, cache, os.path.join(ROOT, "tests"),
                        str(seq)], capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise RuntimeError(f"the {impl!r} measurement failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.splitlines()[-1])


def main() -> None:
    import time

    from tabulate import tabulate

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import machine_line, write_doc
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=50_000, help="rows of each generated JSONL")
    ap.add_argument("--no-doc", action="store_true", help="print only, do not write docs/bench/data_memory.md")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        folder = tokenizer_folder(os.path.join(d, "tok"))
        for kind in ("pc", "chat"):
            data = write_rows(os.path.join(d, f"{kind}.jsonl"), kind, args.lines)
            got = {}
            for impl in PATHS:
                start = time.perf_counter()
                cache = os.path.join(d, f"cache-{kind}" + ("-2" if "2 proc" in impl else ""))
                got[impl] = measure(impl, data, folder, cache) | {"s": time.perf_counter() - start}
            assert got["hit"]["cached"] and not got["build"]["cached"], got
            bound = 2 * got["build"]["arrays"] + 100 * MIB
            for impl, m in got.items():
                rows.append([{"pc": "prompt/completion", "chat": "chat (messages)"}[kind], impl, f"{args.lines:,}",
                             f"{got['build']['tokens']:,}", f"{os.path.getsize(data) / MIB:.1f} MiB",
                             f"{got['build']['arrays'] / MIB:.1f} MiB", f"{m['growth'] / MIB:.1f} MiB",
                             f"{bound / MIB:.1f} MiB", f"{m['growth'] / bound:.2f}", f"{m['s']:.1f}"])
    table = tabulate(rows, headers=["data", "path", "lines", "tokens", "file", "arrays", "peak RSS growth", "bound",
                                    "growth / bound", "s (process)"], disable_numparse=True)
    print(table)
    if not args.no_doc:
        text = (f"{machine_line()}\n\nPeak RSS growth of preparing a generated JSONL for fine-tuning (tokenize, "
                f"mask, pack into sequences of {SEQ}, packing whole) in a fresh process, against the issue's bound: "
                f"2 x the final arrays (token cache + packing layout) + 100 MiB. `before`: `read_documents` + the "
                f"issue-24 `pack` (every token list in memory, then whole tensors), in the same run. `hit`: the "
                f"second run on the same file, which reads the cache and never calls the tokenizer. The "
                f"tokenizer is the tests' tiny byte-level BPE (about 2 bytes per token); `s` includes the "
                f"process start (about 5 s of imports).\n\n```\n{table}\n```\n")
        print("wrote", write_doc("data_memory.md", text))


if __name__ == "__main__":
    main()
