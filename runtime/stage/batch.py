"""A step's batch as microbatches: split along the batch dimension, and each microbatch's trained tokens and
weight when a step's loss is the mean over its trained tokens (`loss_mean="tokens"`, DESIGN.md 3c)."""
from __future__ import annotations

from typing import Any

import torch

from rpcompile.ir.graph import LayerGraph

__all__ = ["split_batch", "trained_tokens", "token_weights"]


def split_batch(graph: LayerGraph, batch: Any, microbatches: int) -> list[dict[str, torch.Tensor]]:
    """The batch's named inputs cut into `microbatches` equal slices along each input's batch dim.

    Inputs with `batch_dim` None are shared by every microbatch.

    Raises:
        ValueError: an input's batch size is not divisible by `microbatches` (names it).
    """
    inputs = graph.flatten_inputs(batch)
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(microbatches)]
    for name, t in inputs.items():
        bd = graph.values[name].batch_dim if name in graph.values else 0
        if bd is None or t.dim() == 0:
            parts = [t] * microbatches
        else:
            if t.shape[bd] % microbatches:
                raise ValueError(f"input {name!r} has batch size {t.shape[bd]}, not divisible into "
                                 f"{microbatches} microbatches")
            parts = list(t.tensor_split(microbatches, dim=bd))
        for m in range(microbatches):
            out[m][name] = parts[m].contiguous()
    return out


def trained_tokens(graph: LayerGraph, batch: Any, microbatches: int, ignore_index: int = -100) -> list[int]:
    """Per microbatch, the targets its loss averages over: shifted `labels` that are not `ignore_index`.

    As transformers' causal LMs count them (`(labels[..., 1:] != -100).sum()`); the microbatches are cut
    as `split_batch` cuts them.

        >>> trained_tokens(graph, {"input_ids": ids, "labels": torch.tensor([[5, 6, 7], [5, -100, -100]])}, 2)  # doctest: +SKIP
        [2, 0]

    Raises:
        ValueError: the batch is not a dict with a `labels` tensor.
    """
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"loss_mean='tokens' needs the batch to be a dict with a `labels` tensor (the model's "
                         f"targets, -100 where nothing is trained); got "
                         f"{'a dict without labels' if isinstance(batch, dict) else type(batch).__name__}")
    v = graph.values.get("labels") if "labels" in graph.inputs else None
    bd = 0 if v is None or v.batch_dim is None else v.batch_dim
    if labels.dim() == 0 or labels.shape[bd] % microbatches:
        raise ValueError(f"input 'labels' of shape {tuple(labels.shape)} does not split into {microbatches} "
                         f"microbatches")
    return [int((part[..., 1:] != ignore_index).sum()) for part in labels.tensor_split(microbatches, dim=bd)]


def token_weights(counts: list[int], total: int, world: int = 1) -> list[float]:
    """Each microbatch's factor in the step's loss: world * n_m / N (N: the step's trained tokens, all ranks).

    The world factor undoes the data-parallel average of gradients and losses over `world` ranks, so
    their mean is sum(NLL) / N over every rank's tokens.

        >>> token_weights([3, 1], 4), token_weights([3, 0], 6, world=2)
        ([0.75, 0.25], [1.0, 0.0])
    """
    if total <= 0:
        raise ValueError("loss_mean='tokens': the step has no trained token (every shifted label is -100), so "
                         "its loss is 0/0; drop the batch or train on some of its labels")
    return [world * n / total for n in counts]
