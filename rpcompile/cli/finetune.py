"""`python -m rpcompile finetune`: fine-tune a Hugging Face model folder on a data file, write a model folder.

    python -m rpcompile finetune --model ./Qwen3-1.7B --data chat.jsonl --out ./qwen3-chat \\
        --seq 2048 --micro-batch-size 1 --microbatches 16 --epochs 1 --lr 2e-5 --warmup 20 --save-every 100

    >>> from rpcompile.cli import FinetuneConfig, finetune
    >>> result = finetune(FinetuneConfig(model="tiny/", data="train.jsonl", out="tuned/", steps=30))  # doctest: +SKIP
    >>> result.losses[0] > result.losses[-1]
    True

The run: load the folder offline (`AutoModelForCausalLM`, `AutoTokenizer`),
optionally add LoRA adapters (peft), read, mask and pack the data
(`rpcompile.cli.data`: which tokens are trained, `train_on`;
`rpcompile.cli.packing`: documents kept apart, `packing`) and print one summary
line (rows, documents, sequences, trained tokens, documents truncated), compile
for RoundPipe with the token-weighted loss (`loss_mean="tokens"`: a step's loss
is the NLL summed over its trained tokens / their number), then per step set
the scheduled learning rate (`rpcompile.cli.schedule`) and `step` one batch
(`input_ids`, `labels`, `position_ids`); eval loss before the first step, every
`eval_every` steps and at the end, weighted by trained tokens the same way; an
atomic checkpoint every `save_every` steps; at the end `save_pretrained` into
`out` (with the `chat_template` given, if any).

Files in `out`: the exported model and tokenizer (or the LoRA adapters),
`rpcompile-checkpoint.rp` (the full training state, incl. the optimizer's
pending staleness-1 update and the RNG) and `rpcompile-run.json` (the settings
and a fingerprint of the data; written atomically). The data position and the
schedule step are both the checkpoint's step count, so `resume=True` continues
bit for bit; it refuses settings that differ from the run's.

A finished run is never overwritten by accident: an `out` that holds a run record,
a checkpoint, or model, adapter or tokenizer files is refused unless the run is
resumed (`resume=True`) or replaced (`overwrite=True`, which deletes those files
first).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rpcompile.api import compile, load
from rpcompile.checkpoint import write_text_atomic
from rpcompile.cli.data import PACKINGS, TRAIN_ON, pack, read_documents, read_template
from rpcompile.cli.packed_attention import use_packed_attention
from rpcompile.cli.hf import TOKENIZER_FILES, add_lora, check_model, export, load_model, load_tokenizer, \
    trainable_module
from rpcompile.cli.schedule import SCHEDULES, lr_at
from rpcompile.ir.optim import AdamW

__all__ = ["FinetuneConfig", "FinetuneResult", "finetune", "CHECKPOINT", "RUN_FILE", "DTYPES"]

CHECKPOINT = "rpcompile-checkpoint.rp"  # in `out`: the training state (rpcompile.load format)
RUN_FILE = "rpcompile-run.json"  # in `out`: the run's settings and data fingerprint, checked on resume
DTYPES = {"auto": None, "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16}  # --dtype names; auto: bf16 on CUDA, fp32 on the CPU
# a resume may change these (the data file is checked by the fingerprint of its packed tokens, not its path)
FREE = ("out", "data", "resume", "overwrite", "save_every", "eval", "eval_every", "progress")
# what a run writes into `out` (and `out/adapter`): found there, it is refused without --resume or --overwrite
RUN_OUTPUTS = (RUN_FILE, CHECKPOINT, "config.json", "generation_config.json", "adapter_config.json",
               "special_tokens_map.json", "chat_template.jinja", *TOKENIZER_FILES)
WEIGHTS = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")  # ... and the weight files'
# endings (*.safetensors, sharded model-00001-of-00002.safetensors, pytorch_model.bin, their index files)


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
    microbatches: int | None = None  # microbatches per step; None = 2 * gpus. A step trains on
    # micro_batch_size * microbatches sequences
    steps: int | None = None  # training steps; None: from epochs
    epochs: float | None = None  # passes over the training data when steps is None (default 1)
    lr: float | None = None  # peak learning rate; None: 2e-5, or 2e-4 with LoRA
    warmup: int = 0  # linear warmup steps before the schedule
    schedule: str = "cosine"  # after the warmup: "cosine", "linear" (both towards 0) or "constant"
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    max_grad_norm: float | None = 1.0  # clip gradients by their global L2 norm; None = off
    staleness: int = 1  # 1: RoundPipe (the CPU optimizer one step behind), 0: synchronous
    dtype: str = "auto"  # training dtype (DTYPES): auto = bf16 on CUDA, fp32 on the CPU
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


@dataclass(frozen=True, slots=True)
class FinetuneResult:
    """What a run did."""

    steps: int  # steps completed in all (a resumed run counts the earlier ones)
    losses: list[float]  # training loss of each step this call ran
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, eval loss); the last is the final model's
    out: str = ""  # the output folder


def _check(cfg: FinetuneConfig) -> None:
    """Raise ValueError naming the first bad setting."""
    positive = {"seq": cfg.seq, "micro_batch_size": cfg.micro_batch_size, "gpus": cfg.gpus,
                "microbatches": cfg.microbatches, "steps": cfg.steps}
    for name, v in positive.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
    for name, v in {"warmup": cfg.warmup, "save_every": cfg.save_every, "eval_every": cfg.eval_every,
                    "lora": cfg.lora, "seed": cfg.seed}.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 0, got {v!r}")
    if cfg.steps is not None and cfg.epochs is not None:
        raise ValueError("give --steps or --epochs, not both")
    if cfg.epochs is not None and not cfg.epochs > 0:
        raise ValueError(f"--epochs must be > 0, got {cfg.epochs}")
    if cfg.lr is not None and not 0 <= cfg.lr < math.inf:
        raise ValueError(f"--lr must be a finite number >= 0, got {cfg.lr}")
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {SCHEDULES}, got {cfg.schedule!r}")
    if cfg.staleness not in (0, 1) or isinstance(cfg.staleness, bool):
        raise ValueError(f"--staleness must be 0 or 1, got {cfg.staleness!r}")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r} (fp16 needs loss scaling: "
                         f"use bf16)")
    if cfg.train_on not in (None, *TRAIN_ON):
        raise ValueError(f"--train-on must be one of {TRAIN_ON}, got {cfg.train_on!r}")
    if cfg.packing not in PACKINGS:
        raise ValueError(f"--packing must be one of {PACKINGS}, got {cfg.packing!r}")
    if not (isinstance(cfg.text_field, str) and cfg.text_field):
        raise ValueError(f"--text-field must be a non-empty key, got {cfg.text_field!r}")
    if cfg.merge and not cfg.lora:
        raise ValueError("--merge merges LoRA adapters: it needs --lora R")
    if cfg.eval_every and not cfg.eval:
        raise ValueError("--eval-every needs --eval FILE")
    if cfg.memory_gib is not None and not cfg.memory_gib > 0:
        raise ValueError(f"--memory-gib must be > 0, got {cfg.memory_gib}")
    if cfg.resume and cfg.overwrite:
        raise ValueError("give --resume (continue the run in --out) or --overwrite (replace it), not both")


def _check_out(cfg: FinetuneConfig) -> None:
    """Raise unless `cfg.out` is a folder this run may write: writable, and no other run's unless told."""
    out = os.path.abspath(cfg.out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise NotADirectoryError(f"--out {cfg.out!r} is a file, not a folder: give a folder for the trained model")
    existing = out
    while not os.path.exists(existing):  # the nearest existing folder above: os.makedirs creates the rest
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise NotADirectoryError(f"--out {cfg.out!r}: {existing!r} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"--out {cfg.out!r}: cannot write in {existing!r} (permission denied)")
    if os.path.isdir(out) and os.path.isdir(cfg.model) and os.path.samefile(out, cfg.model):
        raise ValueError(f"--out {cfg.out!r} is the --model folder: give another folder (it would replace the "
                         f"model being trained)")
    found = _previous_run(cfg.out)
    if found and not cfg.resume and not cfg.overwrite:
        names = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ValueError(f"--out {cfg.out!r} already holds a run or a model ({names}): continue that run with "
                         f"--resume, replace it with --overwrite, or give another --out")


def _previous_run(out: str) -> list[str]:
    """The files of `out` (and `out/adapter`) a run writes: run record, checkpoint, model, adapters, tokenizer."""
    found = []
    for folder in (out, os.path.join(out, "adapter")):
        if os.path.isdir(folder):
            found += [os.path.relpath(os.path.join(folder, n), out) for n in sorted(os.listdir(folder))
                      if (n in RUN_OUTPUTS or n.endswith(WEIGHTS)) and os.path.isfile(os.path.join(folder, n))]
    return sorted(found, key=lambda n: (n not in (RUN_FILE, CHECKPOINT), not n.endswith(WEIGHTS), n))  # the
    # run's own files first, then the weights


def finetune(cfg: FinetuneConfig, *, on_step: Callable[[int, float], None] | None = None) -> FinetuneResult:
    """Fine-tune `cfg.model` on `cfg.data` with RoundPipe and write the result to `cfg.out`.

    Args:
        cfg: the run (see `FinetuneConfig`; each field is a command-line option).
        on_step: called as on_step(step, loss) after each step (and its checkpoint) for logging;
            an exception from it stops the run, which `resume=True` continues from the last checkpoint.
    Returns:
        A `FinetuneResult`: steps, the losses of this call, eval losses, the output folder.
    Raises:
        FileNotFoundError / ValueError / ImportError: bad input, named (the CLI prints one line, exit 2);
            ValueError too for an `out` that holds a run or a model, without `resume` or `overwrite`.
        NotADirectoryError / PermissionError: `out` is a file, or cannot be written.

    Note:
        The learning rate of step t, `lr_at(t)`, is set just before `step(batch_t)`, so it is
        the lr of the update made from step t's gradient. With staleness 1 that update runs
        on the CPU during step t+1, and its weights are first read by step t+2.
        At the end the last update is also written into the compute copies, so the final eval,
        the exported folder and `from_pretrained(out)` all see the same, fully updated weights.

    Example:
        >>> finetune(FinetuneConfig(model="tiny/", data="notes.txt", out="tuned/", steps=10)).steps  # doctest: +SKIP
        10
    """
    _check(cfg)
    _check_out(cfg)  # before anything slow: a finished run is never overwritten by accident
    cuda = torch.cuda.is_available()
    dtype = DTYPES[cfg.dtype] or (torch.bfloat16 if cuda else torch.float32)
    tokenizer = load_tokenizer(cfg.model)  # everything that can be wrong is checked before the weights load
    config = check_model(cfg.model, tokenizer, cfg.seq)
    if cfg.chat_template:
        tokenizer.chat_template = read_template(cfg.chat_template)  # used for the data, and exported
    train = _data(cfg, cfg.data, tokenizer)
    held = _data(cfg, cfg.eval, tokenizer) if cfg.eval else None
    run = _run_record(cfg, train)
    if cfg.resume:
        _check_resume(cfg, run)
    model = load_model(cfg.model, dtype=dtype)
    gpus = cfg.gpus or (torch.cuda.device_count() if cuda else 2)
    micro = cfg.microbatches or 2 * gpus
    size = cfg.micro_batch_size * micro  # sequences per step
    total = cfg.steps or max(1, math.ceil((cfg.epochs or 1.0) * len(train) / size))
    lr = cfg.lr if cfg.lr is not None else (2e-4 if cfg.lora else 2e-5)
    use_cache = getattr(config, "use_cache", True)  # load_model turned it off for training
    if cfg.lora:
        model = add_lora(model, cfg.lora, alpha=cfg.lora_alpha, targets=cfg.lora_targets, seed=cfg.seed)
    module = trainable_module(model)
    if cfg.packing != "none":  # documents packed per row: attention per document, memory linear in --seq
        use_packed_attention(module)

    os.makedirs(cfg.out, exist_ok=True)
    ckpt = os.path.join(cfg.out, CHECKPOINT)
    if cfg.resume:
        c = load(ckpt, module)
    else:
        if cfg.overwrite:
            _remove_previous(cfg.out)
        # written before any checkpoint exists, atomically: a kill leaves the old record or the new one
        write_text_atomic(os.path.join(cfg.out, RUN_FILE), json.dumps(run, indent=1))
        c = compile(module, gpus=gpus, example=train.batch(0, size, cfg.seed), microbatches=micro,
                    staleness=cfg.staleness, dtype=dtype, seed=cfg.seed,
                    optimizer=AdamW(lr=lr, weight_decay=cfg.weight_decay,
                                    max_grad_norm=cfg.max_grad_norm),
                    memory_budget=_budget(cfg, cuda), lm_head_shards=cfg.lm_head_shards, loss_mean="tokens")
    _describe(cfg, module, train, c, total, size)
    evals: list[tuple[int, float]] = []
    with c:
        losses = _loop(c, cfg, train, held, total, size, lr, ckpt, evals, on_step)
        if cfg.save_every and c.steps % cfg.save_every:
            c.save(ckpt)  # the end of the run (a multiple of save_every was saved in the loop)
        c.model()  # every update into the module, the pending staleness-1 one too
        for group in range(len(c.state.groups)):
            c.state.copy(group)  # ... and into the compute copies: nothing will read the stale version now
        if held is not None:
            evals.append((c.steps, _evaluate(c, held, size)))
            print(f"step {c.steps}: eval loss {evals[-1][1]:.4f} (final model)")
    export(model, tokenizer, cfg.out, merge=cfg.merge, use_cache=use_cache)
    print(f"wrote {os.path.abspath(cfg.out)} ({'LoRA adapters' if cfg.lora and not cfg.merge else 'model'} "
          f"and tokenizer; load with from_pretrained)")
    return FinetuneResult(c.steps, losses, evals, cfg.out)


def _loop(c: Any, cfg: FinetuneConfig, train: Any, held: Any, total: int, size: int, lr: float, ckpt: str,
          evals: list, on_step: Callable | None) -> list[float]:
    """Step until `total`: schedule, step, progress, checkpoint, eval; returns this call's losses."""
    from tqdm.auto import tqdm

    losses: list[float] = []
    tokens = size * cfg.seq
    if held is not None and c.steps == 0:
        evals.append((0, _evaluate(c, held, size)))  # the model before training
        print(f"step 0: eval loss {evals[-1][1]:.4f}")
    with tqdm(total=total, initial=c.steps, unit="step", disable=not cfg.progress, dynamic_ncols=True) as bar:
        while c.steps < total:
            t = c.steps
            rate = lr_at(t, lr=lr, total=total, warmup=cfg.warmup, kind=cfg.schedule)
            c.set_lr(rate)  # the lr of the update made from this step's gradient
            start = time.perf_counter()
            losses.append(c.step(train.batch(t, size, cfg.seed)))
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens / (time.perf_counter() - start):,.0f}",
                            lr=f"{rate:.2e}", refresh=False)
            bar.update(1)
            if cfg.save_every and c.steps % cfg.save_every == 0:
                c.save(ckpt)
            if held is not None and cfg.eval_every and c.steps % cfg.eval_every == 0 and c.steps < total:
                evals.append((c.steps, _evaluate(c, held, size)))
                bar.write(f"step {c.steps}: eval loss {evals[-1][1]:.4f}")
            if on_step is not None:
                on_step(c.steps, losses[-1])
    return losses


