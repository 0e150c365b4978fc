"""Hugging Face model folders: load offline, check against the run, add LoRA adapters, export.

    >>> tok = load_tokenizer("path/to/Qwen3-1.7B"); check_model("path/to/Qwen3-1.7B", tok, seq=2048)  # doctest: +SKIP
    >>> model = load_model("path/to/Qwen3-1.7B", dtype=torch.bfloat16)        # doctest: +SKIP
    >>> peft_model = add_lora(model, rank=8)                                    # doctest: +SKIP
    >>> export(peft_model, tok, "out/", merge=True)                             # doctest: +SKIP

transformers and peft are imported inside the functions, so `rpcompile` imports
without them.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from rpcompile.models.model_config import read_model_config

__all__ = ["load_tokenizer", "check_model", "load_model", "add_lora", "trainable_module", "decay_parameters",
           "export", "TOKENIZER_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "tekken.json")  # any of these marks a folder that holds a tokenizer


def _first_line(exc: BaseException) -> str:
    """An exception's message on one line: its first line (transformers' messages run over many lines), and when
    that only introduces what follows (it ends with ":", as a config validator's does), the last line too,
    which names the field."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return f"{lines[0]} {lines[-1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def _check_folder(folder: str) -> None:
    """Raise FileNotFoundError unless `folder` is a local folder with a config.json."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"model folder {folder!r} does not exist (give a local save_pretrained folder)")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"model folder {folder!r} has no config.json (not a save_pretrained folder)")


def load_tokenizer(folder: str) -> Any:
    """`AutoTokenizer.from_pretrained(folder)`, offline.

    Raises:
        FileNotFoundError: no such folder, or no config.json in it.
        ValueError: the folder holds no tokenizer, or transformers cannot load it (its message, one line).

    Example:
        >>> load_tokenizer("tiny-llama/").eos_token   # doctest: +SKIP
        '</s>'
    """
    _check_folder(folder)
    if not any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        raise ValueError(f"model folder {folder!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                         f"save one beside the model with tokenizer.save_pretrained({folder!r})")
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - OSError, ValueError, a config validator's error...: one line
        _read_config(folder)  # the tokenizer reads config.json too: if that is what fails, say so
        raise ValueError(f"model folder {folder!r}: cannot load its tokenizer: {_first_line(exc)}") from None


def check_model(folder: str, tokenizer: Any, seq: int) -> Any:
    """Read the folder's config.json only; raise ValueError if `seq` or the tokenizer does not fit the model.

    Returns:
        The model's config (as saved: e.g. its `use_cache`, which training turns off).
    Raises:
        ValueError: config.json cannot be read or fails transformers' validation (one line naming the
            folder and the field), `seq` exceeds max_position_embeddings, or the tokenizer has more
            tokens than the model's vocabulary.

    Example:
        >>> check_model("tiny/", tok, seq=4096)   # doctest: +SKIP
        Traceback (most recent call last):
        ValueError: --seq 4096 is longer than the model's 64 positions (max_position_embeddings in tiny/config.json)
    """
    _check_folder(folder)
    config = _read_config(folder)
    text = getattr(config, "text_config", None) or config  # multimodal configs nest the language model's
    limit = getattr(text, "max_position_embeddings", None)
    if limit is not None and seq > limit:
        raise ValueError(f"--seq {seq} is longer than the model's {limit} positions "
                         f"(max_position_embeddings in {os.path.join(folder, 'config.json')})")
    vocab = getattr(text, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ValueError(f"the tokenizer in {folder!r} has {len(tokenizer)} tokens but the model's vocabulary "
                         f"only {vocab} (vocab_size in config.json): they do not belong together")
    return config


def _read_config(folder: str) -> Any:
    """`AutoConfig.from_pretrained(folder)`, offline; ValueError in one line naming the folder (and the field).

    The sizes are checked first (`rpcompile.models.model_config`): transformers takes a negative hidden size or
    0 heads and fails only when the model is built.
    """
    from transformers import AutoConfig
    read_model_config(os.path.join(folder, "config.json"))  # ValueError naming the file and the field
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - e.g. huggingface_hub's StrictDataclassClassValidationError
        raise ValueError(f"model folder {folder!r}: cannot read its config.json: {_first_line(exc)}") from None


def load_model(folder: str, *, dtype: torch.dtype | None = None) -> Any:
    """`AutoModelForCausalLM.from_pretrained(folder)`, offline, in train mode with `use_cache=False`.

    Args:
        folder: a local save_pretrained folder (config.json and the weights).
        dtype: the dtype to load the weights in (None: as saved).
    Raises:
        FileNotFoundError: no such folder, or no config.json in it.
        ValueError: transformers cannot load it as a causal LM (its message).

    Example:
        >>> type(load_model("tiny-llama/")).__name__   # doctest: +SKIP
        'LlamaForCausalLM'
    """
    _check_folder(folder)
    from transformers import AutoModelForCausalLM
    try:
        # the absolute path becomes the adapters' base_model_name_or_path: loadable from any folder
        model = AutoModelForCausalLM.from_pretrained(os.path.abspath(folder), local_files_only=True, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises for the folder: one line
        raise ValueError(f"model folder {folder!r}: cannot load it as a causal LM: {_first_line(exc)}") from None
    model.config.use_cache = False  # no KV cache while training (and none crosses a stage cut)
    return model.train()


def add_lora(model: Any, rank: int, *, alpha: float | None = None, targets: Sequence[str] | None = None,
             seed: int = 0) -> Any:
    """Wrap `model` in a peft LoRA model: the base frozen, rank-`rank` adapters on `targets` trainable.

    Args:
        model: a transformers causal LM.
        rank: the adapters' rank r.
        alpha: the scale numerator (scale = alpha / r); None: 2 * r.
        targets: module names to adapt (e.g. ["q_proj", "v_proj"], or ["all-linear"]); None: peft's
            default for the architecture.
        seed: seeds the adapters' initialisation.
    Returns:
        The `PeftModel`; compile `trainable_module(it)`.
    Raises:
        ImportError: peft is not installed.
        ValueError: peft's own complaint (e.g. no default targets for this architecture).

    Example:
        >>> pm = add_lora(model, 8, targets=["q_proj", "v_proj"]); pm.print_trainable_parameters()   # doctest: +SKIP
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("--lora needs peft: pip install peft") from None
    torch.manual_seed(seed)
    target = None if not targets else (targets[0] if list(targets) == ["all-linear"] else list(targets))
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank if alpha is None else alpha, target_modules=target,
                     lora_dropout=0.0, task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def trainable_module(model: Any) -> Any:
    """The module to compile: a peft model's base model (it carries the injected LoRA layers), else the model.

    Note:
        `PeftModel.forward(**kwargs)` hides the base model's signature from tracing;
        its base model holds the same parameters (LoRA layers replace the targets in place),
        so training it trains the peft model.
    """
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decay_parameters(model: Any) -> frozenset[str]:
    """The trainable parameters `transformers.Trainer` applies weight decay to, named as in `trainable_module(model)`.

    `Trainer.get_decay_parameter_names(model)` (no biases, no LayerNorm / RMSNorm weights) among the
    parameters that require grad, as Trainer's optimizer groups them; for a peft model (LoRA) its names
    (`base_model.model.`...) are mapped by identity to the compiled module's, so the adapters decay as
    Trainer would decay them. The set goes to `rpcompile.AdamW(decay=...)`.

    Args:
        model: the transformers model, or the peft model, that would be given to Trainer.
    Returns:
        Parameter names of `trainable_module(model)` (canonical: a tied parameter under its first name).

    Note:
        transformers' own rule is called (it changes between versions), without building a Trainer:
        `get_decay_parameter_names` reads only the model. Importing Trainer takes seconds, so a run
        without weight decay never calls this.

    Example:
        >>> sorted(decay_parameters(model))[:2]   # doctest: +SKIP
        ['lm_head.weight', 'model.embed_tokens.weight']
    """
    from transformers import Trainer
    names = set(Trainer.get_decay_parameter_names(object.__new__(Trainer), model))
    module = trainable_module(model)
    canonical = {id(p): n for n, p in module.named_parameters()}
    return frozenset(canonical[id(p)] for n, p in model.named_parameters() if n in names and p.requires_grad)


def export(model: Any, tokenizer: Any, out: str, *, merge: bool = False, use_cache: bool = True) -> None:
    """Write `model` and `tokenizer` to `out` with `save_pretrained`, loadable with `from_pretrained`.

    Args:
        model: the trained transformers model, or a peft model (its adapters are written, or the
            merged weights with `merge`).
        tokenizer: saved beside it.
        out: the folder (created if needed).
        merge: peft only: merge the adapters into the base (`merge_and_unload`) and write a plain
            model; the adapters themselves go to `out/adapter` (small, for PeftModel.from_pretrained).
        use_cache: the `use_cache` the exported config gets back (training turned it off).

    Example:
        >>> export(model, tok, "out/")   # doctest: +SKIP
        >>> from transformers import AutoModelForCausalLM
        >>> model = AutoModelForCausalLM.from_pretrained("out/")   # doctest: +SKIP
    """
    os.makedirs(out, exist_ok=True)
    if merge and hasattr(model, "merge_and_unload"):
        model.save_pretrained(os.path.join(out, "adapter"))
        model = model.merge_and_unload()
    trainable_module(model).config.use_cache = use_cache
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
