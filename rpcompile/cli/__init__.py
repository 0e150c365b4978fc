"""User-facing commands, one module per command (DESIGN.md section 2).

    finetune.py       `python -m rpcompile finetune`: a Hugging Face model folder + a data file -> a trained folder
    finetune_args.py  its command-line options (argparse, no heavy imports)
    data.py           read .txt / .jsonl documents, tokenize, pack into fixed-length sequences
    schedule.py       warmup + cosine / linear / constant learning rates
    hf.py             load a model folder offline, add LoRA (peft), export with save_pretrained

    >>> from rpcompile.cli import FinetuneConfig, finetune
    >>> finetune(FinetuneConfig(model="tiny/", data="train.jsonl", out="tuned/", steps=30))   # doctest: +SKIP

Importing this package imports neither transformers nor peft nor tqdm.
"""
from rpcompile.cli.finetune import FinetuneConfig, FinetuneResult, finetune

__all__ = ["FinetuneConfig", "FinetuneResult", "finetune"]
