"""The options of `python -m rpcompile finetune`, one per `FinetuneConfig` field (plain argparse), and `--config`.

    >>> p = argparse.ArgumentParser(); add_arguments(p)
    >>> config_from_args(p.parse_args(["--model", "m/", "--data", "d.jsonl", "--out", "o/", "--lora", "8"])).lora
    8

The settings of a run: `FinetuneConfig`'s defaults, then the `--config FILE` keys
(`rpcompile.finetune.config_file`: a run record's resume, overwrite and dry_run are not taken), then
the flags given. Only a flag on the command line overrides the file (no option has an argparse
default: a missing one is absent from the namespace), and a flag of --steps / --epochs drops the
file's other one. --model, --data and --out are required, as flags or as keys of the file.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from rpcompile.finetune.data import PACKINGS, TRAIN_ON
from rpcompile.finetune.config import DTYPES, REPORT_TO, FinetuneConfig
from rpcompile.finetune.config_file import read_config
from rpcompile.finetune.schedule import SCHEDULES
from rpcompile.ir.optim import GRAD_DTYPES, MASTER_DTYPES, STATE_DTYPES

__all__ = ["add_arguments", "config_from_args", "settings_from_args", "REQUIRED"]

REQUIRED = {"model": "DIR", "data": "FILE", "out": "DIR"}  # fields without a default: a flag or a config key
EXCLUSIVE = (("steps", "epochs"),)  # a flag of one drops the config file's other


def _shards(text: str) -> int | str:
    """--lm-head-shards: "auto" or an int."""
    return text if text == "auto" else int(text)


def _add(group: Any, *flags: str, **kw: Any) -> None:
    """One option with no argparse default: absent from the namespace unless given (so it overrides --config)."""
    group.add_argument(*flags, default=argparse.SUPPRESS, **kw)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the finetune options to `p` (defaults as in `FinetuneConfig`, applied by `config_from_args`)."""
    d = FinetuneConfig(model="", data="", out="")
    io = p.add_argument_group("input and output")
    _add(io, "--config", metavar="FILE",
         help="settings from a .json or .yaml file of FinetuneConfig keys (seq, micro_batch_size, lora_targets...) "
         "or a run record (OUT/rpcompile-run.json, without its resume/overwrite/dry_run); given flags override it")
    _add(io, "--model", metavar="DIR", help="local Hugging Face folder (save_pretrained): config.json, weights, "
         "tokenizer; read offline (required, here or in --config)")
    _add(io, "--data", metavar="FILE",
         help=".txt (one document per line) or .jsonl, one kind of row per file: 'text' (see --text-field), "
         "chat 'messages', sharegpt 'conversations', or 'prompt' + 'completion' (required)")
    _add(io, "--eval", metavar="FILE", help="held-out data in the same formats (eval loss)")
    _add(io, "--val-size", type=float, metavar="F",
         help=f"without --eval: hold out this seeded fraction of the documents for the eval loss (default "
         f"{d.val_size:g})")
    _add(io, "--out", metavar="DIR",
         help="output folder: trained model + tokenizer (or LoRA adapters), checkpoint, run record (required)")
    _add(io, "--whole-file", action="store_true", help=".txt: the whole file is one document")
    _add(io, "--text-field", metavar="NAME", help=f".jsonl text rows: the key of the text (default {d.text_field!r})")
    _add(io, "--num-proc", type=int, metavar="N",
         help=f"processes that tokenize the data (default {d.num_proc}; the token cache is the same for any N)")
    m = p.add_argument_group("what is trained and how it is packed")
    _add(m, "--train-on", choices=TRAIN_ON,
         help="assistant: every assistant reply (with its end-of-turn marker); last: the final reply; "
         "all: every token (default: assistant for conversations, all for text; prompt/completion rows "
         "train the completion)")
    _add(m, "--chat-template", metavar="FILE",
         help="a jinja chat template for conversations, instead of the tokenizer's (saved with the model)")
    _add(m, "--packing", choices=PACKINGS,
         help="whole: bin-pack whole documents, a longer one truncated to --seq (default); split: cut the "
         "stream every --seq tokens; none: one document per sequence, padded. Positions restart at 0 "
         "per document")
    b = p.add_argument_group("batch and pipeline")
    _add(b, "--gpus", type=int, help="workers (default: every CUDA device, or 2 host workers)")
    _add(b, "--seq", type=int, help=f"tokens per packed sequence (default {d.seq})")
    _add(b, "--micro-batch-size", type=int, help=f"sequences per microbatch (default {d.micro_batch_size})")
    _add(b, "--microbatches", type=int, help="microbatches per step (default 2 x gpus)")
    _add(b, "--staleness", type=int, choices=(0, 1),
         help="1: RoundPipe, the CPU optimizer one step behind (default); 0: synchronous")
    _add(b, "--dtype", choices=sorted(DTYPES), help="training dtype (default auto: bf16 on CUDA, fp32 on the CPU; "
         "fp16 trains with dynamic loss scaling)")
    _add(b, "--fp16-accumulation", action="store_true",
         help="with --dtype fp16: GEMMs accumulate in fp16 on CUDA (the RoundPipe recipe, 2x the fp32-accumulate "
         "rate on GeForce cards) and the plan is priced so; no effect on host workers")
    _add(b, "--memory-gib", type=float,
         help="device memory per worker for the planner (default: 90%% of the smallest CUDA device)")
    _add(b, "--lm-head-shards", type=_shards, help="vocabulary shards of the LM head (default auto)")
    o = p.add_argument_group("optimization")
    length = o.add_mutually_exclusive_group()
    _add(length, "--steps", type=int, help="training steps")
    _add(length, "--epochs", type=float, help="passes over the data (default 1 when --steps is not given)")
    _add(o, "--lr", type=float, help="peak learning rate (default 2e-5, or 2e-4 with --lora)")
    _add(o, "--warmup", type=int, help=f"linear warmup steps (default {d.warmup})")
    _add(o, "--schedule", choices=SCHEDULES, help=f"after the warmup (default {d.schedule})")
    _add(o, "--weight-decay", type=float, help=f"AdamW weight decay (default {d.weight_decay:g}), on the parameters "
         "transformers' Trainer decays: no biases, no LayerNorm/RMSNorm weights (LoRA: the adapters)")
    _add(o, "--decay-all", action="store_true",
         help="weight decay on every trainable parameter, biases and norm weights too")
    _add(o, "--neftune-alpha", type=float, metavar="A",
         help="NEFTune: uniform noise of scale A/sqrt(seq*hidden) on the input embeddings while training (never "
         "in eval); 5 is usual (default 0: off)")
    _add(o, "--max-grad-norm", type=float, help=f"clip by the global gradient norm (default {d.max_grad_norm:g}; "
         f"0 = off)")
    _add(o, "--state-dtype", choices=tuple(STATE_DTYPES),
         help=f"AdamW's moments: fp32 (default {d.state_dtype}: 18 B per trainable parameter) or bf16 (14 B: "
         "rounded stochastically, the update in fp32)")
    _add(o, "--master-dtype", choices=tuple(MASTER_DTYPES),
         help=f"AdamW's master weights: fp32 (default {d.master_dtype}) or bf16 (2 B less per trainable parameter: "
         "no fp32 master; updated in fp32, stored with stochastic rounding)")
    _add(o, "--grad-dtype", choices=tuple(GRAD_DTYPES),
         help=f"the host gradient buffers: fp32 (default {d.grad_dtype}) or bf16 (2 B less per trainable parameter: "
         "accumulation rounds summed in fp32, stored with stochastic rounding)")
    _add(o, "--seed", type=int, help=f"data order, adapter init, dropout (default {d.seed})")
    lo = p.add_argument_group("LoRA (needs peft)")
    _add(lo, "--lora", type=int, metavar="R", help="train rank-R adapters, base frozen (default 0: full fine-tuning)")
    _add(lo, "--lora-alpha", type=float, help="scale numerator (scale = alpha / R; default 2R)")
    _add(lo, "--lora-targets", help="comma-separated module names, e.g. q_proj,v_proj, or all-linear "
         "(default: peft's for the architecture)")
    _add(lo, "--merge", action="store_true",
         help="export merged weights (a plain model); the adapters go to OUT/adapter")
    r = p.add_argument_group("checkpoints, logging and progress")
    _add(r, "--save-every", type=int, metavar="K", help="atomic checkpoint every K steps and at the end (0 = none)")
    _add(r, "--eval-every", type=int, metavar="K",
         help="eval loss every K steps (needs --eval or --val-size; the final model is always evaluated)")
    _add(r, "--resume", action="store_true", help="continue the run in --out from its checkpoint")
    _add(r, "--overwrite", action="store_true",
         help="--out holds a run or a model: replace it (deletes its run record, checkpoint and the model, "
         "adapter and tokenizer files before training; without --overwrite or --resume such an --out is "
         "refused)")
    _add(r, "--logging-steps", type=int, metavar="K",
         help=f"a line of OUT/metrics.jsonl every K steps (default {d.logging_steps})")
    _add(r, "--report-to", choices=REPORT_TO,
         help="also write the metrics for TensorBoard, to OUT/tensorboard (needs tensorboard; default: only "
         "metrics.jsonl)")
    _add(r, "--dry-run", action="store_true",
         help="load the tokenizer and the data, plan on a meta model, print it all; write nothing")
    _add(r, "--no-progress", action="store_true", help="no progress bar")
    _add(r, "--timeout", type=float, metavar="SECONDS",
         help="how long any wait of the runtime may last before the step fails as a hang, naming the instruction "
         "(default: from the plan, the larger of 10 minutes and 20x a step's predicted work)")
    _add(r, "--dist-timeout", type=float, metavar="SECONDS",
         help=f"torchrun: how long to wait for every rank to join (default {d.dist_timeout:g})")
    _add(r, "--shard-state", action="store_true",
         help="torchrun: each of the W servers keeps 1/W of the masters and optimizer moments (gradients "
         "reduce-scattered, new weights all-gathered) and writes its slice of each checkpoint")


