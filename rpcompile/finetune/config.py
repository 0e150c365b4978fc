"""The settings of one fine-tuning run (`FinetuneConfig`), what a run returns, and the check of the settings.

    >>> cfg = FinetuneConfig(model="tiny/", data="train.jsonl", out="tuned/", steps=30)
    >>> check_config(cfg)   # raises ValueError naming the first bad setting

No heavy imports: the command line and the config-file reader use it before transformers loads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rpcompile.finetune.data import PACKINGS, TRAIN_ON
from rpcompile.ir.optim import GRAD_DTYPES, MASTER_DTYPES, STATE_DTYPES
from rpcompile.finetune.schedule import SCHEDULES

__all__ = ["FinetuneConfig", "FinetuneResult", "check_config", "DTYPES", "REPORT_TO"]

REPORT_TO = ("tensorboard",)  # --report-to choices (metrics.jsonl is always written)
DTYPES = {"auto": None, "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}  # --dtype names; auto: bf16
# on CUDA, fp32 on the CPU; fp16 trains with dynamic loss scaling (rpcompile.DynamicLossScale)
MAX_COUNT = 2**31 - 1  # the largest count a setting takes (steps, seq, workers, ...): what an int32 holds
MAX_SEED = 2**32 - 1  # the largest seed: the data order draws from seed * 1_000_003 + epoch in 64 bits


@dataclass(frozen=True, slots=True)
class FinetuneConfig:
    """One fine-tuning run; every field but the three paths has a default."""

    model: str  # local save_pretrained folder: config.json, weights, tokenizer (read offline)
    data: str  # training data: .txt (a document per line) or .jsonl (rows of text, chat "messages", sharegpt
    # "conversations", or "prompt" + "completion"; one kind per file)
    out: str  # output folder: the trained model + tokenizer, the checkpoint, rpcompile-run.json
    eval: str | None = None  # held-out data (same formats): eval loss every eval_every steps and at the end
    gpus: int | None = None  # workers: None = every CUDA device, or 2 host workers without CUDA
    seq: int = 512  # tokens per packed sequence (<= the model's max_position_embeddings)
    micro_batch_size: int = 1  # sequences per microbatch
    microbatches: int | None = None  # microbatches per step, of all data-parallel ranks together (each of W
    # ranks runs 1/W of them); None = 2 * gpus * W. A step trains on micro_batch_size * microbatches sequences
    steps: int | None = None  # training steps; None: from epochs
    epochs: float | None = None  # passes over the training data when steps is None (default 1)
    lr: float | None = None  # peak learning rate; None: 2e-5, or 2e-4 with LoRA
    warmup: int = 0  # linear warmup steps before the schedule
    schedule: str = "cosine"  # after the warmup: "cosine", "linear" (both towards 0) or "constant"
    weight_decay: float = 0.0  # AdamW decoupled weight decay, on the parameters transformers' Trainer decays
    # (`Trainer.get_decay_parameter_names`: no biases, no LayerNorm/RMSNorm weights; LoRA: the adapters)
    decay_all: bool = False  # weight decay on every trainable parameter instead (biases and norms too)
    max_grad_norm: float | None = 1.0  # clip gradients by their global L2 norm; None = off
    state_dtype: str = "fp32"  # AdamW's moments: "fp32" (18 B per trainable parameter) or "bf16" (14 B: rounded
    # stochastically, the update in fp32; rpcompile.AdamW(state_dtype=torch.bfloat16))
    master_dtype: str = "fp32"  # AdamW's master weights: "fp32" or "bf16" (2 B less per trainable parameter: no
    # fp32 master, the update in fp32 stored with stochastic rounding; rpcompile.AdamW(master_dtype=torch.bfloat16))
    grad_dtype: str = "fp32"  # the host gradient buffers: "fp32" or "bf16" (2 B less per trainable parameter: rounds
    # summed in fp32, stored with stochastic rounding; rpcompile.AdamW(grad_dtype=torch.bfloat16))
    staleness: int = 1  # 1: RoundPipe (the CPU optimizer one step behind), 0: synchronous
    dtype: str = "auto"  # training dtype (DTYPES): auto = bf16 on CUDA, fp32 on the CPU; fp16 with dynamic loss scaling
    fp16_accumulation: bool = False  # fp16 GEMMs accumulate in fp16 on CUDA (needs dtype fp16; no effect on host
    # workers); the plan is priced at that rate
    lora: int = 0  # LoRA rank r (peft); 0 = full fine-tuning
    lora_alpha: float | None = None  # LoRA scale numerator (scale = alpha / r); None = 2 * r
    lora_targets: tuple[str, ...] | None = None  # modules to adapt, e.g. ("q_proj", "v_proj") or
    # ("all-linear",); None = peft's default for the architecture
    merge: bool = False  # LoRA: export the merged weights (a plain model); the adapters go to out/adapter
    save_every: int = 0  # write the checkpoint every K steps and at the end; 0 = never
    eval_every: int = 0  # eval loss every K steps (needs eval); 0 = only at the end
    resume: bool = False  # continue the run from out/rpcompile-checkpoint.rp
    overwrite: bool = False  # out holds a run or a model: replace it (its run record, checkpoint, model,
    # adapter and tokenizer files are deleted just before training starts); False: such an out is refused
    seed: int = 0  # data order, adapter initialisation, dropout
    whole_file: bool = False  # .txt data: the whole file is one document
    memory_gib: float | None = None  # device memory per worker in GiB for the planner; None = 90% of the
    # smallest CUDA device, unbounded for host workers
    lm_head_shards: int | str = "auto"  # vocabulary shards of the LM head (rpcompile.compile)
    progress: bool = True  # show the progress bar (loss, tokens/s, lr, ETA)
    train_on: str | None = None  # trained tokens: "assistant" (every reply), "last" (the final reply) or "all";
    # None = assistant for conversations, all for text (prompt/completion rows: the completion and EOS)
    packing: str = "whole"  # "whole" (bin-pack whole documents, truncating longer than seq), "split" (cut the
    # stream every seq tokens) or "none" (a document per sequence, padded); positions restart per document
    chat_template: str | None = None  # a jinja chat template file that replaces the tokenizer's (and is exported)
    text_field: str = "text"  # the key of the text in .jsonl text rows
    logging_steps: int = 1  # a line of OUT/metrics.jsonl (and the TensorBoard scalars) every K steps
    report_to: str | None = None  # also write the metrics to "tensorboard" (OUT/tensorboard; needs tensorboard)
    dry_run: bool = False  # load the tokenizer and the data, plan on a meta model, print it all; write nothing
    num_proc: int = 1  # processes that tokenize the data (the token cache is the same for any number)
    val_size: float = 0.0  # without eval: hold out this seeded fraction of the documents for the eval loss
    timeout: float | None = None  # seconds a runtime wait may last before the step fails as a hang; None: from the
    # plan (the larger of 10 minutes and 20x a step's predicted work, `rpcompile.compile(timeout=)`)
    dist_timeout: float = 60.0  # torchrun: seconds to wait for every rank to join before giving up
    shard_state: bool = False  # torchrun: each of the W servers keeps 1/W of the masters and optimizer moments
    # (`rpcompile.compile(shard_state=True)`): more servers, more capacity; each writes its slice of a checkpoint
    neftune_alpha: float = 0.0  # NEFTune: uniform noise of scale alpha / sqrt(seq * hidden) on the input
    # embeddings in training steps (never in eval); 0 = off (TRL's neftune_noise_alpha; 5 is usual)


@dataclass(frozen=True, slots=True)
class FinetuneResult:
    """What a run did."""

    steps: int  # steps completed in all (a resumed run counts the earlier ones)
    losses: list[float]  # training loss of each step this call ran
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, eval loss); the last is the final model's
    out: str = ""  # the output folder


def _finite_positive(v: object) -> bool:
    """True for an int or float that is > 0 and finite (not a bool, not NaN, not inf)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf


