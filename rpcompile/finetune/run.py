"""`python -m rpcompile finetune`: fine-tune a Hugging Face model folder on a data file, write a model folder.

    python -m rpcompile finetune --model ./Qwen3-1.7B --data chat.jsonl --out ./qwen3-chat \\
        --seq 2048 --micro-batch-size 1 --microbatches 16 --epochs 1 --lr 2e-5 --warmup 20 --save-every 100

    >>> from rpcompile.finetune import FinetuneConfig, finetune
    >>> result = finetune(FinetuneConfig(model="tiny/", data="train.jsonl", out="tuned/", steps=30))  # doctest: +SKIP
    >>> result.losses[0] > result.losses[-1]                                                        # doctest: +SKIP
    True

The run: load the folder offline (`AutoModelForCausalLM`, `AutoTokenizer`),
optionally add LoRA adapters (peft), read, mask and pack the data
(`rpcompile.finetune.data`: which tokens are trained, `train_on`;
`rpcompile.finetune.data.packing`: documents kept apart, `packing`) and print one summary
line (rows, documents, sequences, trained tokens, documents truncated), compile
for RoundPipe with the token-weighted loss (`loss_mean="tokens"`: a step's loss
is the NLL summed over its trained tokens / their number) and AdamW whose weight
decay skips what transformers' Trainer skips (biases, norm weights; `decay_all`
decays everything), NEFTune noise on the input embeddings if asked
(`rpcompile.finetune.neftune`), then per step set the scheduled learning rate
(`rpcompile.finetune.schedule`: transformers' `get_scheduler`) and `step` one batch
(`input_ids`, `labels`, `position_ids`); eval loss and token accuracy before the
first step, every `eval_every` steps and at the end, weighted by trained tokens the same way; an
atomic checkpoint every `save_every` steps; at the end `save_pretrained` into
`out` (with the `chat_template` given, if any).

Files in `out`: the exported model and tokenizer (or the LoRA adapters),
`rpcompile-checkpoint.rp` (the full training state, incl. the optimizer's
pending staleness-1 update and the RNG) and `rpcompile-run.json` (the settings
and a fingerprint of the data; written atomically). The data position and the
schedule step are both the checkpoint's step count, so `resume=True` continues
bit for bit; it refuses settings that differ from the run's.

One run at a time owns `out`: an exclusive lock on the folder for the whole run refuses a second run
on the same folder at once, naming the first one's pid (`rpcompile.finetune.out.claim_out`). A refused
run writes nothing: the settings, `out`, and for a resume its checkpoint, settings and metrics file are
checked before anything is written, and a new `out` is created only when the run starts writing (its
token cache). What needs the packed data (a run that does not fit, a resume whose data differs) is
refused after that cache is written, and the refusal takes it back (`out.taken_back_if_refused`: the
folder if the run made it, else the cache entries it added).

A finished run is never overwritten by accident: an `out` that holds a run record,
a checkpoint, or model, adapter or tokenizer files is refused unless the run is
resumed (`resume=True`) or replaced (`overwrite=True`, which deletes those files
first).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from typing import Any, Callable

import torch

from rpcompile.api import compile
from rpcompile.resume import load
from rpcompile.checkpoint import write_text_atomic
from rpcompile.finetune.data import CONVERSATIONAL, NothingToTrain, file_kind, prepare, read_template
from rpcompile.finetune.config import DTYPES, MAX_COUNT, FinetuneConfig, FinetuneResult, check_config
from rpcompile.finetune.dist import Ranks
from rpcompile.finetune.loop import Loop, StepFailed, StepOutOfMemory, StepPlan
from rpcompile.finetune.out import (CHECKPOINT, RUN_FILE, TOKEN_CACHE, OutLock, check_resume_data, claim_out,
                                   remove_previous, run_record, taken_back_if_refused)
from rpcompile.finetune.hf import add_lora, check_model, decay_parameters, export, load_model, load_tokenizer, \
    trainable_module
from rpcompile.finetune.metrics import MetricsLog, check_report_to
from rpcompile.finetune.neftune import add_neftune, remove_neftune
from rpcompile.finetune.packed_attention import use_packed_attention
from rpcompile.finetune.preflight import preflight
from rpcompile.ir.optim import GRAD_DTYPES, MASTER_DTYPES, STATE_DTYPES, AdamW, DynamicLossScale

__all__ = ["FinetuneConfig", "FinetuneResult", "finetune", "CHECKPOINT", "RUN_FILE", "DTYPES", "StepOutOfMemory",
           "StepFailed"]


def finetune(cfg: FinetuneConfig, *, on_step: Callable[[int, float], None] | None = None) -> FinetuneResult:
    """Fine-tune `cfg.model` on `cfg.data` with RoundPipe and write the result to `cfg.out`.

    Args:
        cfg: the run (see `FinetuneConfig`; each field is a command-line option).
        on_step: called as on_step(step, loss) after each step (and its checkpoint) for logging;
            an exception from it stops the run, which `resume=True` continues from the last checkpoint.
    Returns:
        A `FinetuneResult`: steps, the losses of this call, eval losses, the output folder
        (a dry run: 0 steps, no losses).
    Raises:
        FileNotFoundError / ValueError / ImportError: bad input, named (the CLI prints one line, exit 2);
            ValueError too for an `out` that holds a run or a model, without `resume` or `overwrite`,
            and for a run that does not fit the host or device memory (checked before the weights load).
            ValueError too when another run holds `out` (its lock; the message names its pid).
        NotADirectoryError / PermissionError: `out` is a file, or cannot be written.
        TimeoutError: under torchrun, the ranks did not all join within `dist_timeout` (one line).
        StepFailed: a step failed in the runtime (an instruction raised, or a wait ran past `timeout`):
            one line naming the step, the instruction, its worker and the wait; the grid and the
            tracebacks are in OUT/rpcompile-failure.txt (the CLI: exit status 1).
        StepOutOfMemory: a step ran out of device or host memory (a MemoryError: the CLI prints its
            one line, exit 2); the last checkpoint stays valid.
        KeyboardInterrupt: Ctrl-C (from the command line, SIGTERM too); the step is undone and the last
            checkpoint stays valid; its message is one line naming the step and the checkpoint kept (the CLI
            prints it: exit 130, 143 for SIGTERM).

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
    check_config(cfg)
    check_report_to(cfg.report_to)
    _check_transformers()
    ranks = Ranks.from_env(cfg.dist_timeout)  # alone, or one of torchrun's processes
    if cfg.shard_state and ranks.world == 1:
        raise ValueError("--shard-state splits the optimizer state over the servers of a torchrun run: launch 2 or "
                         "more (WORLD_SIZE > 1), or leave it out to keep the whole state on this one")
    locks: list[OutLock] = []
    if not cfg.dry_run:  # before anything slow: a finished run is never overwritten by accident, and one run
        ranks.on_rank0(lambda: locks.append(claim_out(cfg)))  # at a time owns the folder (rank 0's lock)
    try:
        return _train(cfg, ranks, on_step, locks)
    finally:
        for lock in locks:
            lock.release()


