"""Batch checks done before any worker starts: size, keys, dtypes.

    >>> import torch
    >>> batch_size({"input_ids": torch.zeros(8, 4, dtype=torch.long)})
    8
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
