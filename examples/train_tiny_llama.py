"""Train a tiny Llama on this repository's own text with the RoundPipe schedule.

Shows the whole user-facing loop of rpcompile on the model and data the demo
uses (`rpcompile.models.zoo.TinyLlama`, byte-level tokens from `rpcompile.models.demo.corpus()`):
compile, print the plan, step, save a checkpoint, load it in a fresh handle and
check that training continues from the same state.

Run (CPU: host worker threads stand in for GPUs; ~20 s with the defaults):

    python examples/train_tiny_llama.py
    python examples/train_tiny_llama.py --steps 50 --gpus 4 --microbatches 8 --batch 16
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

import rpcompile
from rpcompile.models.demo import DemoConfig, batches, corpus
from rpcompile.models.zoo import LlamaConfig, TinyLlama


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (small defaults, so the script runs in seconds on a CPU)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="training iterations")
    p.add_argument("--gpus", type=int, default=2, help="workers (GPUs; host threads without CUDA)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per iteration")
    p.add_argument("--batch", type=int, default=8, help="sequences per iteration")
    p.add_argument("--seq", type=int, default=64, help="bytes per sequence")
    p.add_argument("--dim", type=int, default=64, help="hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder blocks")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--memory-mib", type=float, default=2.0,
                   help="device budget per worker; small so the model runs as a pipeline")
    p.add_argument("--save", default=None, help="checkpoint path (default: a temporary file, removed at exit)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Compile, train, checkpoint, resume."""
    args = parse_args(argv)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab=256, dim=args.dim, layers=args.layers, heads=4, kv_heads=2,
                      ffn=args.dim * 8 // 3, max_seq=args.seq)
    model = TinyLlama(cfg, seed=0)
    stream = batches(corpus(), DemoConfig(batch=args.batch, seq=args.seq, seed=0))

    # Compile: trace into layers, measure them, partition into RoundPipe stages, emit the program.
    c = rpcompile.compile(model, gpus=args.gpus, example=next(stream), microbatches=args.microbatches,
                          optimizer=rpcompile.AdamW(lr=args.lr, weight_decay=0.0),
                          memory_budget=int(args.memory_mib * 2**20))
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {c}")
    print(c.plan, end="\n\n")

    # The step loop: each c.step runs forward, backward and the CPU optimizer for one global batch.
    tokens = args.batch * args.seq
    for _ in range(args.steps):
        t = time.perf_counter()
        loss = c.step(next(stream))
        print(f"step {c.steps:3d}  loss {loss:.4f}  {tokens / (time.perf_counter() - t):,.0f} tok/s", flush=True)

    # Checkpoint: the full training state (weights, fp32 masters, AdamW moments, a pending update).
    with tempfile.TemporaryDirectory() as tmp:
        path = args.save or os.path.join(tmp, "tiny-llama.rp")
        c.save(path)
        held_out = next(stream)
        want = c.evaluate(held_out)
        c.close()

        # Load into a freshly built model (different random weights): the checkpoint replaces them.
        with rpcompile.load(path, TinyLlama(cfg, seed=1)) as resumed:
            got = resumed.evaluate(held_out)
            print(f"saved {path} at step {c.steps}; reloaded at step {resumed.steps}: "
                  f"held-out loss {want:.4f} -> {got:.4f}")
            if got != want:
                raise SystemExit("a reloaded checkpoint must reproduce the saved weights exactly")
            loss = resumed.step(next(stream))
            print(f"resumed training: step {resumed.steps} loss {loss:.4f}")

if __name__ == "__main__":
    main()