def _train(cfg: FinetuneConfig, ranks: Ranks, on_step: Callable[[int, float], None] | None,
           locks: list[OutLock]) -> FinetuneResult:
    """The run of `finetune`, once `out` is this run's (see its docstring; `locks`: rank 0's lock of `out`)."""
    cuda = torch.cuda.is_available()
    dtype = DTYPES[cfg.dtype] or (torch.bfloat16 if cuda else torch.float32)
    tokenizer = load_tokenizer(cfg.model)  # everything that can be wrong is checked before the weights load
    config = check_model(cfg.model, tokenizer, cfg.seq)
    if cfg.chat_template:
        tokenizer.chat_template = read_template(cfg.chat_template)  # used for the data, and exported
    gpus = cfg.gpus or (torch.cuda.device_count() if cuda else 2)
    micro = ranks.microbatches(cfg.microbatches or 2 * gpus * ranks.world)  # this rank's share of the step's
    with taken_back_if_refused(cfg.out, ranks.writes and not cfg.dry_run,  # a refusal leaves out as it was
                               held=lambda: any(lock.held for lock in locks)):  # (if this run owns it)
        ranks.on_rank0(lambda: [lock.hold(cfg) for lock in locks])  # the first write into out: its token cache
        train, held = _datasets(cfg, tokenizer, ranks)
        run = run_record(cfg, train, held if cfg.val_size else None)
        ranks.same_everywhere(json.dumps(run["data"], sort_keys=True), "the training data")
        if cfg.resume:
            ranks.on_rank0(lambda: check_resume_data(cfg, run))
        size = cfg.micro_batch_size * micro * ranks.world  # sequences per step, every rank together
        plan = StepPlan(total=cfg.steps or _epoch_steps(cfg, len(train), size), size=size,
                        lr=cfg.lr if cfg.lr is not None else (2e-4 if cfg.lora else 2e-5),
                        checkpoint=os.path.join(cfg.out, CHECKPOINT))
        optimizer = AdamW(lr=plan.lr, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                          state_dtype=STATE_DTYPES[cfg.state_dtype], master_dtype=MASTER_DTYPES[cfg.master_dtype],
                          grad_dtype=GRAD_DTYPES[cfg.grad_dtype])
        lora = dict(rank=cfg.lora, alpha=cfg.lora_alpha, targets=cfg.lora_targets, seed=cfg.seed) if cfg.lora else None
        example = ranks.share(train.batch(0, size, cfg.seed))
        pre = preflight(config, example, gpus=gpus, microbatches=micro, microbatch_size=cfg.micro_batch_size,
                        staleness=cfg.staleness, dtype=dtype, optimizer=optimizer, budget=_budget(cfg, cuda), lora=lora,
                        packed=cfg.packing != "none", lm_head_shards=cfg.lm_head_shards,
                        fp16_accumulation=cfg.fp16_accumulation, seq_limit=cfg.dry_run,  # refuses what cannot fit
                        shard=(ranks.rank, ranks.world) if cfg.shard_state else None)
        if cfg.dry_run:
            print("\n".join(pre.lines()))
            print(f"{pre.host.per_param_line()}, {cfg.state_dtype} moments (--state-dtype)"
                  f"{', bf16 master (--master-dtype)' if cfg.master_dtype == 'bf16' else ''}"
                  f"{', bf16 gradients (--grad-dtype)' if cfg.grad_dtype == 'bf16' else ''}")
            print(f"dry run: {plan.total} steps of {size} sequences; nothing loaded or written")
            return FinetuneResult(0, [], [], cfg.out)
        print(f"fits: {pre.lines()[1]}; {pre.lines()[2]}")

    model = load_model(cfg.model, dtype=dtype)
    use_cache = getattr(config, "use_cache", True)  # load_model turned it off for training
    if lora is not None:
        model = add_lora(model, **lora)
    module = trainable_module(model)
    if cfg.packing != "none":  # documents packed per row: attention per document, memory linear in --seq
        use_packed_attention(module)
    if cfg.weight_decay and not cfg.decay_all:  # Trainer's groups: no biases, no norm weights
        optimizer = dataclasses.replace(optimizer, decay=decay_parameters(model))
    noise = add_neftune(model, cfg.neftune_alpha) if cfg.neftune_alpha else None  # training steps only
    if ranks.writes:
        os.makedirs(cfg.out, exist_ok=True)
    c = _start(cfg, module, run, example, ranks, plan, gpus=gpus, micro=micro, dtype=dtype, optimizer=optimizer,
               budget=_budget(cfg, cuda))
    _describe(cfg, module, c, plan, ranks)
    evals: list[tuple[int, float]] = []
    log = MetricsLog(cfg.out, report_to=cfg.report_to, resume_at=c.steps) if ranks.writes else None
    try:
        with c:
            loop = Loop(c, cfg, plan, train, held, log, ranks)
            losses = loop.run(evals, on_step)
            if cfg.save_every and c.steps % cfg.save_every:
                c.save(plan.checkpoint)  # the end of the run (a multiple of save_every was saved in the loop)
            c.model()  # every update into the module, the pending staleness-1 one too
            for group in range(len(c.state.groups)):
                c.state.copy(group)  # ... and into the compute copies: nothing will read the stale version now
            if held is not None:
                print(loop.evaluate(evals) + " (final model)")
            loop.finish(evals)
    finally:
        if log is not None:
            log.close()
    if noise is not None:
        remove_neftune(model, noise)
    if ranks.writes:
        export(model, tokenizer, cfg.out, merge=cfg.merge, use_cache=use_cache)
        print(f"wrote {os.path.abspath(cfg.out)} ({'LoRA adapters' if cfg.lora and not cfg.merge else 'model'} "
              f"and tokenizer; load with from_pretrained)")
    return FinetuneResult(c.steps, losses, evals, cfg.out)


