"""compile()'s options: one frozen dataclass, and the checks that turn user input into it.

Every bad value is a `ValueError` that names the argument, raised before any
tracing or measuring starts.

    >>> options(gpus=2, staleness=1, dtype="bf16").dtype
    torch.bfloat16
    >>> options(gpus=True)
    Traceback (most recent call last):
    ValueError: gpus must be a positive int (workers), got True (bool)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from rpcompile.ir.hardware import Hardware
from rpcompile.machine import hardware_of
from rpcompile.runtime.streams.host import DEADLINE_MAX_S
from rpcompile.ir.optim import SGD, AdamW, DynamicLossScale

__all__ = ["Options", "options", "default_microbatches", "parse_dtype", "check_model", "check_timeout"]

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
          "fp64": torch.float64, "float64": torch.float64, "double": torch.float64}
BACKENDS = ("auto", "host", "cuda")
ON_NONFINITE = ("raise", "skip")
LOSS_MEANS = ("microbatch", "tokens")


@dataclass(frozen=True, slots=True)
class Options:
    """Everything compile() was asked for, so a re-plan can repeat it."""

    gpus: int                                  # workers N (GPUs, or host workers without CUDA)
    microbatches: int | None                   # M per iteration; None: smallest divisor of the batch >= gpus
    staleness: int                             # 0 synchronous, 1 RoundPipe (optimizer one step behind)
    optimizer: AdamW | SGD                     # CPU optimizer config
    dtype: torch.dtype | None                  # training dtype of compute copies; None keeps the model's
    loss_fn: Callable | None                   # loss_fn(output, example) when the model does not return its loss
    layers: Sequence[str] | None               # layer patterns overriding detection
    lm_head_shards: int | str                  # vocabulary shards of the LM head ("auto" from costs)
    hardware: Hardware | None                  # target for predicted costs and the memory budget
    memory_budget: int | None                  # device bytes per worker; None: 90% of hardware memory
    backend: str                               # runtime backend: "auto", "host" or "cuda"
    seed: int                                  # base seed of per-(iteration, microbatch, layer) randomness
    on_nonfinite: str = "raise"                # a NaN/inf loss or gradient: "raise" FloatingPointError, or "skip"
    loss_scale: float | DynamicLossScale | None = None  # None: off; a constant; DynamicLossScale (fp16)
    loss_mean: str = "microbatch"              # a step's loss: "microbatch" (mean of the microbatch losses) or
                                               # "tokens" (sum of token NLLs / trained tokens; needs `labels`)
    fp16_accumulation: bool = False            # fp16 GEMMs accumulate in fp16 on CUDA workers (and are priced
                                               # so); needs dtype fp16; no effect on host workers
    fused_head: bool = False                   # the LM head takes its gradients in its forward, chunk by chunk
                                               # (`passes.shard_head.fused`): no recompute of the logits
    timeout: float | None = None               # seconds a runtime wait may last before it fails as a hang;
                                               # None: from the plan (`runtime.transfer.plan_deadline`, >= 10 min)
    shard: tuple[int, int] | None = None       # (rank, world): this process's share of the masters and moments,
                                               # sharded over world data-parallel servers, is what the host-memory
                                               # admission counts (`rpcompile.hostmem`); None: the whole state


def default_microbatches(batch: int, gpus: int) -> int:
    """The smallest divisor of the batch size that is >= gpus (the batch size itself if none)."""
    for m in range(min(gpus, batch), batch + 1):
        if batch % m == 0 and m >= min(gpus, batch):
            return m
    return batch


def _positive_int(name: str, v: Any, what: str, allow_none: bool = False) -> None:
    if allow_none and v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int ({what}), got {v!r} ({type(v).__name__})")


def parse_dtype(dtype: Any) -> torch.dtype | None:
    """None, a floating torch dtype, or a name such as "bf16" / "bfloat16" -> the torch dtype.

    Raises:
        ValueError: naming `dtype` and what is accepted.
    """
    if dtype is None:
        return None
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not a floating dtype name; use one of {sorted(DTYPES)}")
        return DTYPES[key]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype (e.g. torch.bfloat16) or a name like 'bf16', "
                         f"got {dtype!r}")
    return dtype


def _optimizer(opt: Any) -> AdamW | SGD:
    if opt is None:
        return AdamW(lr=1e-4)
    if isinstance(opt, (AdamW, SGD)):
        return opt
    cls = opt if isinstance(opt, type) else type(opt)
    if issubclass(cls, torch.optim.Optimizer):
        match = "rpcompile.SGD" if issubclass(cls, torch.optim.SGD) else "rpcompile.AdamW"
        raise ValueError(f"optimizer must be an rpcompile optimizer config, got {cls.__module__}.{cls.__name__}: "
                         f"rpcompile runs its own CPU optimizer on the host-resident masters; pass {match}(lr=...)")
    raise ValueError(f"optimizer must be rpcompile.AdamW(...) or rpcompile.SGD(...), got {type(opt).__name__}")


def options(*, gpus: Any, microbatches: Any = None, staleness: Any = 1, optimizer: Any = None, dtype: Any = None,
            loss_fn: Callable | None = None, layers: Sequence[str] | None = None, lm_head_shards: Any = "auto",
            hardware: Hardware | str | None = None, memory_budget: Any = None, backend: str = "auto",
            seed: Any = 0, on_nonfinite: str = "raise", loss_scale: Any = None,
            loss_mean: Any = "microbatch", fp16_accumulation: Any = False, fused_head: Any = False,
            timeout: Any = None) -> Options:
    """Check compile()'s arguments and build the Options (see `rpcompile.compile` for their meaning).

    Raises:
        ValueError: an argument is out of range or of the wrong type; the message names it.
    """
    _positive_int("gpus", gpus, "workers")
    _positive_int("microbatches", microbatches, "per iteration", allow_none=True)
    if isinstance(staleness, bool) or staleness not in (0, 1):
        raise ValueError(f"staleness must be 0 (synchronous) or 1 (RoundPipe), got {staleness!r}")
    if not (lm_head_shards == "auto" or isinstance(lm_head_shards, int) and not isinstance(lm_head_shards, bool)
            and lm_head_shards >= 1):
        raise ValueError(f"lm_head_shards must be 'auto' or a positive int, got {lm_head_shards!r}")
    _positive_int("memory_budget", memory_budget, "bytes per worker", allow_none=True)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
    if not (loss_scale is None or isinstance(loss_scale, DynamicLossScale) or isinstance(loss_scale, (int, float))
            and not isinstance(loss_scale, bool) and 0 < loss_scale < float("inf")):
        raise ValueError(f"loss_scale must be None, a finite number > 0 or rpcompile.DynamicLossScale(...), "
                         f"got {loss_scale!r}")
    if loss_mean not in LOSS_MEANS:
        raise ValueError(f"loss_mean must be one of {LOSS_MEANS} ('tokens': the mean over the step's trained "
                         f"tokens, for models that take `labels`), got {loss_mean!r}")
    for name, v in (("fp16_accumulation", fp16_accumulation), ("fused_head", fused_head)):
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be True or False, got {v!r}")
    if fp16_accumulation and parse_dtype(dtype) is not torch.float16:
        raise ValueError(f"fp16_accumulation=True needs dtype=torch.float16 (it changes fp16 GEMMs only), got "
                         f"dtype={dtype!r}")
    if layers is not None and (not isinstance(layers, (list, tuple)) or not all(isinstance(p, str) for p in layers)):
        raise ValueError(f"layers must be a list of module-name patterns (e.g. ['model.layers.*']), got {layers!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    optimizer = _optimizer(optimizer)
    if isinstance(hardware, str):  # a preset, or "measured": this machine with the optimizer that runs here
        hardware = hardware_of(hardware, optimizer)
    elif hardware is not None and not isinstance(hardware, Hardware):
        raise ValueError(f"hardware must be a Hardware or a preset name, got {type(hardware).__name__}")
    return Options(gpus=gpus, microbatches=microbatches, staleness=staleness, optimizer=optimizer,
                   dtype=parse_dtype(dtype), loss_fn=loss_fn, layers=layers, lm_head_shards=lm_head_shards,
                   hardware=hardware, memory_budget=memory_budget, backend=backend, seed=seed,
                   on_nonfinite=on_nonfinite, loss_scale=loss_scale, loss_mean=loss_mean,
                   fp16_accumulation=fp16_accumulation, fused_head=fused_head, timeout=check_timeout(timeout))


def check_timeout(timeout: Any) -> float | None:
    """compile()'s / load()'s `timeout` as float seconds (None: derived from the plan); ValueError naming it.

    A finite timeout too long for a thread to wait (`threading.TIMEOUT_MAX`, ~292 years) means no deadline: it
    is capped at `DEADLINE_MAX_S` (~73 years; a drain waits twice the deadline).

        >>> check_timeout(1e10) == DEADLINE_MAX_S
        True
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"timeout must be None (derived from the plan) or a finite number of seconds > 0, got "
                         f"{timeout!r}")
    return min(float(timeout), DEADLINE_MAX_S)


def check_model(model: Any) -> None:
    """Refuse what cannot be trained: not a module, or parameters on the meta device (no weights).

    Raises:
        ValueError: naming the first meta parameter, with what to do instead.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            raise ValueError(f"model parameter {name!r} is on the meta device (no weights to train); load real "
                             f"weights first. To plan a model you cannot allocate, use `python -m rpcompile plan` "
                             f"or rpcompile.models.planning.plan_model, which run on meta")
