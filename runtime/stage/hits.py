"""Evaluation's token accuracy: the loss layer run so that it also counts its right next-token predictions
(TRL's mean_token_accuracy), for an unsharded cross-entropy and for the sharded LM head alike."""
from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from rpcompile.passes.shard_head.chunked import lse_loss

__all__ = ["HITS", "CountHits"]


HITS = "<token hits>"  # env key of evaluation's (right, counted) predictions (`LayerRunner.run_layer`)


_CE = inspect.signature(F.cross_entropy)


class CountHits(torch.nn.Module):
    """A layer run through an fx Interpreter that notes (right, counted) targets of each cross-entropy it computes.

    A target counts unless it is the ignore_index; it is right where the logits' argmax is the target:
    `F.cross_entropy` / `nn.CrossEntropyLoss` read the argmax of their input, `lse_loss` (the sharded
    head, whose logits never exist whole) has the target logit equal the running max. The same ops run
    in the same order as the layer's own forward, so the loss is the same bits.
    """

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer, self.hits = layer, []

    def forward(self, *args: Any) -> Any:
        return _HitInterpreter(self.layer, self.hits).run(*args)


class _HitInterpreter(fx.Interpreter):
    """`CountHits`'s interpreter: each call of a cross-entropy appends a (right, counted) tensor to `hits`."""

    def __init__(self, gm: fx.GraphModule, hits: list) -> None:
        super().__init__(gm)
        self.found = hits

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        out = super().call_function(target, args, kwargs)
        if target is F.cross_entropy:
            a = _CE.bind(*args, **kwargs).arguments
            self.found.append(_right(a["input"], a["target"], a.get("ignore_index", -100)))
        elif target is lse_loss:
            m, _, t, tgt, ignore = args[:5]
            keep = tgt != ignore
            self.found.append(torch.stack([((t >= m) & keep).sum(), keep.sum()]))
        return out

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        out = super().call_module(target, args, kwargs)
        mod = self.fetch_attr(target)
        if isinstance(mod, torch.nn.CrossEntropyLoss):
            self.found.append(_right(args[0], args[1], mod.ignore_index))
        return out


def _right(logits: torch.Tensor, target: torch.Tensor, ignore: int) -> torch.Tensor:
    """(targets where the argmax over the class dim is right, targets counted); ignore_index left out."""
    keep = target != ignore
    pred = logits.detach().argmax(1 if logits.dim() > 1 else 0)
    return torch.stack([((pred == target) & keep).sum(), keep.sum()])