def _check_transformers() -> None:
    """ImportError in one line naming the extra to install, if transformers is missing."""
    if importlib.util.find_spec("transformers") is None:
        raise ImportError('finetune needs transformers, peft and tokenizers: pip install "rpcompile[finetune]"')


def _start(cfg: FinetuneConfig, module: Any, run: dict, example: Any, ranks: Ranks, plan: StepPlan, *,
           gpus: int, micro: int, dtype: torch.dtype, optimizer: AdamW, budget: int | None) -> Any:
    """The Compiled run: loaded from the checkpoint (`resume`), or compiled after writing the run record."""
    dist = ranks.world > 1
    if cfg.shard_state:  # each rank writes its slice of the checkpoints into its own out
        os.makedirs(cfg.out, exist_ok=True)
    if cfg.resume:
        local = ranks.fetch_checkpoint(plan.checkpoint)  # rank 0's file (and a sharded one's slices), on every server
        try:
            return load(local, module, dist=dist, timeout=cfg.timeout, shard_state=cfg.shard_state,
                        microbatches=micro, example=example)  # another number of servers: planned afresh
        finally:
            ranks.release(local, plan.checkpoint)
    if ranks.writes:
        if cfg.overwrite:
            remove_previous(cfg.out)
        # written before any checkpoint exists, atomically: a kill leaves the old record or the new one
        write_text_atomic(os.path.join(cfg.out, RUN_FILE), json.dumps(run, indent=1))
    return compile(module, gpus=gpus, example=example, microbatches=micro, staleness=cfg.staleness, dtype=dtype,
                   seed=cfg.seed, optimizer=optimizer, memory_budget=budget, lm_head_shards=cfg.lm_head_shards,
                   loss_mean="tokens", dist=dist, fp16_accumulation=cfg.fp16_accumulation, timeout=cfg.timeout,
                   shard_state=cfg.shard_state,
                   loss_scale=DynamicLossScale() if dtype == torch.float16 else None)  # fp16: gradients underflow