def _data(cfg: FinetuneConfig, path: str, tokenizer: Any) -> Any:
    """Read, mask and pack one data file; print its summary line."""
    docs = read_documents(path, tokenizer, whole_file=cfg.whole_file, train_on=cfg.train_on,
                          text_field=cfg.text_field)
    packed = pack(docs, tokenizer, cfg.seq, cfg.packing)
    dropped = f", {packed.dropped:,} left out (nothing to train)" if packed.dropped else ""
    print(f"data {path}: {len(docs):,} rows, {packed.documents:,} documents, {len(packed):,} sequences of {cfg.seq} "
          f"(packing {cfg.packing}), {packed.trained:,} trained tokens, {packed.truncated:,} documents "
          f"truncated{dropped}", flush=True)
    return packed


def _evaluate(c: Any, held: Any, size: int) -> float:
    """The held-out loss: with the token-weighted loss, sum NLL / trained tokens over all of it (each
    sequence once); else the mean of `evaluate` over the batches (each the mean of its microbatch losses)."""
    if getattr(c.options, "loss_mean", "microbatch") != "tokens":
        batches = held.eval_batches(size)
        return sum(c.evaluate(b) for b in batches) / len(batches)
    batches = held.eval_batches(size, fill="ignore")
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    return sum(c.evaluate(b) * n for b, n in zip(batches, counts) if n) / sum(counts)


