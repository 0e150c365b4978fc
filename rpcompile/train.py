"""`python -m rpcompile train --config run.json`: scripted training of a byte-level Llama on a text file.

    {"text": "corpus.txt", "steps": 100, "gpus": 2, "microbatches": 4, "batch": 8, "seq": 128,
     "dim": 128, "layers": 4, "lr": 0.003, "save": "run.ckpt"}

With "resume": true and an existing "save" file, training continues from it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RunConfig:
    """A training run; every field has a default except the corpus."""

    text: str                  # path of a text file, read as byte-level tokens
    steps: int = 100           # training iterations
    gpus: int = 2              # workers (GPUs, or host threads without CUDA)
    microbatches: int = 4      # microbatches per iteration
    batch: int = 8             # sequences per iteration
    seq: int = 128             # tokens per sequence
    dim: int = 128             # model hidden size
    layers: int = 4            # decoder blocks
    heads: int = 4             # attention heads
    lr: float = 3e-3           # AdamW learning rate
    staleness: int = 1         # optimizer staleness (0 or 1)
    seed: int = 0              # data order and initial weights
    save: str | None = None    # checkpoint path written at the end (and every `save_every` steps)
    save_every: int = 0        # 0 = only at the end
    resume: bool = False       # continue from `save` if it exists


def train(cfg: RunConfig) -> list[float]:
    """Run `cfg`; returns the losses of the steps it ran."""
    import rpcompile
    from rpcompile.demo import DemoConfig, batches
    from rpcompile.zoo import LlamaConfig, TinyLlama

    with open(cfg.text, "rb") as f:
        data = f.read()
    if len(data) < cfg.seq + 2:
        raise ValueError(f"{cfg.text!r} holds {len(data)} bytes; need more than seq + 1 = {cfg.seq + 1}")
    model = TinyLlama(LlamaConfig(vocab=256, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads,
                                  kv_heads=cfg.heads, ffn=cfg.dim * 8 // 3, max_seq=cfg.seq), seed=cfg.seed)
    stream = batches(data, DemoConfig(batch=cfg.batch, seq=cfg.seq, seed=cfg.seed))
    if cfg.resume and cfg.save and os.path.exists(cfg.save):
        c = rpcompile.load(cfg.save, model)
        for _ in range(c.steps):  # the data stream continues where the run stopped
            next(stream)
        print(f"resumed {cfg.save} at step {c.steps}")
    else:
        c = rpcompile.compile(model, gpus=cfg.gpus, example=next(stream),
                              microbatches=cfg.microbatches, staleness=cfg.staleness,
                              optimizer=rpcompile.AdamW(lr=cfg.lr, weight_decay=0.0), seed=cfg.seed)
        stream = batches(data, DemoConfig(batch=cfg.batch, seq=cfg.seq, seed=cfg.seed))  # from the start
    losses = []
    with c:
        while c.steps < cfg.steps:
            losses.append(c.step(next(stream)))
            print(f"step {c.steps}: loss {losses[-1]:.4f}", flush=True)
            if cfg.save and cfg.save_every and c.steps % cfg.save_every == 0:
                c.save(cfg.save)
        if cfg.save:
            c.save(cfg.save)
            print(f"saved {cfg.save}")
    return losses