def _epoch_steps(cfg: FinetuneConfig, sequences: int, size: int) -> int:
    """The steps `--epochs` makes of `sequences` in steps of `size`; ValueError naming it past MAX_COUNT."""
    steps = max(1, math.ceil((cfg.epochs or 1.0) * sequences / size))
    if steps > MAX_COUNT:
        raise ValueError(f"--epochs {cfg.epochs:g} makes {steps:,} steps of {size} sequences, more than "
                         f"{MAX_COUNT:,}; give fewer epochs or --steps")
    return steps


def _datasets(cfg: FinetuneConfig, tokenizer: Any, ranks: Ranks) -> tuple[Any, Any]:
    """(train, held): the packed training data and the held-out data (--eval, or --val-size of the training
    documents, or None), each with its summary line. Rank 0 of a real run keeps the token cache in
    OUT/token-cache; a dry run and the other ranks tokenize into a temporary one."""
    root = os.path.join(cfg.out, TOKEN_CACHE) if ranks.writes and not cfg.dry_run else None
    train = _data(cfg, cfg.data, tokenizer, root)
    if cfg.eval:
        return train, _data(cfg, cfg.eval, tokenizer, root, flag="--eval")
    if not cfg.val_size:
        return train, None
    try:
        train, held = train.split_documents(cfg.val_size, cfg.seed)
    except NothingToTrain as exc:
        raise _no_targets(cfg, f"--val-size {cfg.val_size:g}: a part of --data", cfg.data, exc) from None
    for name, part in (("training", train), ("held out", held)):
        _summary(f"--val-size {cfg.val_size}: {name}", part, cfg)
    return train, held