def settings_from_args(a: argparse.Namespace) -> dict[str, Any]:
    """The `FinetuneConfig` fields the command line gave (flags only, no defaults, no --config)."""
    given = {f.name: getattr(a, f.name) for f in dataclasses.fields(FinetuneConfig) if hasattr(a, f.name)}
    if "lora_targets" in given:
        given["lora_targets"] = tuple(t.strip() for t in given["lora_targets"].split(",") if t.strip()) or None
    if getattr(a, "no_progress", False):
        given["progress"] = False
    return given


def config_from_args(a: argparse.Namespace) -> FinetuneConfig:
    """The `FinetuneConfig` that parsed options describe: defaults < `--config FILE` < the flags given.

    Raises one line (the CLI prints it, exit 2): ValueError for a missing --model/--data/--out and
    for a bad config file (see `rpcompile.finetune.config_file.read_config`), FileNotFoundError, ImportError.
    """
    given = settings_from_args(a)
    source = getattr(a, "config", None)
    from_file = read_config(source) if source else {}
    for group in EXCLUSIVE:  # --epochs on the command line replaces the file's steps, and so on
        if any(k in given for k in group):
            from_file = {k: v for k, v in from_file.items() if k not in group}
    merged = {**from_file, **given}
    missing = [k for k in REQUIRED if k not in merged]
    if missing:
        where = f" or as keys of --config {source}" if source else " (or give them as keys of --config FILE)"
        raise ValueError(f"{', '.join(f'--{k} {REQUIRED[k]}' for k in missing)}: required{where}")
    if merged.get("max_grad_norm") == 0:
        merged["max_grad_norm"] = None  # 0 = off, in a file as on the command line
    return FinetuneConfig(**merged)
