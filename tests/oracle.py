"""The staleness oracle of DESIGN.md idea 7, in plain eager PyTorch (a test helper).

    read = theta.copy()
    for batch in batches:
        g = grad(read, batch)
        next_read = theta.copy()
        theta = update(theta, g)
        read = next_read

generalised to any staleness s >= 0: iteration t reads theta_{max(0, t - s)},
where theta_k is the master after k updates (s = 0: synchronous; s = 1: RoundPipe).
"""
from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from rpcompile.ir.optim import SGD, AdamW


def eager_optimizer(config: AdamW | SGD, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """torch.optim.AdamW / SGD with `config`'s hyperparameters and torch's default (eager) kernel."""
    if isinstance(config, AdamW):
        return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, eps=config.eps,
                                 weight_decay=config.weight_decay)
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov,
                           weight_decay=config.weight_decay)


def reference_train(model: nn.Module, batches: Iterable[Any], *, optimizer: AdamW | SGD, staleness: int,
                    loss_fn: Callable[[nn.Module, Any], torch.Tensor], dtype: torch.dtype | None = None,
                    on_read: Callable[[int, nn.Module], None] | None = None
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train a copy of `model` with delayed weights, as RoundPipe with `staleness` must.

    Args:
        model: not modified; its deep copy (in fp32) is the master theta.
        batches: one batch per iteration.
        optimizer: `rpcompile.AdamW` / `rpcompile.SGD`; applied with the eager torch
            optimizer, clipping with `torch.nn.utils.clip_grad_norm_` if `max_grad_norm`.
        staleness: 0 (iteration t reads theta_t) or 1 (reads theta_{t-1}); any s >= 0 works.
        loss_fn: `loss_fn(read_model, batch) -> scalar loss`.
        dtype: cast the read copies to this dtype (the training dtype); None = fp32.
        on_read: called as `on_read(t, read_model)` before iteration t's forward.
    Returns:
        (losses, final_state_dict): per-iteration float losses and the master's
        `state_dict()` (cloned) after the last update.

    Example:
        >>> losses, sd = reference_train(model, batches, optimizer=rpcompile.SGD(lr=0.1),
        ...                              staleness=1, loss_fn=lambda m, b: m(*b))
        >>> len(losses) == len(batches)
        True
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    master = copy.deepcopy(model).float()
    trainable = [p for p in master.parameters() if p.requires_grad]
    opt = eager_optimizer(optimizer, trainable)

    def snapshot() -> nn.Module:
        read = copy.deepcopy(master)  # deepcopy keeps tied parameters tied
        return read if dtype is None else read.to(dtype)

    versions: deque[nn.Module] = deque([snapshot()], maxlen=staleness + 1)
    losses: list[float] = []
    for t, batch in enumerate(batches):
        read = versions[0]  # theta_{max(0, t - staleness)}
        if on_read is not None:
            on_read(t, read)
        read.zero_grad(set_to_none=True)
        loss = loss_fn(read, batch)
        loss.backward()
        losses.append(float(loss.detach()))
        for pm, pr in zip(master.parameters(), read.parameters()):
            pm.grad = None if pr.grad is None else pr.grad.detach().to(torch.float32, copy=True)
        read.zero_grad(set_to_none=True)
        if optimizer.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(trainable, optimizer.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        versions.append(snapshot())
    return losses, {k: v.detach().clone() for k, v in master.state_dict().items()}


def token_mean_loss(model: nn.Module, batch: dict, ignore_index: int = -100) -> torch.Tensor:
    """sum(token NLL over trained targets) / their number, from a causal LM's logits (loss_mean="tokens").

    The targets are the shifted labels that are not `ignore_index`, as transformers counts them;
    computed directly with `cross_entropy(reduction="sum")` on the shifted logits, not via the model's loss.

    Example:
        >>> loss = token_mean_loss(llama(), {"input_ids": ids, "labels": labels})   # doctest: +SKIP
    """
    logits = model(input_ids=batch["input_ids"]).logits
    shift_logits, shift_labels = logits[:, :-1].float(), batch["labels"][:, 1:]
    nll = torch.nn.functional.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]),
                                            shift_labels.reshape(-1), ignore_index=ignore_index, reduction="sum")
    return nll / (shift_labels != ignore_index).sum()
