"""Batch checks done before any worker starts: size, keys, dtypes; and a batch's signature.

    >>> import torch
    >>> batch_size({"input_ids": torch.zeros(8, 4, dtype=torch.long)})
    8
    >>> signature({"input_ids": torch.zeros(8, 4, dtype=torch.long), "attention_mask": None})
    (('input_ids', (8, 4)),)
    >>> check_batch(torch.zeros(6, 2), 4)
    Traceback (most recent call last):
    ValueError: batch size 6 (value 'x') is not divisible by 4 microbatches
"""
from __future__ import annotations

from typing import Any

import torch


def _items(batch: Any) -> list[tuple[str, Any]]:
    """The batch's (name, value) pairs, named as the trace names model inputs."""
    if isinstance(batch, torch.Tensor):
        return [("x", batch)]
    if isinstance(batch, dict):
        return list(batch.items())
    if isinstance(batch, (tuple, list)):
        return [(f"arg{i}", v) for i, v in enumerate(batch)]
    raise ValueError(f"a batch must be a tensor, a tuple or a dict of tensors, got {type(batch).__name__}")


def batch_size(batch: Any) -> int:
    """Size of dim 0 of the batch's first tensor."""
    for name, v in _items(batch):
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.shape[0]
    raise ValueError("the batch holds no tensor with a batch dimension")


def signature(batch: Any) -> tuple:
    """What a compiled program depends on in a batch besides dtypes: the inputs present, and tensor shapes.

    A value that is None counts as absent (an optional argument left at its default). A tensor
    contributes its shape; any other value only its presence (the trace keeps it as a constant).
    Two batches with the same signature run the same program; `Compiled.step` plans another for a
    new one.
    """
    return tuple(sorted((name, tuple(v.shape) if isinstance(v, torch.Tensor) else "constant")
                        for name, v in _items(batch) if v is not None))


def describe_change(old: tuple, new: tuple) -> str:
    """How signature `new` differs from `old`, for a log line: "+attention_mask", "input_ids (4, 8) -> (4, 16)".

    >>> describe_change((("ids", (4, 8)),), (("ids", (4, 16)), ("mask", (4, 16))))
    '+mask, ids (4, 8) -> (4, 16)'
    """
    a, b = dict(old), dict(new)
    return ", ".join([*(f"+{k}" for k in b if k not in a), *(f"-{k}" for k in a if k not in b),
                      *(f"{k} {a[k]} -> {b[k]}" for k in b if k in a and a[k] != b[k])])


def check_batch(batch: Any, microbatches: int, *, like: Any = None) -> None:
    """Raise ValueError naming the value unless `batch` splits into `microbatches` and matches `like`.

    Args:
        batch: a tensor, tuple or dict of tensors (batch along dim 0).
        microbatches: the number of microbatches it must split into.
        like: a traced LayerGraph whose model inputs the batch must provide, with the same dtypes.
    """
    items = _items(batch)
    for name, v in items:
        if not isinstance(v, torch.Tensor):
            continue
        if v.dim() == 0 or v.shape[0] % microbatches:
            n = "a scalar" if v.dim() == 0 else v.shape[0]
            raise ValueError(f"batch size {n} (value {name!r}) is not divisible by {microbatches} microbatches")
    if like is None:
        return
    got = dict(items)
    for name in like.inputs:
        want = like.values[name]
        if name not in got:
            raise ValueError(f"the batch is missing {name!r} (the model was compiled with inputs "
                             f"{list(like.inputs)})")
        v = got[name]
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"batch value {name!r} must be a tensor, got {type(v).__name__}")
        if v.dtype != want.dtype:
            raise ValueError(f"batch value {name!r} has dtype {v.dtype}, the model was compiled with {want.dtype}")
