"""Host memory of a training run: what `runtime.optimizer.HostState` and the activation store hold.

All model state lives in host memory (DESIGN.md idea 1), so a run that does
not fit the host must be refused before it starts, with the bytes named:

    >>> import torch
    >>> need = host_bytes(torch.nn.Linear(1024, 1024), microbatches=4, staleness=1, dtype=torch.bfloat16)
    >>> need.weights, need.masters, need.grads, need.optimizer, need.activations
    (2099200, 4198400, 4198400, 8396800, 0)
    >>> check_host_memory(torch.nn.Linear(1024, 1024), microbatches=4, dtype=torch.bfloat16, limit=2**20)
    Traceback (most recent call last):
    ...
    ValueError: host memory: the run needs 18.0 MiB (18892800 bytes: weights 2.0 MiB, fp32 masters 4.0 MiB, ...

Note: what counts. Every parameter has a compute copy in the training dtype
(its own dtype when the run keeps the model's), frozen ones included and
nothing else for them. A trainable parameter (requires_grad, used by some
layer) adds an fp32 master, an fp32 gradient buffer and the optimizer state:
AdamW two fp32 moments, SGD one fp32 momentum buffer when momentum > 0. The
activations are the saved stage inputs the host keeps for the backward stages
to recompute from (`passes._seqlen.round_saved_bytes`, the rule `max_seq_len`
uses too): iterations run in rounds of R microbatches and a round's inputs live
from its forward to its backward, so R microbatches hold every backward stage's
input; the rotation has no drain (the next round, with staleness 1 also the
next iteration's first, starts on a worker as soon as it is free), so the last
N - 1 backward stages of the previous round still hold theirs and count once
more. An estimate for admission, not an
allocator trace: pinned staging buffers and Python overheads are left out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_ADAM_MOMENTS = 2  # fp32 moments per trainable element (exp_avg, exp_avg_sq)


@dataclass(frozen=True, slots=True)
class HostBytes:
    """Host bytes of a run, by category (see the module Note)."""

    weights: int       # compute copies of every parameter (training dtype)
    masters: int       # fp32 masters of the trainable parameters
    grads: int         # fp32 gradient buffers of the trainable parameters
    optimizer: int     # optimizer state of the trainable parameters
    activations: int   # saved inputs of the backward stages for the microbatches in flight (0 before a plan)
    in_flight: int     # microbatches per round R whose saved inputs are on the host (0 before a plan)

    @property
    def total(self) -> int:
        """All of it, in bytes."""
        return self.weights + self.masters + self.grads + self.optimizer + self.activations

    def __str__(self) -> str:
        parts = [f"weights {_gib(self.weights)}", f"fp32 masters {_gib(self.masters)}",
                 f"gradients {_gib(self.grads)}", f"optimizer state {_gib(self.optimizer)}"]
        if self.in_flight:
            parts.append(f"saved activations {_gib(self.activations)} for {self.in_flight} microbatches per round "
                         f"(+ the previous round's last stages)")
        return f"{_gib(self.total)} ({self.total} bytes: {', '.join(parts)})"


def host_bytes(model: Any, costs: Any = None, plan: Any = None, *, microbatches: int, staleness: int = 1,
               optimizer: Any = None, dtype: Any = None, gpus: int | None = None,
               round_size: int | None = None) -> HostBytes:
    """Host bytes a run needs, by category.

    Args:
        model: a traced `LayerGraph` (its canonical parameters; one no layer uses counts as frozen, as in
            HostState) or an `nn.Module` (every parameter, e.g. on the meta device before tracing).
        costs, plan: the CostTable and StagePlan; without them the activations count 0.
        microbatches: M per iteration.
        staleness: 0 or 1 (the rule above holds for both; kept for the callers' symmetry).
        optimizer: `rpcompile.AdamW` (default) or `rpcompile.SGD`.
        dtype: training dtype of the compute copies; None keeps each parameter's own.
        gpus: workers N; needed with a plan.
        round_size: microbatches per round R (default `default_round_size(N, M)`).
    Returns:
        A HostBytes; `str()` of it lists the categories.

    >>> import torch
    >>> frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    >>> host_bytes(frozen, microbatches=1).total   # compute copies only: 20 fp32 elements
    80
    """
    import torch
    from rpcompile.optim import SGD
    state = 0 if isinstance(optimizer, SGD) and optimizer.momentum == 0 else 1 if isinstance(optimizer, SGD) \
        else _ADAM_MOMENTS
    weights = trainable = 0
    for numel, own, train in _parameters(model):
        weights += numel * (dtype or own).itemsize
        trainable += numel if train else 0
    fp32 = torch.float32.itemsize
    saved = in_flight = 0
    if plan is not None:
        if gpus is None:
            raise ValueError("host_bytes: gpus is needed with a plan (the rounds' saved inputs depend on it)")
        from rpcompile.passes._seqlen import round_saved_bytes
        saved, in_flight = round_saved_bytes(list(costs.saved_bytes), plan, gpus, microbatches, round_size)
    return HostBytes(weights, trainable * fp32, trainable * fp32, trainable * fp32 * state, saved, in_flight)


def check_host_memory(model: Any, costs: Any = None, plan: Any = None, *, microbatches: int, staleness: int = 1,
                      optimizer: Any = None, dtype: Any = None, hardware: Any = None,
                      limit: int | None = None, gpus: int | None = None,
                      round_size: int | None = None) -> HostBytes:
    """`host_bytes` of the run, raising unless it fits the host; returns it when it does.

    Args:
        model, costs, plan, microbatches, staleness, optimizer, dtype, gpus, round_size: as for `host_bytes`.
        hardware: the target `Hardware`; its `host_memory` is the limit.
        limit: host bytes available, overriding the hardware's; with neither, this machine's physical RAM.
    Raises:
        ValueError: one line naming the bytes by category, the limit, and what to change.

    >>> import torch
    >>> check_host_memory(torch.nn.Linear(2, 2), microbatches=1, limit=2**20).total  # 6 fp32 elements x 20 B
    120
    """
    need = host_bytes(model, costs, plan, microbatches=microbatches, staleness=staleness, optimizer=optimizer,
                      dtype=dtype, gpus=gpus, round_size=round_size)
    if limit is not None:
        name = "the host memory limit"
    elif hardware is not None:
        limit, name = hardware.host_memory, f"the {hardware.name} host memory"
    else:
        from rpcompile.hardware import _host_memory
        limit, name = _host_memory(), "this machine's RAM"
    if need.total <= limit:
        return need
    lora = "freeze the base model and train adapters (LoRA; `plan --frozen-base` estimates that)"
    if need.in_flight:
        fix = f"{lora} or put fewer microbatches in flight (smaller rounds: fewer microbatches per iteration)"
    else:
        fix = f"the parameters' state alone is over, before any saved activations: {lora}"
    raise ValueError(f"host memory: the run needs {need} but {name} is {_gib(limit)} ({limit} bytes); {fix}")


def _parameters(model: Any):
    """(elements, dtype, trainable) per parameter of a LayerGraph or an nn.Module."""
    if hasattr(model, "param_owners"):
        owners = model.param_owners()
        for name, v in model.params.items():
            yield v.bytes // max(v.dtype.itemsize, 1), v.dtype, bool(v.requires_grad and owners.get(name))
    else:
        for p in model.parameters():
            yield p.numel(), p.dtype, p.requires_grad


def _gib(n: int) -> str:
    """Bytes in GiB (MiB below 1 GiB), one decimal."""
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"
