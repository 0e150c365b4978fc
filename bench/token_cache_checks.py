"""What the token cache's checks cost (issue 34): the digest at open, and the size check before each batch.

A cache is checked once when it is opened (its files' SHA-256 against meta.json, so a file changed in
place is not used) and before each read of its arrays (`TokenCache.check`: an fstat per file, so a file
truncated under a running job is an OSError instead of SIGBUS). This measures, on one synthetic cache of
`--tokens` tokens (written with the cache's own writer, no tokenizer):

    open, checked     `open_cache`: sizes, then the digest of every file (reads all of it)
    open, unchecked   the same without the digest (what opening cost before)
    batch             `Packed.batch(step, 8 x 512)` with the size check (as it runs)
    batch, no check   the same with `TokenCache.check` a no-op (what a batch cost before)

The two batch rows are interleaved, one call each in turn, and the medians are compared in the same run.

    python bench/token_cache_checks.py                  # 50M tokens (250 MB of cache files)
    python bench/token_cache_checks.py --tokens 2000000 --no-doc
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_line, write_doc  # noqa: E402

from rpcompile.finetune.data import token_cache as tc  # noqa: E402
from rpcompile.finetune.data.packing import pack_cache  # noqa: E402


def synthetic(folder: str, tokens: int, doc: int = 700) -> None:
    """A cache of `tokens` random ids in documents of about `doc` tokens, written by the cache's writer."""
    rng = np.random.default_rng(0)

    def chunks():
        left = tokens
        while left:
            n = min(left, 1 << 20)
            lengths = np.full(n // doc, doc, np.int64)
            lengths[-1] += n - lengths.sum()
            yield rng.integers(3, 30000, n, dtype=np.int32), (rng.random(n) < 0.7).astype(np.uint8), lengths
            left -= n
    tc._write(folder, chunks(), "synthetic", eos=2, pad=0, sync=False)


def median_s(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=50_000_000)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        synthetic(d, args.tokens)
        size = sum(os.path.getsize(os.path.join(d, name)) for name, _ in tc.FILES.values())
        checked = median_s(lambda: tc._open(d, None), 3)
        unchecked = median_s(lambda: tc._open(d, None, verify=False), 3)
        cache = tc._open(d, None)
        packed = pack_cache(cache, 512, "whole")
        real = type(cache).check
        with_check, without = [], []
        for step in range(args.batches):  # interleaved: one call each in turn
            for out, patched in ((with_check, False), (without, True)):
                if patched:
                    type(cache).check = lambda self: None
                t = time.perf_counter()
                packed.batch(step, 8, seed=0)
                out.append(time.perf_counter() - t)
                type(cache).check = real
        per = median_s(cache.check, 1000)
    rows = [("open, checked", f"{checked * 1e3:,.1f} ms", f"{size / checked / 1e9:.2f} GB/s"),
            ("open, unchecked", f"{unchecked * 1e3:,.2f} ms", ""),
            ("batch (8 x 512)", f"{statistics.median(with_check) * 1e6:,.0f} us", f"check {per * 1e6:.1f} us"),
            ("batch, no check", f"{statistics.median(without) * 1e6:,.0f} us", "")]
    table = "| what | median | note |\n|---|---|---|\n" + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in rows)
    text = (f"# Token cache checks: the digest at open, the size check per batch\n\n{machine_line()}\n\n"
            f"A synthetic cache of {args.tokens:,} tokens ({size / 1e6:,.0f} MB of files); {args.batches} "
            f"batches each way, interleaved; load average {os.getloadavg()[0]:.1f} (a shared machine).\n\n{table}\n")
    print(text)
    if not args.no_doc:
        print("wrote", write_doc("token_cache_checks.md", text))


if __name__ == "__main__":
    main()
