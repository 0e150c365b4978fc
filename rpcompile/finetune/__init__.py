"""The fine-tuning library: a Hugging Face model folder + a data file -> a trained model folder.

The fifth layer of the package, beside `rpcompile.models` (ir < passes < runtime < driver < models,
finetune < cli): built on the driver (`rpcompile.compile`), used by the command line
(`python -m rpcompile finetune`, `rpcompile.cli.finetune` turns its flags into a `FinetuneConfig`).

    >>> import rpcompile
    >>> from rpcompile.finetune import FinetuneConfig, finetune
    >>> result = finetune(FinetuneConfig(model="tiny/", data="train.jsonl", out="tuned/", steps=30))  # doctest: +SKIP
    >>> result = rpcompile.finetune(FinetuneConfig(...))   # the same call: this package is callable  # doctest: +SKIP

What it holds, in the order a run uses it:

    config.py            `FinetuneConfig` (one field per flag), `FinetuneResult`, the settings' check
    config_file.py       read a .json/.yaml config file or a run record into those settings
    data/                a data file -> documents -> token cache -> packed batches (`prepare`)
    hf.py                model folders: load offline, add LoRA (peft), Trainer's weight-decay groups, export
    packed_attention.py  attention that stops at packed-document boundaries, memory linear in S
    neftune.py           NEFTune: seeded uniform noise on the input embeddings in training steps
    preflight.py         the checks a run passes before any weight loads (model on `meta`, planned, sized)
    schedule.py          learning rates: warmup, then cosine / linear / constant (transformers' get_scheduler)
    out.py               the output folder: what a run writes and refuses, the run record, resume checks
    loop.py              the steps: schedule, metrics, checkpoints, eval (loss, token accuracy), OOM and Ctrl-C
    metrics.py           OUT/metrics.jsonl and TensorBoard
    dist.py              torchrun data parallelism: ranks, each rank's share, rank 0 writes
    run.py               `finetune(config)`: all of the above in one run

Importing this package imports neither transformers nor peft nor tqdm.
"""
import sys
import types

from rpcompile.finetune.config import FinetuneConfig, FinetuneResult
from rpcompile.finetune.data import prepare, read_documents, read_template
from rpcompile.finetune.hf import add_lora, decay_parameters, export, load_model, load_tokenizer, trainable_module
from rpcompile.finetune.loop import StepFailed, StepOutOfMemory
from rpcompile.finetune.neftune import add_neftune, remove_neftune
from rpcompile.finetune.packed_attention import use_packed_attention
from rpcompile.finetune.run import finetune
from rpcompile.finetune.schedule import lr_at

__all__ = ["FinetuneConfig", "FinetuneResult", "finetune", "prepare", "read_documents", "read_template", "load_model",
           "load_tokenizer", "add_lora", "trainable_module", "decay_parameters", "export", "use_packed_attention",
           "add_neftune", "remove_neftune", "lr_at", "StepOutOfMemory", "StepFailed"]


class _FinetunePackage(types.ModuleType):
    """This package, callable: `rpcompile.finetune(config)` is `rpcompile.finetune.finetune(config)`."""

    def __call__(self, cfg: FinetuneConfig, **kwargs) -> FinetuneResult:
        return finetune(cfg, **kwargs)


sys.modules[__name__].__class__ = _FinetunePackage
