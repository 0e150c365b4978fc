"""Long sequences on 8x RTX 4090: max_seq_len of the five paper models, and where a layer's time goes.

Two tables, both predicted on the meta device (no weights allocated):

1. `max_seq_len` (bf16, one sequence per microbatch, M = N microbatches) for
   1, 2 and 8 GPUs with 2048 GiB of host memory (enough not to bind), next to
   the RoundPipe paper's length, and with the preset's own host memory (512
   GiB) together with the term that binds. Qwen3-235B-A22B has its base
   frozen (LoRA-style). `presets.seq_len_limit`, what `plan` prints: the
   decoder blocks as layers while a block fits a worker, cut into norms,
   attention and MLP (`passes.trace.sublayer_units`) past that length, as
   compile cuts them.
2. Per decoder layer at 4 sequences x 2048 tokens per microbatch: forward +
   backward seconds split into matmul / attention / elementwise, plus the whole
   LM head (shards + loss), with eager attention and with SDPA side by side.
   An op counts as attention if it is a fused attention kernel or its FLOPs or
   bytes grow like S^2 (they quadruple when S doubles); other FLOP ops are
   matmuls; the rest is elementwise.

    python bench/long_seq.py                      # all five presets (a few minutes)
    python bench/long_seq.py --models qwen3-1.7b  # a subset
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_line, write_doc  # noqa: E402
from tabulate import tabulate  # noqa: E402

from rpcompile.ir.hardware import Hardware  # noqa: E402
from rpcompile.passes import shard_lm_head, trace  # noqa: E402
from rpcompile.passes.cost import count_layers, layer_times  # noqa: E402
from rpcompile.models.presets import MODELS, build_meta, example_batch, seq_len_limit  # noqa: E402

PAPER = {"qwen3-1.7b": 74752, "llama3.1-8b": 50176, "gpt-oss-20b": 39936, "qwen3-32b": 28672,
         "qwen3-235b-a22b": 31744}  # RoundPipe paper, 8x RTX 4090
BEFORE = {"qwen3-1.7b": 14072, "llama3.1-8b": 9610, "gpt-oss-20b": 10637, "qwen3-32b": 0,
          "qwen3-235b-a22b": 0}  # rpcompile.max_seq_len when issue 13 was filed
GIB = 2 ** 30


def lengths(name: str, hw: Hardware) -> tuple[list, float]:
    """One row of table 1 and the seconds it took."""
    t0 = time.perf_counter()
    frozen = name == "qwen3-235b-a22b"
    big = [seq_len_limit(name, hw, gpus=g, host_memory=2048 * GIB, frozen_base=frozen) for g in (1, 2, 8)]
    own = seq_len_limit(name, hw, gpus=8, frozen_base=frozen)
    row = [name, f"{PAPER[name]:,}", f"{BEFORE[name]:,}", *(f"{r.length:,}" for r in big),
           "yes" if min(r.length for r in big) >= PAPER[name] else "NO", big[-1].binding,
           f"{own.length:,}", own.binding]
    return row, time.perf_counter() - t0


def _classes(ops_s, ops_half) -> list[str]:
    """'attention' / 'matmul' / 'elementwise' per op (see module docstring); ops at S and at S/2."""
    out = []
    for o, h in zip(ops_s, ops_half):
        quad = (o.flops and h.flops and o.flops > 3.5 * h.flops) or (h.bytes and o.bytes > 3.5 * h.bytes)
        out.append("attention" if "attention" in o.name or quad else "matmul" if o.flops else "elementwise")
    return out


def breakdown(name: str, attn: str, hw: Hardware, batch: int, seq: int) -> dict[str, float]:
    """Seconds (fwd + bwd) of the first decoder layer by class, and of the LM head, for one microbatch."""
    net = build_meta(name, attn_implementation=attn)
    if name == "qwen3-235b-a22b":
        for p in net.parameters():
            p.requires_grad_(p.dim() == 1)
    graph = shard_lm_head(trace(net, example_batch(net.config.vocab_size, batch, seq)))
    counts = {s: count_layers(graph, graph.flatten_inputs(example_batch(net.config.vocab_size, batch, s)),
                              progress=False) for s in (seq, seq // 2)}
    first = next(i for i, lay in enumerate(graph.layers) if lay.name.split(".")[-1].isdigit())
    got = {"matmul": 0.0, "attention": 0.0, "elementwise": 0.0}
    for phase in ("fwd_ops", "bwd_ops"):
        ops, half = getattr(counts[seq][first], phase), getattr(counts[seq // 2][first], phase)
        if len(ops) != len(half):
            raise ValueError(f"{name}: the ops of layer {graph.layers[first].name} change with S")
        for op, cls in zip(ops, _classes(ops, half)):
            got[cls] += layer_times([op], hw)
    head = [i for i, lay in enumerate(graph.layers) if lay.name.startswith("lm_head")]
    got["head"] = sum(layer_times(c.fwd_ops, hw) + layer_times(c.bwd_ops, hw)
                      for i, c in enumerate(counts[seq]) if i in head)
    return got


def main() -> None:
    """Print both tables and write docs/bench/long_seq.md."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--batch", type=int, default=4, help="sequences per microbatch for the breakdown")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence for the breakdown")
    args = ap.parse_args()
    hw = Hardware.preset("rtx4090")
    rows, spent = [], {}
    for name in args.models:
        row, spent[name] = lengths(name, hw)
        rows.append(row)
        print(f"{name}: {row[3:6]} in {spent[name]:.0f} s", flush=True)
    head1 = ["model", "paper", "before", "1 GPU", "2 GPUs", "8 GPUs", ">= paper", "binds (2048 GiB host)",
             "8 GPUs, 512 GiB host", "binds (512 GiB host)"]
    t1 = tabulate(rows, headers=head1, tablefmt="github", disable_numparse=True)
    rows2 = []
    for name in args.models:
        eager, sdpa = (breakdown(name, a, hw, args.batch, args.seq) for a in ("eager", None))
        ms = lambda d, k: f"{1e3 * d[k]:.1f}"  # noqa: E731
        rows2.append([name, *(ms(eager, k) for k in ("matmul", "attention", "elementwise")),
                      f"{1e3 * sum(eager[k] for k in ('matmul', 'attention', 'elementwise')):.1f}",
                      *(ms(sdpa, k) for k in ("matmul", "attention", "elementwise")),
                      f"{1e3 * sum(sdpa[k] for k in ('matmul', 'attention', 'elementwise')):.1f}",
                      ms(eager, "head"), ms(sdpa, "head")])
        print(f"{name}: eager {rows2[-1][1:5]} ms, sdpa {rows2[-1][5:9]} ms", flush=True)
    head2 = ["model", "eager matmul", "eager attention", "eager elementwise", "eager layer",
             "sdpa matmul", "sdpa attention", "sdpa elementwise", "sdpa layer", "head (eager)", "head (sdpa)"]
    t2 = tabulate(rows2, headers=head2, tablefmt="github", disable_numparse=True)
    print(t1, "", t2, sep="\n")
    doc = (f"# Long sequences: max_seq_len and per-layer costs (8x RTX 4090, predicted)\n\n{machine_line()}\n\n"
           f"## max_seq_len (bf16, one sequence per microbatch, M = N)\n\n"
           f"`presets.seq_len_limit` (what `plan` prints): whole decoder blocks while one fits a worker, sub-blocks "
           f"(`passes.trace.sublayer_units`) past that length; Qwen3-235B-A22B with its base frozen. `before`: the value "
           f"when issue 13 was filed. Fitting and solving took "
           f"{', '.join(f'{n} {s:.0f} s' for n, s in spent.items())}.\n\n{t1}\n\n"
           f"## One decoder layer, fwd + bwd ms per microbatch of {args.batch} x {args.seq} tokens\n\n"
           f"Classes as in `bench/long_seq.py`'s docstring; `head`: every LM head shard and the loss layer "
           f"(vocabulary-sharded as `shard_lm_head(\"auto\")` from parameter bytes).\n\n{t2}\n")
    print("wrote", write_doc("long_seq.md", doc))


if __name__ == "__main__":
    main()
