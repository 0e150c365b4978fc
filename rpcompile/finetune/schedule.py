"""Learning-rate schedules: linear warmup, then cosine, linear or constant, as a pure function of the step.

The same numbers as `transformers.get_scheduler(kind, optimizer, num_warmup_steps=warmup,
num_training_steps=total)` (what `Trainer` uses), step for step: optimizer step k (from 0) gets
lr * k / warmup while k < warmup, so the first update of a warmed-up run uses 0; "constant" is
transformers' "constant_with_warmup".

    >>> [round(lr_at(s, lr=1.0, total=6, warmup=2, kind="linear"), 3) for s in range(6)]
    [0.0, 0.5, 1.0, 0.75, 0.5, 0.25]

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

__all__ = ["SCHEDULES", "lr_at", "lr_factor"]

SCHEDULES = ("cosine", "linear", "constant")  # what follows the warmup


def lr_factor(step: int, *, total: int, warmup: int = 0, kind: str = "cosine") -> float:
    """The multiplier of the peak lr at `step`: transformers' lr lambda of `kind`, computed as it does.

    >>> lr_factor(1, total=10, warmup=4)
    0.25
    """
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if kind == "constant":
        return 1.0
    if kind == "linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))  # 0 at the first step after the warmup
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def lr_at(step: int, *, lr: float, total: int, warmup: int = 0, kind: str = "cosine") -> float:
    """The learning rate of the update made from step `step`'s gradient (see the module Note).

    Args:
        step: the step, 0 .. total-1.
        lr: the peak learning rate (reached at the first step after the warmup).
        total: the run's steps.
        warmup: linear warmup steps: step s < warmup gets lr * s / warmup (0 for the first).
        kind: after the warmup, "cosine" (from lr down towards 0 at `total`), "linear"
            (likewise, a straight line) or "constant".
    Returns:
        lr * `lr_factor(step)`: what `transformers.get_scheduler(kind, ...)` sets for that step
        (> 0 for every step in [warmup, total) when lr > 0).
    Raises:
        ValueError: an unknown `kind`, a negative `warmup` or `lr`, or `total` < 1.

    Example:
        >>> lr_at(1, lr=1e-3, total=100, warmup=10)
        0.0001
    """
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}")
    if warmup < 0 or total < 1 or not lr >= 0:
        raise ValueError(f"need warmup >= 0, total >= 1 and lr >= 0; got warmup={warmup}, total={total}, lr={lr}")
    return lr * lr_factor(step, total=total, warmup=warmup, kind=kind)
