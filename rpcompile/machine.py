"""This machine as a `Hardware`, with the host optimizer timed as the runtime runs it.

`Hardware.measure()` (the IR) cannot import the runtime, so on its own it times torch's
foreach AdamW. `measure_hardware()` hands it the runtime's timing instead: the C++ kernels'
fused AdamW pass (`rpcompile.runtime.host.kernels.optimizer_rate`), which the optimizer runs
by default, so the simulator's optimizer lane is priced at what runs. `hardware_of` resolves
compile()'s and `Compiled.simulate`'s `hardware=` argument: a Hardware, a preset name, or
"measured" (this machine, measured now).

    >>> hw = measure_hardware("cpu", budget_s=0.5)   # doctest: +SKIP
    >>> hw.optimizer_bytes_per_s > 1e9               # doctest: +SKIP
    True
"""
from __future__ import annotations

from typing import Any

import torch

from rpcompile.ir.hardware import Hardware
from rpcompile.runtime.host import kernels

__all__ = ["measure_hardware", "hardware_of", "MEASURED"]

MEASURED = "measured"  # the `hardware=` name that measures this machine (`measure_hardware`)


def measure_hardware(device: str | torch.device | None = None, *, gpus: int | None = None, budget_s: float = 2.0,
                     impl: str = "fused") -> Hardware:
    """`Hardware.measure()` with the optimizer rate of the host optimizer the runtime runs.

    Args:
        device: "cuda", "cuda:1" or "cpu"; default CUDA if available, else the CPU.
        gpus: device count (default: CUDA device count, or 1 host worker on the CPU).
        budget_s: rough time budget for all measurements.
        impl: the optimizer's `impl`: "fused" (the default) times the C++ kernels' AdamW step
            (torch's foreach AdamW when they cannot be built here); "foreach"/"single" time torch's.
    Returns:
        A Hardware whose `optimizer_bytes_per_s` is the measured fp32 master bytes per second of that step.

    Example:
        >>> measure_hardware("cpu", budget_s=0.5).optimizer_bytes_per_s > 0   # doctest: +SKIP
        True
    """
    rate = kernels.optimizer_rate if impl == "fused" else None  # None: Hardware.measure's torch foreach AdamW
    return Hardware.measure(device, gpus=gpus, budget_s=budget_s, optimizer_rate=rate)


def hardware_of(spec: Any, optimizer: Any = None) -> Hardware:
    """A `hardware=` argument as a Hardware: itself, a preset by name, or "measured" (`measure_hardware`).

    Args:
        spec: a Hardware, a preset name ("rtx4090", ...) or "measured".
        optimizer: the run's optimizer config (its `impl` says which optimizer "measured" times).
    Returns:
        The Hardware.
    Raises:
        ValueError: an unknown name (the message lists the presets and "measured").

    Example:
        >>> hardware_of("rtx4090").name
        'rtx4090'
    """
    if isinstance(spec, Hardware):
        return spec
    if spec == MEASURED:
        return measure_hardware(impl=getattr(optimizer, "impl", "fused"))
    try:
        return Hardware.preset(spec)
    except ValueError as exc:
        raise ValueError(f"{exc}, or {MEASURED!r} (this machine, measured now)") from None
