"""A model's config.json, read and checked before transformers builds anything from it.

`python -m rpcompile plan --model config.json` and `python -m rpcompile finetune --model DIR` read the
same fields of a Hugging Face config: the sizes below. transformers accepts many bad values (a negative
hidden size, 0 attention heads) and fails later, deep inside a layer's constructor; here each is one
ValueError naming the file and the field.

    >>> check_model_config({"hidden_size": -64}, "m/config.json")
    Traceback (most recent call last):
    ValueError: m/config.json: hidden_size must be a positive integer, got -64

A field that is absent keeps transformers' default; a multimodal config's `text_config` (the language
model's) is checked the same way.
"""
from __future__ import annotations

import json
from typing import Any

__all__ = ["read_model_config", "check_model_config", "SIZES", "OPTIONAL_SIZES"]

SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
         "max_position_embeddings")  # positive integers where present
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim")  # positive integers, or null (transformers derives them)
LARGEST = 2**31 - 1  # the largest size taken: what an int32 holds


def read_model_config(path: str) -> dict[str, Any]:
    """The JSON object in `path`, checked by `check_model_config`; ValueError naming the file (and line or field)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    check_model_config(raw, path)
    return raw


def check_model_config(raw: Any, source: str) -> None:
    """Raise ValueError naming `source` and the first field of `raw` (a parsed config.json) that cannot build a model.

    Checked: `raw` is an object; `SIZES` and `OPTIONAL_SIZES` are integers from 1 to 2**31 - 1 (the optional ones
    may be null); the attention heads are a multiple of the key/value heads; without a head_dim, the hidden size
    is a multiple of the heads.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: a model config is a JSON object of fields, got a {type(raw).__name__}")
    sections = [(raw, "")]
    if isinstance(raw.get("text_config"), dict):
        sections.append((raw["text_config"], "text_config."))
    for cfg, prefix in sections:
        for key in SIZES + OPTIONAL_SIZES:
            value = cfg.get(key)
            if key not in cfg or value is None and key in OPTIONAL_SIZES:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= LARGEST:
                null = " or null" if key in OPTIONAL_SIZES else ""
                raise ValueError(f"{source}: {prefix}{key} must be a positive integer{null}, got {value!r}")
        _check_shapes(cfg, source, prefix)


def _check_shapes(cfg: dict, source: str, prefix: str) -> None:
    """The fields that must divide each other (sizes already checked)."""
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ValueError(f"{source}: {prefix}num_attention_heads ({heads}) must be a multiple of "
                         f"{prefix}num_key_value_heads ({kv})")
    hidden = cfg.get("hidden_size")
    if heads and hidden and cfg.get("head_dim") is None and hidden % heads:
        raise ValueError(f"{source}: {prefix}hidden_size ({hidden}) must be a multiple of {prefix}num_attention_heads "
                         f"({heads}) when there is no head_dim")
