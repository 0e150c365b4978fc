"""Checkpoint memory: the peak extra RSS of saving and of loading, as a multiple of the file size (issue 23).

Each measurement runs in a fresh process (`ru_maxrss` is a process's lifetime
peak): the save process builds a state dict of fp32 tensors first, the load
process starts empty, and the extra RSS is the peak during the call minus the
RSS just before it. Loading builds the tensors, so its floor is 1.0x the file;
the bound the issue sets is 1.3x for both. Beside the streaming code it runs
the previous implementation (read the file, slice the payload, unpickle from
memory; pickle into memory, write) in the same run, for the ratio.

    python bench/checkpoint_memory.py              # 256 MiB of tensors
    python bench/checkpoint_memory.py --mib 512 --no-doc
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_line, write_doc  # noqa: E402

_CHILD = r"""
import hashlib, io, os, resource, sys, torch
from rpcompile import checkpoint

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) * 1024

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def old_save(state, path):  # before issue 23: the whole payload in memory, then written
    buf = io.BytesIO(); torch.save(state, buf); data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(checkpoint._HEADER.pack(checkpoint.MAGIC, len(data), hashlib.sha256(data).digest())); f.write(data)

def old_load(path):  # before issue 23: read the file, slice the payload, unpickle from memory
    with open(path, "rb") as f:
        raw = f.read()
    data = raw[checkpoint._HEADER.size:]
    hashlib.sha256(data).digest()
    return torch.load(io.BytesIO(data), weights_only=False)

op, impl, path, mib = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if op == "save":
    n = mib * 2**20 // 4 // 16
    state = {"format": checkpoint.FORMAT, "host": {f"w{i}": torch.randn(n) for i in range(16)}}
    before = rss()
    (old_save if impl == "before" else checkpoint.save)(state, path)
else:
    before = rss()
    state = (old_load if impl == "before" else checkpoint.load)(path)
print(peak() - before, os.path.getsize(path))
"""


def measure(op: str, impl: str, path: str, mib: int) -> tuple[int, int]:
    """(peak extra RSS bytes, file bytes) of one save or load in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _CHILD, op, impl, path, str(mib)], check=True,
                         capture_output=True, text=True, timeout=600).stdout.split()
    return int(out[0]), int(out[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB of fp32 tensors in the checkpoint (>= 200)")
    ap.add_argument("--no-doc", action="store_true", help="print only, do not write docs/bench/checkpoint_memory.md")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for impl in ("before", "streaming"):
            path = os.path.join(d, f"{impl}.ckpt")
            for op in ("save", "load"):
                extra, size = measure(op, impl, path, args.mib)
                rows.append([impl, op, f"{size / 2**20:,.1f} MiB", f"{extra / 2**20:,.1f} MiB", f"{extra / size:.2f}x"])
    table = tabulate(rows, headers=["implementation", "call", "file", "peak extra RSS", "extra / file"],
                     disable_numparse=True)
    print(table)
    if not args.no_doc:
        text = (f"{machine_line()}\n\nPeak extra RSS of one `rpcompile.checkpoint.save` / `load` in a fresh "
                f"process, as a multiple of the checkpoint's size (bound: 1.3x; a load builds the tensors, "
                f"so its floor is 1.0x). `before`: the implementation before issue 23, in the same run.\n\n"
                f"```\n{table}\n```\n")
        print("wrote", write_doc("checkpoint_memory.md", text))


if __name__ == "__main__":
    main()