def _data(cfg: FinetuneConfig, path: str, tokenizer: Any, cache_root: str | None, flag: str = "--data") -> Any:
    """Read, mask and pack one data file (through the token cache); print its summary line."""
    try:
        packed = prepare(path, tokenizer, seq=cfg.seq, packing=cfg.packing, whole_file=cfg.whole_file,
                         train_on=cfg.train_on, text_field=cfg.text_field, cache_root=cache_root,
                         num_proc=cfg.num_proc)
    except NothingToTrain as exc:
        raise _no_targets(cfg, flag, path, exc) from None
    _summary(f"data {path}", packed, cfg, rows=f"{packed.read:,} rows, ")
    return packed


def _no_targets(cfg: FinetuneConfig, flag: str, path: str, exc: NothingToTrain) -> ValueError:
    """The no-trained-token error naming the file (--data, --eval) and, for conversations, the chat template."""
    if file_kind(path, cfg.text_field) not in CONVERSATIONAL:
        return ValueError(f"{flag} {path!r}: {exc}")
    template = (f"the template of --chat-template {cfg.chat_template!r}" if cfg.chat_template else
                f"the tokenizer's chat template (of --model {cfg.model!r})")
    return ValueError(f"{flag} {path!r}: none of its {exc.documents} conversation(s) leaves a token to train on "
                      f"(--train-on {cfg.train_on or 'assistant'}) as {template} renders them: does it render "
                      f"each message's content?")


def _summary(what: str, packed: Any, cfg: FinetuneConfig, rows: str = "") -> None:
    """One line: rows read, documents, sequences, trained tokens, truncated and dropped documents, cache hit."""
    dropped = f", {packed.dropped:,} left out (nothing to train)" if packed.dropped else ""
    hit = " (token cache: hit, nothing tokenized)" if packed.cached else ""
    print(f"{what}: {rows}{packed.documents:,} documents, {len(packed):,} sequences of {cfg.seq} (packing "
          f"{cfg.packing}), {packed.trained:,} trained tokens, {packed.truncated:,} documents truncated{dropped}{hit}",
          flush=True)


def _budget(cfg: FinetuneConfig, cuda: bool) -> int | None:
    """Device bytes per worker for the planner: --memory-gib, else 90% of the smallest CUDA device."""
    if cfg.memory_gib is not None:
        return int(cfg.memory_gib * 2**30)
    if not cuda:
        return None
    return int(0.9 * min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())))


def _describe(cfg: FinetuneConfig, module: Any, c: Any, plan: StepPlan, ranks: Ranks) -> None:
    """The run in a few lines: model, batch, plan (the data's line was printed when it was packed)."""
    n = sum(p.numel() for p in module.parameters())
    k = sum(p.numel() for p in module.parameters() if p.requires_grad)
    print(f"{type(module).__name__} from {cfg.model}: {n:,} parameters, {k:,} trainable")
    dp = f" on each of {ranks.world} processes (rank {ranks.rank})" if ranks.world > 1 else ""
    print(f"{plan.total} steps of {plan.size} sequences ({c.microbatches * ranks.world} microbatches x "
          f"{cfg.micro_batch_size}), {c.options.gpus} workers{dp}, staleness {c.options.staleness}, plan "
          f"{c.plan.to_str()}" + (f"; resumed at step {c.steps}" if c.steps else ""))