def check_config(cfg: FinetuneConfig) -> None:
    """Raise ValueError naming the first bad setting (every number: its type, its range, finite; see MAX_COUNT)."""
    positive = {"seq": cfg.seq, "micro_batch_size": cfg.micro_batch_size, "gpus": cfg.gpus,
                "microbatches": cfg.microbatches, "steps": cfg.steps, "logging_steps": cfg.logging_steps,
                "num_proc": cfg.num_proc}
    for name, v in positive.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_COUNT):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer (at most {MAX_COUNT:,}), "
                             f"got {v!r}")
    if cfg.report_to not in (None, *REPORT_TO):
        raise ValueError(f"--report-to must be one of {REPORT_TO}, got {cfg.report_to!r}")
    if isinstance(cfg.val_size, bool) or not isinstance(cfg.val_size, (int, float)) or not 0 <= cfg.val_size < 1:
        raise ValueError(f"--val-size must be a fraction in [0, 1), got {cfg.val_size!r}")
    if cfg.val_size and cfg.eval:
        raise ValueError("give --eval FILE or --val-size F, not both")
    for name, v in {"warmup": cfg.warmup, "save_every": cfg.save_every, "eval_every": cfg.eval_every,
                    "lora": cfg.lora}.items():
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 0 (at most {MAX_COUNT:,}), got {v!r}")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or not 0 <= cfg.seed <= MAX_SEED:
        raise ValueError(f"--seed must be an integer from 0 to {MAX_SEED} (2**32 - 1), got {cfg.seed!r}")
    if not (cfg.lm_head_shards == "auto" or isinstance(cfg.lm_head_shards, int) and not isinstance(
            cfg.lm_head_shards, bool) and 1 <= cfg.lm_head_shards <= MAX_COUNT):
        raise ValueError(f"--lm-head-shards must be auto or a positive integer (at most {MAX_COUNT:,}), got "
                         f"{cfg.lm_head_shards!r}")
    if cfg.steps is not None and cfg.epochs is not None:
        raise ValueError("give --steps or --epochs, not both")
    for name, v in {"epochs": cfg.epochs, "memory_gib": cfg.memory_gib, "lora_alpha": cfg.lora_alpha,
                    "max_grad_norm": cfg.max_grad_norm}.items():
        if v is not None and not (_finite_positive(v) and _finite_positive(v * 2**30)):  # memory_gib in bytes too
            off = " (0 = off)" if name == "max_grad_norm" else ""
            raise ValueError(f"--{name.replace('_', '-')} must be a finite positive number{off}, got {v!r}")
    if cfg.lr is not None and not 0 <= cfg.lr < math.inf:
        raise ValueError(f"--lr must be a finite number >= 0, got {cfg.lr}")
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {SCHEDULES}, got {cfg.schedule!r}")
    if cfg.staleness not in (0, 1) or isinstance(cfg.staleness, bool):
        raise ValueError(f"--staleness must be 0 or 1, got {cfg.staleness!r}")
    if cfg.state_dtype not in STATE_DTYPES:
        raise ValueError(f"--state-dtype must be one of {tuple(STATE_DTYPES)}, got {cfg.state_dtype!r}")
    if cfg.master_dtype not in MASTER_DTYPES:
        raise ValueError(f"--master-dtype must be one of {tuple(MASTER_DTYPES)}, got {cfg.master_dtype!r}")
    if cfg.grad_dtype not in GRAD_DTYPES:
        raise ValueError(f"--grad-dtype must be one of {tuple(GRAD_DTYPES)}, got {cfg.grad_dtype!r}")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    if not isinstance(cfg.fp16_accumulation, bool):
        raise ValueError(f"--fp16-accumulation is a switch (true/false), got {cfg.fp16_accumulation!r}")
    if cfg.fp16_accumulation and DTYPES[cfg.dtype] is not torch.float16:
        raise ValueError(f"--fp16-accumulation needs --dtype fp16 (it changes fp16 GEMMs only), got --dtype "
                         f"{cfg.dtype}")
    if cfg.train_on not in (None, *TRAIN_ON):
        raise ValueError(f"--train-on must be one of {TRAIN_ON}, got {cfg.train_on!r}")
    if cfg.packing not in PACKINGS:
        raise ValueError(f"--packing must be one of {PACKINGS}, got {cfg.packing!r}")
    if not (isinstance(cfg.text_field, str) and cfg.text_field):
        raise ValueError(f"--text-field must be a non-empty key, got {cfg.text_field!r}")
    if cfg.merge and not cfg.lora:
        raise ValueError("--merge merges LoRA adapters: it needs --lora R")
    if cfg.eval_every and not (cfg.eval or cfg.val_size):
        raise ValueError("--eval-every needs --eval FILE or --val-size F")
    for name, v in {"weight_decay": cfg.weight_decay, "neftune_alpha": cfg.neftune_alpha}.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v!r}")
    for name, v in {"timeout": cfg.timeout, "dist_timeout": cfg.dist_timeout}.items():
        if v is not None and not _finite_positive(v):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number of seconds > 0 (a huge one means "
                             f"no deadline), got {v!r}")
    if cfg.resume and cfg.overwrite:
        raise ValueError("give --resume (continue the run in --out) or --overwrite (replace it), not both")
