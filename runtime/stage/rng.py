"""Per-worker randomness: every random op of a layer draws from the worker's own generator.

Dropout must give the same mask in a forward stage and in the backward
stage's recompute of the same layer, which may run on another worker. Each
worker owns a `torch.Generator`, seeded before each layer with
`layer_seed(seed, iteration, microbatch, layer)`; `WorkerRandom` is a torch
dispatch mode that hands that generator to every aten op with a `generator`
argument (dropout's `bernoulli_`, `rand`, `randn`, `randint`, `randperm`,
`normal`, `multinomial`, ...). No global RNG state is touched, so workers do
not serialise on a lock.

Note:
    A fused attention kernel with `dropout_p > 0` (CUDA flash / memory-efficient
    SDPA) draws from the device's global generator internally and cannot be
    redirected; it raises, naming the op. Use `attention_dropout=0` (the usual
    setting for fine-tuning) or the math/eager attention path.

    >>> g = torch.Generator(); x = torch.ones(8)
    >>> with WorkerRandom(g, seed=3):
    ...     a = torch.nn.functional.dropout(x, 0.5)
    >>> with WorkerRandom(g, seed=3):
    ...     b = torch.nn.functional.dropout(x, 0.5)
    >>> torch.equal(a, b)
    True
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["WorkerRandom", "layer_seed"]

_FUSED_ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def layer_seed(seed: int, iteration: int, mb: int, layer: int) -> int:
    """The RNG seed of one layer's forward (and its recompute) for one microbatch.

    >>> layer_seed(0, 1, 2, 3) == layer_seed(0, 1, 2, 3)
    True
    """
    x = seed & 0xFFFFFFFF
    for v in (iteration, mb, layer):
        x = (x * 0x9E3779B97F4A7C15 + (v & 0xFFFFFFFF) + 0x632BE59BD9B4E019) % (1 << 61)
    return x


class WorkerRandom(TorchDispatchMode):
    """Route the random aten ops run inside the block to `generator`, seeded with `seed` on entry.

    Args:
        generator: the worker's generator (on the worker's device).
        seed: the layer's seed (`layer_seed`).
    """

    def __init__(self, generator: torch.Generator, seed: int) -> None:
        super().__init__()
        self.generator, self.seed = generator, seed
        # a CPU random op inside a CUDA worker's layer draws from a CPU generator seeded alike: a
        # generator only serves ops on its own device type
        self.cpu = generator if generator.device.type == "cpu" else torch.Generator()

    def __enter__(self) -> "WorkerRandom":
        self.generator.manual_seed(self.seed)
        if self.cpu is not self.generator:
            self.cpu.manual_seed(self.seed)
        return super().__enter__()

    def _for(self, args: tuple, kwargs: dict) -> torch.Generator:
        """The generator for an op: the one of its device (a `device=` argument, else its first tensor's; else the CPU)."""
        dev = kwargs.get("device")
        if dev is None:
            dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        return self.cpu if dev is None or torch.device(dev).type == "cpu" else self.generator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:  # noqa: D105
        kwargs = dict(kwargs or {})
        schema = func._schema
        names = [a.name for a in schema.arguments]
        if "generator" in names:
            if kwargs.get("generator") is None and not _positional(names, args, "generator"):
                kwargs["generator"] = self._for(args, kwargs)
            return func(*args, **kwargs)
        base = schema.name.split("::")[-1]
        if base == "native_dropout":
            return self._native_dropout(*args, **kwargs)
        if base in _FUSED_ATTENTION and _dropout_p(names, args, kwargs) > 0:
            raise NotImplementedError(f"{func}: a fused attention kernel with dropout_p > 0 draws from the global "
                                      f"generator; set attention dropout to 0 or use eager/math attention")
        packet = func.overloadpacket
        alt = "generator" if func._overloadname == "default" else f"{func._overloadname}_generator"
        if alt in packet.overloads():
            return getattr(packet, alt)(*args, generator=self._for(args, kwargs), **kwargs)
        return func(*args, **kwargs)

    def _native_dropout(self, x: torch.Tensor, p: float, train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
        """aten.native_dropout with the worker's generator (the fused CUDA kernel takes no generator)."""
        if train is False or p == 0:
            return x.clone(), torch.ones_like(x, dtype=torch.bool)
        p1m = 1.0 - p
        mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(p1m, generator=self._for((x,), {}))
        return x * mask * (1.0 / p1m if p1m > 0 else 0.0), mask


def _positional(names: list[str], args: tuple, name: str) -> bool:
    """True if argument `name` was passed positionally and is not None."""
    k = names.index(name)
    return k < len(args) and args[k] is not None


def _dropout_p(names: list[str], args: tuple, kwargs: dict) -> float:
    """The dropout_p argument of a fused attention op (0 if absent)."""
    if "dropout_p" not in names:
        return 0.0
    k = names.index("dropout_p")
    v = args[k] if k < len(args) else kwargs.get("dropout_p", 0.0)
    return float(v or 0.0)