def _budget(cfg: FinetuneConfig, cuda: bool) -> int | None:
    """Device bytes per worker for the planner: --memory-gib, else 90% of the smallest CUDA device."""
    if cfg.memory_gib is not None:
        return int(cfg.memory_gib * 2**30)
    if not cuda:
        return None
    return int(0.9 * min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())))


def _run_record(cfg: FinetuneConfig, train: Any) -> dict[str, Any]:
    """The run's settings and a fingerprint of its packed training data (what resume must match)."""
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in (train.ids, train.labels, train.positions)))
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()}
    return {"settings": settings, "data": {"sequences": len(train), "tokens": train.tokens, "trained": train.trained,
                                           "sha256": digest.hexdigest()}}


def _remove_previous(out: str) -> None:
    """--overwrite: delete the files a run wrote into `out` (see `_previous_run`), saying how many."""
    found = _previous_run(out)
    for name in found:
        os.remove(os.path.join(out, name))
    if found:
        print(f"--overwrite: removed {len(found)} files of the previous run or model in {out}")


def _read_run(path: str) -> dict[str, Any]:
    """The run record at `path`; ValueError naming it if it is not valid JSON or not a run record."""
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if not isinstance(saved, dict) or not isinstance(saved.get("settings"), dict) or "data" not in saved:
            raise ValueError(f"a JSON {type(saved).__name__}, without 'settings' and 'data'")
    except json.JSONDecodeError as exc:
        why = f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
    except ValueError as exc:  # UnicodeDecodeError included
        why = str(exc)
    else:
        return saved
    raise ValueError(f"--resume: the run record {path!r} is corrupt ({why}); restore it, or start the run over "
                     f"with --overwrite")


