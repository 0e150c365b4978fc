"""Learning-rate schedules: linear warmup, then cosine, linear or constant, as a pure function of the step.

    >>> [round(lr_at(s, lr=1.0, total=6, warmup=2, kind="linear"), 3) for s in range(6)]
    [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]

Note:
    Which update an lr belongs to. `lr_at(t, ...)` is the learning rate of the
    optimizer update made from step t's gradient (t counts from 0); the
    fine-tuning loop sets it (`Compiled.set_lr`) just before `step(batch_t)`.
    With staleness 0 that update gives the weights step t+1 reads. With
    staleness 1 (RoundPipe) the CPU applies it while step t+1 computes, so step
    t+1 reads the weights made with lr_at(t-1) and lr_at(t) first shows in step
    t+2's weights: the schedule is the same, the weights it shapes lag one step.
"""
from __future__ import annotations

import math

__all__ = ["SCHEDULES", "lr_at"]

SCHEDULES = ("cosine", "linear", "constant")  # what follows the warmup


def lr_at(step: int, *, lr: float, total: int, warmup: int = 0, kind: str = "cosine") -> float:
    """The learning rate of the update made from step `step`'s gradient (see the module Note).

    Args:
        step: the step, 0 .. total-1.
        lr: the peak learning rate (reached at the last warmup step).
        total: the run's steps.
        warmup: linear warmup steps: step s < warmup gets lr * (s + 1) / warmup.
        kind: after the warmup, "cosine" (from lr down towards 0 at `total`), "linear"
            (likewise, a straight line) or "constant".
    Returns:
        The learning rate (> 0 for every step < total when lr > 0).
    Raises:
        ValueError: an unknown `kind`, a negative `warmup` or `lr`, or `total` < 1.

    Example:
        >>> lr_at(0, lr=1e-3, total=100, warmup=10)
        0.0001
    """
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}")
    if warmup < 0 or total < 1 or not lr >= 0:
        raise ValueError(f"need warmup >= 0, total >= 1 and lr >= 0; got warmup={warmup}, total={total}, lr={lr}")
    if step < warmup:
        return lr * (step + 1) / warmup
    if kind == "constant":
        return lr
    progress = (step - warmup) / max(1, total - warmup)  # 0 at the first step after warmup, < 1 at the last
    if kind == "linear":
        return lr * (1.0 - progress)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))
