"""What the per-worker RNG dispatch mode costs: a decoder layer's forward + backward with and without it.

A layer that may draw random numbers (dropout) runs under `WorkerRandom`, a
torch dispatch mode that routes its random ops to the worker's generator, so
every aten op of that layer goes through Python (issue 22, 1h). Since issue 22
only such layers run under it (`stage.runner.random_layers`); this measures the
price they pay. The two variants alternate step by step in one process; the
ratio is what to read.

    python bench/dispatch_mode.py            # 30 timed rounds
    python bench/dispatch_mode.py --no-doc
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_line, write_doc  # noqa: E402

from rpcompile.runtime.stage.rng import WorkerRandom  # noqa: E402


def _layer(dim: int, dropout: float) -> torch.nn.Module:
    """A pre-norm decoder-like block: attention (SDPA) and an MLP, with dropout after each."""
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
            self.qkv, self.o = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
            self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)
            self.drop = torch.nn.Dropout(dropout)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, s, 3, 4, dim // 4).permute(2, 0, 3, 1, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.drop(self.o(a.transpose(1, 2).reshape(b, s, dim)))
            return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.n2(x)))))
    return Block()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    layer = _layer(args.dim, 0.1).train()
    x = torch.randn(4, args.seq, args.dim, requires_grad=True)
    gen = torch.Generator()

    def plain() -> None:
        layer(x).sum().backward()

    def moded() -> None:
        with WorkerRandom(gen, 7):
            out = layer(x)
        out.sum().backward()

    times: dict[str, list[float]] = {"plain": [], "WorkerRandom": []}
    for f in (plain, moded) * 3:  # warm-up
        f()
    for _ in range(args.rounds):
        for name, f in (("plain", plain), ("WorkerRandom", moded)):
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [[k, f"{med[k] * 1e3:.2f} ms", f"{med[k] / med['plain']:.2f}x"] for k in med]
    table = tabulate(rows, headers=["forward under", "forward + backward (median)", "vs plain"],
                     disable_numparse=True)
    print(table)
    if not args.no_doc:
        text = (f"{machine_line()}\n\nOne decoder-like block (dim {args.dim}, 4 x {args.seq} tokens, dropout 0.1), "
                f"forward + backward, the forward plain or under the RNG dispatch mode, alternating, "
                f"{args.rounds} rounds. Only layers that may draw random numbers run under it.\n\n"
                f"```\n{table}\n```\n")
        print("wrote", write_doc("dispatch_mode.md", text))


if __name__ == "__main__":
    main()