def _check_resume(cfg: FinetuneConfig, run: dict[str, Any]) -> None:
    """Raise unless out/ holds a checkpoint of a run with the same settings and data."""
    path, ckpt = os.path.join(cfg.out, RUN_FILE), os.path.join(cfg.out, CHECKPOINT)
    if not os.path.isfile(ckpt) or not os.path.isfile(path):
        missing = ckpt if not os.path.isfile(ckpt) else path
        raise FileNotFoundError(f"--resume: {missing!r} does not exist (run with --save-every K to write "
                                f"checkpoints)")
    saved = _read_run(path)
    diff = [f"{k}={saved['settings'].get(k)!r} then, {v!r} now" for k, v in run["settings"].items()
            if k not in FREE and saved["settings"].get(k) != v]
    if diff:
        raise ValueError(f"--resume: the settings differ from the run in {cfg.out!r}: {'; '.join(diff)}")
    if saved["data"] != run["data"]:
        raise ValueError(f"--resume: the training data differs from the run's ({saved['data']} then, "
                         f"{run['data']} now)")


def _describe(cfg: FinetuneConfig, module: Any, train: Any, c: Any, total: int, size: int) -> None:
    """The run in a few lines: model, batch, plan (the data's line was printed when it was packed)."""
    n = sum(p.numel() for p in module.parameters())
    k = sum(p.numel() for p in module.parameters() if p.requires_grad)
    print(f"{type(module).__name__} from {cfg.model}: {n:,} parameters, {k:,} trainable")
    print(f"{total} steps of {size} sequences ({c.microbatches} microbatches x {size // c.microbatches}), "
          f"{c.options.gpus} workers, staleness {c.options.staleness}, plan {c.plan.to_str()}"
          + (f"; resumed at step {c.steps}" if c.steps else ""))
