"""Fine-tune a Hugging Face transformers causal LM with rpcompile.

Shows that a stock `transformers` model needs no changes: it is traced into
layers (embedding, decoder layers, norm, LM head + loss), planned into RoundPipe
stages and trained with `rpcompile.compile(model, gpus=..., example={"input_ids",
"labels"})`; `c.model()` gives back the module with the trained weights.

On this CPU-only machine `--tiny` (the default) builds a small LlamaForCausalLM
from a config with random weights (nothing is downloaded) and trains it on the
repository's own text as byte tokens. On a CUDA server with real weights you
would instead load a checkpoint and its tokenizer, e.g.

    model = LlamaForCausalLM.from_pretrained("meta-llama/Llama-3.1-8B", torch_dtype=torch.bfloat16)
    c = rpcompile.compile(model, gpus=8, example=batch, microbatches=16, dtype=torch.bfloat16)

(this script never calls `from_pretrained`).

Run (~15 s):

    python examples/finetune_transformers.py
    python examples/finetune_transformers.py --steps 20 --layers 6 --hidden 128
"""
from __future__ import annotations

import argparse
import time

import torch

import rpcompile
from rpcompile.models.demo import DemoConfig, batches, corpus


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (small defaults, so the script runs in seconds on a CPU)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=True,
                   help="build a tiny random-weight config (the only mode this script runs)")
    p.add_argument("--steps", type=int, default=8, help="training iterations")
    p.add_argument("--gpus", type=int, default=2, help="workers (GPUs; host threads without CUDA)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per iteration")
    p.add_argument("--batch", type=int, default=8, help="sequences per iteration")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the tiny config")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the tiny config")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--memory-mib", type=float, default=2.0,
                   help="device budget per worker; small so the model runs as a pipeline")
    return p.parse_args(argv)


def tiny_llama(args: argparse.Namespace) -> torch.nn.Module:
    """A LlamaForCausalLM with a small config and random weights, over byte tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max(args.seq, 128), attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).train()


def main(argv: list[str] | None = None) -> None:
    """Build, compile, fine-tune, and give the trained module back."""
    args = parse_args(argv)
    if not args.tiny:
        raise SystemExit("this example only runs --tiny; with real weights use from_pretrained (see the docstring)")
    model = tiny_llama(args)
    stream = batches(corpus(), DemoConfig(batch=args.batch, seq=args.seq, seed=0))
    example = next(stream)  # {"input_ids": (batch, seq), "labels": (batch, seq)}; HF shifts the labels itself
    before = model(**example).loss.item()

    c = rpcompile.compile(model, gpus=args.gpus, example=example, microbatches=args.microbatches,
                          optimizer=rpcompile.AdamW(lr=args.lr), memory_budget=int(args.memory_mib * 2**20))
    print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters, {c}")
    print(c.graph, c.plan, sep="\n\n", end="\n\n")

    with c:
        for _ in range(args.steps):
            t = time.perf_counter()
            loss = c.step(next(stream))
            print(f"step {c.steps:3d}  loss {loss:.4f}  ({time.perf_counter() - t:.2f} s)", flush=True)
        trained = c.model()  # the same LlamaForCausalLM, every update applied (also a pending one)
    after = trained(**example).loss.item()
    print(f"fine-tuned: loss on the first batch {before:.4f} -> {after:.4f}")
    # trained.save_pretrained("out/")  would now write a normal Hugging Face checkpoint


if __name__ == "__main__":
    main()
