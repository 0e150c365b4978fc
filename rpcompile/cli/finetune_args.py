"""The options of `python -m rpcompile finetune`, one per `FinetuneConfig` field (plain argparse).

    >>> p = argparse.ArgumentParser(); add_arguments(p)
    >>> config_from_args(p.parse_args(["--model", "m/", "--data", "d.jsonl", "--out", "o/", "--lora", "8"])).lora
    8
"""
from __future__ import annotations

import argparse

from rpcompile.cli.data import PACKINGS, TRAIN_ON
from rpcompile.cli.finetune import DTYPES, FinetuneConfig
from rpcompile.cli.schedule import SCHEDULES

__all__ = ["add_arguments", "config_from_args"]


def _shards(text: str) -> int | str:
    """--lm-head-shards: "auto" or an int."""
    return text if text == "auto" else int(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the finetune options to `p` (defaults as in `FinetuneConfig`)."""
    d = FinetuneConfig(model="", data="", out="")
    io = p.add_argument_group("input and output")
    io.add_argument("--model", required=True, metavar="DIR",
                    help="local Hugging Face folder (save_pretrained): config.json, weights, tokenizer; read offline")
    io.add_argument("--data", required=True, metavar="FILE",
                    help=".txt (one document per line) or .jsonl, one kind of row per file: 'text' (see --text-field), "
                    "chat 'messages', sharegpt 'conversations', or 'prompt' + 'completion'")
    io.add_argument("--eval", metavar="FILE", help="held-out data in the same formats (eval loss)")
    io.add_argument("--out", required=True, metavar="DIR",
                    help="output folder: trained model + tokenizer (or LoRA adapters), checkpoint, run record")
    io.add_argument("--whole-file", action="store_true", help=".txt: the whole file is one document")
    io.add_argument("--text-field", default=d.text_field, metavar="NAME",
                    help=f".jsonl text rows: the key of the text (default {d.text_field!r})")
    m = p.add_argument_group("what is trained and how it is packed")
    m.add_argument("--train-on", choices=TRAIN_ON,
                   help="assistant: every assistant reply (with its end-of-turn marker); last: the final reply; "
                   "all: every token (default: assistant for conversations, all for text; prompt/completion rows "
                   "train the completion)")
    m.add_argument("--chat-template", metavar="FILE",
                   help="a jinja chat template for conversations, instead of the tokenizer's (saved with the model)")
    m.add_argument("--packing", default=d.packing, choices=PACKINGS,
                   help="whole: bin-pack whole documents, a longer one truncated to --seq (default); split: cut the "
                   "stream every --seq tokens; none: one document per sequence, padded. Positions restart at 0 "
                   "per document")
    b = p.add_argument_group("batch and pipeline")
    b.add_argument("--gpus", type=int, help="workers (default: every CUDA device, or 2 host workers)")
    b.add_argument("--seq", type=int, default=d.seq, help=f"tokens per packed sequence (default {d.seq})")
    b.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size, help="sequences per microbatch")
    b.add_argument("--microbatches", type=int, help="microbatches per step (default 2 x gpus)")
    b.add_argument("--staleness", type=int, default=d.staleness, choices=(0, 1),
                   help="1: RoundPipe, the CPU optimizer one step behind (default); 0: synchronous")
    b.add_argument("--dtype", default=d.dtype, choices=sorted(DTYPES),
                   help="training dtype (default auto: bf16 on CUDA, fp32 on the CPU)")
    b.add_argument("--memory-gib", type=float, help="device memory per worker for the planner "
                   "(default: 90%% of the smallest CUDA device)")
    b.add_argument("--lm-head-shards", type=_shards, default=d.lm_head_shards,
                   help="vocabulary shards of the LM head (default auto)")
    o = p.add_argument_group("optimization")
    length = o.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="training steps")
    length.add_argument("--epochs", type=float, help="passes over the data (default 1 when --steps is not given)")
    o.add_argument("--lr", type=float, help="peak learning rate (default 2e-5, or 2e-4 with --lora)")
    o.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps")
    o.add_argument("--schedule", default=d.schedule, choices=SCHEDULES, help="after the warmup (default cosine)")
    o.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    o.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm,
                   help="clip by the global gradient norm (default 1.0; 0 = off)")
    o.add_argument("--seed", type=int, default=d.seed, help="data order, adapter init, dropout")
    lo = p.add_argument_group("LoRA (needs peft)")
    lo.add_argument("--lora", type=int, default=d.lora, metavar="R", help="train rank-R adapters, base frozen")
    lo.add_argument("--lora-alpha", type=float, help="scale numerator (scale = alpha / R; default 2R)")
    lo.add_argument("--lora-targets", help="comma-separated module names, e.g. q_proj,v_proj, or all-linear "
                    "(default: peft's for the architecture)")
    lo.add_argument("--merge", action="store_true",
                    help="export merged weights (a plain model); the adapters go to OUT/adapter")
    r = p.add_argument_group("checkpoints and progress")
    r.add_argument("--save-every", type=int, default=d.save_every, metavar="K",
                   help="atomic checkpoint every K steps and at the end (0 = none)")
    r.add_argument("--eval-every", type=int, default=d.eval_every, metavar="K",
                   help="eval loss every K steps (needs --eval; the final model is always evaluated)")
    r.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    r.add_argument("--overwrite", action="store_true",
                   help="--out holds a run or a model: replace it (deletes its run record, checkpoint and the model, "
                   "adapter and tokenizer files before training; without --overwrite or --resume such an --out is "
                   "refused)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(a: argparse.Namespace) -> FinetuneConfig:
    """The `FinetuneConfig` that parsed options describe."""
    targets = tuple(t.strip() for t in a.lora_targets.split(",") if t.strip()) if a.lora_targets else None
    return FinetuneConfig(
        model=a.model, data=a.data, out=a.out, eval=a.eval, gpus=a.gpus, seq=a.seq,
        micro_batch_size=a.micro_batch_size, microbatches=a.microbatches, steps=a.steps, epochs=a.epochs, lr=a.lr,
        warmup=a.warmup, schedule=a.schedule, weight_decay=a.weight_decay,
        max_grad_norm=a.max_grad_norm or None, staleness=a.staleness, dtype=a.dtype, lora=a.lora,
        lora_alpha=a.lora_alpha, lora_targets=targets, merge=a.merge, save_every=a.save_every,
        eval_every=a.eval_every, resume=a.resume, overwrite=a.overwrite, seed=a.seed, whole_file=a.whole_file,
        memory_gib=a.memory_gib, lm_head_shards=a.lm_head_shards, progress=not a.no_progress, train_on=a.train_on,
        packing=a.packing, chat_template=a.chat_template, text_field=a.text_field)
