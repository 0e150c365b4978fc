"""User-facing commands, one module per command (DESIGN.md section 2).

    finetune.py       `python -m rpcompile finetune`: a Hugging Face model folder + a data file -> a trained folder
    finetune_config.py  its settings (FinetuneConfig) and their check; run_config.py: --config FILE
    finetune_args.py  its command-line options (argparse, no heavy imports)
    finetune_out.py   its output folder: what a run writes and refuses, the run record, resume checks
    finetune_loop.py  its steps: schedule, metrics, checkpoints, eval, out-of-memory and Ctrl-C
    finetune_dist.py  torchrun data parallelism: ranks, each rank's share, rank 0 writes
    metrics.py        OUT/metrics.jsonl and TensorBoard; preflight.py: the model on meta, planned and sized
    data.py           read .txt / .jsonl documents (rows.py: a row as a Document), prepare(): token cache + packing
    token_cache.py    the memory-mapped token cache (encoding.py: labels and the tokenizer's fingerprint)
    packing.py        packed sequences as a layout over the cache (layout.py), batches built on demand
    schedule.py       warmup + cosine / linear / constant learning rates
    hf.py             load a model folder offline, add LoRA (peft), export with save_pretrained

    >>> from rpcompile.cli import FinetuneConfig, finetune
    >>> finetune(FinetuneConfig(model="tiny/", data="train.jsonl", out="tuned/", steps=30))   # doctest: +SKIP

Importing this package imports neither transformers nor peft nor tqdm.
"""
from rpcompile.cli.finetune import FinetuneConfig, FinetuneResult, finetune

__all__ = ["FinetuneConfig", "FinetuneResult", "finetune"]
