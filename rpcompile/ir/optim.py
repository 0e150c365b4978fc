"""User-facing optimizer configs: plain frozen data, no tensors.

`rpcompile.compile(..., optimizer=rpcompile.AdamW(lr=1e-4))` takes one of these;
the runtime's CPU optimizer (`rpcompile.runtime.host.optimizer.HostState`) turns it
into one torch optimizer per layer group over the fp32 master weights.

Note:
    `impl` picks the CPU kernel. "fused" (default) is rpcompile's C++/OpenMP
    kernels (runtime/host/kernels.cpp: gradient statistics while the gradient
    lands, one update pass per layer group), or torch's fused kernel with one
    warning where they cannot be built; it agrees with eager `torch.optim.AdamW`
    to about one float32 ulp of the weight per step (|diff| <~ 1e-6 * |theta| + 1e-7);
    "foreach" and "single" are bit-identical to eager `torch.optim.AdamW(
    model.parameters(), ...)` on the CPU (whose default is the single-tensor
    loop; the foreach kernel gives the same bits). For SGD "foreach" and
    "single" give eager's bits; "fused" can differ from them by an ulp on
    some CPUs (its vectorised tail uses FMA where the loop does not).

Note:
    `AdamW(state_dtype=torch.bfloat16)` stores both moments in bf16 (4 bytes per parameter instead
    of 8). The update stays float32: each step reads the moments, widens them, computes the new ones
    and the weight in float32 as the fp32 mode does, and stores the moments rounded stochastically to
    bf16 (`rpcompile.runtime.host.lean`: 16 random bits added below the kept ones, then truncated, so
    the stored value is unbiased; round to nearest would freeze `exp_avg_sq`, whose relative change
    per step, 1 - beta2 = 0.001, is below half a bf16 ulp, 2**-9). The random bits are a counter-based
    hash of (the run's seed, the layer group, the step count, the element), so the kernels and the
    torch fallback draw the same bits and a checkpoint (seed and step counts) resumes them bit for bit.
    The default, float32, is the same arithmetic and bits as before the option existed.

Note:
    `master_dtype=torch.bfloat16` (AdamW and SGD) keeps no fp32 master: the weight the optimizer
    updates is stored in bf16 (2 bytes per parameter instead of 4). Each step widens it, computes the
    update in float32 exactly as the fp32 mode does, and stores the new weight rounded stochastically
    to bf16 with random bits of its own (`rpcompile.runtime.host.lean.master_bits`: from the same
    hash as the moments', independent of each), so an update below half a bf16 ulp moves the weight
    by one ulp with the matching probability instead of rounding away. The bf16 master is a buffer of
    its own beside the compute copy (2 more bytes): at staleness 1 the compute copy that iteration
    t+1 still uploads is the previous version, written only by `copy(l)` once those uploads are done
    (rule R1), while the step writes the master. With a bf16 compute dtype the copy is then the
    master's bits.

Note:
    `grad_dtype=torch.bfloat16` (AdamW and SGD) keeps the host gradient buffers in bf16 (2 bytes per
    parameter instead of 4). A gradient written once per iteration is stored as it lands (a bf16 gradient
    from the device is exact in bf16). Where accumulation rounds add several writes, each sum is taken in
    float32 and stored rounded stochastically (`rpcompile.runtime.host.lean.grad_key`: its own key per
    layer group, iteration and write), since round to nearest drops a contribution below half an ulp of
    the running sum. The update reads the bf16 gradient and widens it: the math stays float32.

Note:
    With `state_dtype=torch.bfloat16` and the default float32 master, an unsharded state keeps each master
    split in two 16-bit halves (`split_masters`; AReno's split, `rpcompile.runtime.host.lean`): the bf16
    half is the compute copy itself (the float32 value rounded to nearest, ties away from zero, where
    round-to-nearest-even differs on 1 value in 65,536), the other half the 16 bits that make the master
    exact again. The update is the float32 one, with the same master and moment bits; at staleness 1 the
    compute copies alternate with the bf16 halves, so the master and its copies take 6 bytes a
    parameter instead of 8, and the update writes no copy of its own. Only at staleness 1: at 0 there is
    no second buffer to save.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Union

import torch

__all__ = ["AdamW", "SGD", "DynamicLossScale", "IMPLS", "STATE_DTYPES", "MASTER_DTYPES", "Decay", "decay_names",
           "make_torch_optimizer", "dtype_name", "master_dtype", "grad_dtype", "GRAD_DTYPES", "split_masters"]

Decay = Union[None, frozenset, Callable[[str], bool]]  # which parameters weight decay applies to (see the Note)

IMPLS = ("fused", "foreach", "single")  # accepted values of `impl`
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # AdamW's `state_dtype`, by its command-line name
MASTER_DTYPES = STATE_DTYPES  # `master_dtype` (AdamW, SGD), by its command-line name
GRAD_DTYPES = STATE_DTYPES  # `grad_dtype` (AdamW, SGD), by its command-line name


def dtype_name(dtype: torch.dtype) -> str:
    """The command-line name of a state dtype ("fp32", "bf16"), else str(dtype).

    >>> dtype_name(torch.bfloat16)
    'bf16'
    """
    return next((k for k, v in STATE_DTYPES.items() if v == dtype), str(dtype))


def master_dtype(config: Any) -> torch.dtype:
    """The dtype of `config`'s master weights (float32 unless `master_dtype=torch.bfloat16`).

    >>> master_dtype(SGD(lr=0.1, master_dtype=torch.bfloat16))
    torch.bfloat16
    """
    return getattr(config, "master_dtype", torch.float32)


def split_masters(config: Any, shard: tuple[int, int] | None = None, staleness: int = 1) -> bool:
    """Whether a host state of `config` keeps its float32 masters split in two bf16-sized halves (module Note):
    AdamW with bf16 moments and float32 masters, unsharded (`shard`: (rank, world) of a sharded state), at
    staleness 1 (where the bf16 halves save the compute copies' second buffer; at 0 there is none to save).

    >>> split_masters(AdamW(state_dtype=torch.bfloat16)), split_masters(AdamW()), split_masters(
    ...     AdamW(state_dtype=torch.bfloat16), shard=(0, 2)), split_masters(AdamW(state_dtype=torch.bfloat16),
    ...     staleness=0)
    (True, False, False, False)
    """
    return (isinstance(config, AdamW) and config.state_dtype == torch.bfloat16 and staleness == 1
            and master_dtype(config) == torch.float32 and (shard is None or shard[1] == 1))


def grad_dtype(config: Any) -> torch.dtype:
    """The dtype of `config`'s host gradient buffers (float32 unless `grad_dtype=torch.bfloat16`).

    >>> grad_dtype(SGD(lr=0.1, grad_dtype=torch.bfloat16))
    torch.bfloat16
    """
    return getattr(config, "grad_dtype", torch.float32)


def _check_master(cfg: Any) -> None:
    """Refuse a master or gradient dtype other than float32 and bfloat16, naming the field."""
    for name in ("master_dtype", "grad_dtype"):
        if getattr(cfg, name) not in MASTER_DTYPES.values():
            raise ValueError(f"{type(cfg).__name__}: {name} must be torch.float32 or torch.bfloat16, got "
                             f"{getattr(cfg, name)!r}")


def _check(cfg: AdamW | SGD) -> None:
    """Validate the fields shared by both configs."""
    if not cfg.lr >= 0:
        raise ValueError(f"{type(cfg).__name__}: lr must be >= 0, got {cfg.lr}")
    if cfg.weight_decay < 0:
        raise ValueError(f"{type(cfg).__name__}: weight_decay must be >= 0, got {cfg.weight_decay}")
    if cfg.max_grad_norm is not None and not cfg.max_grad_norm > 0:
        raise ValueError(f"{type(cfg).__name__}: max_grad_norm must be > 0 or None, got {cfg.max_grad_norm}")
    if cfg.impl not in IMPLS:
        raise ValueError(f"{type(cfg).__name__}: impl must be one of {IMPLS}, got {cfg.impl!r}")
    _check_decay(cfg)


def _check_decay(cfg: AdamW | SGD) -> None:
    """Validate `decay`; an iterable of names is stored as a frozenset (the config stays hashable)."""
    d, what = cfg.decay, type(cfg).__name__
    if d is None or callable(d):
        return
    if isinstance(d, (str, bytes)):
        raise ValueError(f"{what}: decay must be None, a set of parameter names or a callable name -> bool, "
                         f"got the string {d!r} (write decay={{{d!r}}} for one name)")
    try:
        names = frozenset(d)
    except TypeError:
        raise ValueError(f"{what}: decay must be None, a set of parameter names or a callable name -> bool, "
                         f"got {type(d).__name__}") from None
    bad = sorted(repr(n) for n in names if not isinstance(n, str))
    if bad:
        raise ValueError(f"{what}: decay names must be strings, got {', '.join(bad[:5])}")
    object.__setattr__(cfg, "decay", names)


def _setstate(cfg: AdamW | SGD, state: Sequence[Any]) -> None:
    """Unpickle (a checkpoint's config): fields a config of an older version lacks keep their defaults."""
    for i, f in enumerate(fields(cfg)):
        object.__setattr__(cfg, f.name, state[i] if i < len(state) else f.default)


@dataclass(frozen=True, slots=True)
class AdamW:
    """AdamW with decoupled weight decay, applied on the CPU to the masters (fp32 by default).

    Example:
        >>> import rpcompile
        >>> rpcompile.AdamW(lr=3e-4, max_grad_norm=1.0)
        AdamW(lr=0.0003, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01, max_grad_norm=1.0, impl='fused', decay=None, state_dtype=torch.float32, master_dtype=torch.float32, grad_dtype=torch.float32)
        >>> rpcompile.AdamW(state_dtype=torch.bfloat16).state_dtype   # bf16 moments (module Note)
        torch.bfloat16
        >>> rpcompile.AdamW(master_dtype=torch.bfloat16).master_dtype   # a bf16 master, no fp32 one (module Note)
        torch.bfloat16
    """

    lr: float = 1e-4  # learning rate, as torch.optim.AdamW
    betas: tuple[float, float] = (0.9, 0.999)  # decay rates of the first and second moments
    eps: float = 1e-8  # added to the denominator sqrt(v) + eps
    weight_decay: float = 0.01  # decoupled: theta -= lr * weight_decay * theta (torch's default)
    max_grad_norm: float | None = None  # clip by the global L2 norm over all trainable grads; None = off
    impl: str = "fused"  # CPU kernel: "fused" (rpcompile's, ~1 ulp from eager), "foreach"/"single" (torch: eager bits)
    decay: Decay = None  # parameters weight_decay applies to: None = all, names, or name -> bool (module Note)
    state_dtype: torch.dtype = torch.float32  # dtype of both moments: float32, or bfloat16 (stochastically
    # rounded, the math float32; module Note). Last: a checkpoint's older config keeps this default
    master_dtype: torch.dtype = torch.float32  # dtype of the master weights: float32, or bfloat16 (updated with
    # stochastic rounding, the math float32; module Note)
    grad_dtype: torch.dtype = torch.float32  # dtype of the host gradient buffers: float32, or bfloat16
    # (accumulated in float32, stored with stochastic rounding; module Note)

    __setstate__ = _setstate

    def __post_init__(self) -> None:
        _check(self)
        _check_master(self)
        if self.state_dtype not in STATE_DTYPES.values():
            raise ValueError(f"AdamW: state_dtype must be torch.float32 or torch.bfloat16, got {self.state_dtype!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"AdamW: betas must be two values in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ValueError(f"AdamW: eps must be > 0, got {self.eps}")


@dataclass(frozen=True, slots=True)
class SGD:
    """SGD with optional (Nesterov) momentum, applied on the CPU to the masters (fp32 by default).

    Example:
        >>> import rpcompile
        >>> rpcompile.SGD(lr=0.1, momentum=0.9)
        SGD(lr=0.1, momentum=0.9, weight_decay=0.0, nesterov=False, max_grad_norm=None, impl='fused', decay=None, master_dtype=torch.float32, grad_dtype=torch.float32)
    """

    lr: float  # learning rate, as torch.optim.SGD
    momentum: float = 0.0  # momentum factor; 0 = plain SGD (no optimizer state)
    weight_decay: float = 0.0  # L2 penalty added to the gradient (coupled, as torch.optim.SGD)
    nesterov: bool = False  # Nesterov momentum (needs momentum > 0)
    max_grad_norm: float | None = None  # clip by the global L2 norm over all trainable grads; None = off
    impl: str = "fused"  # CPU kernel: "fused" (rpcompile's, within float32 ulps of eager), "foreach"/"single" (torch's)
    decay: Decay = None  # parameters weight_decay applies to: None = all, names, or name -> bool (module Note)
    master_dtype: torch.dtype = torch.float32  # the master weights: float32, or bfloat16 (stochastic rounding,
    # module Note); the momentum buffer stays float32. Last: a checkpoint's older config keeps this default
    grad_dtype: torch.dtype = torch.float32  # the host gradient buffers: float32, or bfloat16 (module Note)

    __setstate__ = _setstate

    def __post_init__(self) -> None:
        _check(self)
        _check_master(self)
        if self.momentum < 0:
            raise ValueError(f"SGD: momentum must be >= 0, got {self.momentum}")
        if self.nesterov and self.momentum <= 0:
            raise ValueError("SGD: nesterov=True needs momentum > 0")


@dataclass(frozen=True, slots=True)
class DynamicLossScale:
    """Dynamic loss scaling for fp16 training, with torch.amp.GradScaler's rule.

    The loss is multiplied by the scale before backward; the optimizer
    divides the gradients by it. An iteration with an inf/nan gradient anywhere
    is skipped by every layer and halves the scale; `growth_interval`
    consecutive good iterations double it. The scale is as stale as the weights:
    iteration t uses the one the checks of iterations <= t - 1 - staleness leave
    (staleness 0: GradScaler's; staleness 1: t - 1's check counts from t + 1 on),
    so it is a function of the run, the same in every run and after a resume.

    Example:
        >>> DynamicLossScale(init_scale=1024.0)
        DynamicLossScale(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000)
    """

    init_scale: float = 2.0**16  # the first iteration's scale
    growth_factor: float = 2.0  # scale *= growth_factor after growth_interval good iterations
    backoff_factor: float = 0.5  # scale *= backoff_factor after an iteration with inf/nan grads
    growth_interval: int = 2000  # consecutive good iterations before growing

    def __post_init__(self) -> None:
        if not self.init_scale > 0 or not self.growth_factor > 1 or not 0 < self.backoff_factor < 1:
            raise ValueError(f"DynamicLossScale: need init_scale > 0, growth_factor > 1, "
                             f"0 < backoff_factor < 1; got {self}")
        if self.growth_interval < 1:
            raise ValueError(f"DynamicLossScale: growth_interval must be >= 1, got {self.growth_interval}")


def decay_names(config: AdamW | SGD, trainable: Iterable[str], aliases: Mapping[str, str] | None = None
                ) -> frozenset[str]:
    """The trainable parameters that `config.weight_decay` applies to, as `config.decay` selects them.

    Args:
        config: an `rpcompile.AdamW` or `rpcompile.SGD`.
        trainable: the canonical names of the model's trainable parameters.
        aliases: alias -> canonical name (tied parameters); an alias in `config.decay` selects its canonical.
    Returns:
        A subset of `trainable`.
    Raises:
        ValueError: a name in `config.decay` that is not a trainable parameter (named).

    Example:
        >>> sorted(decay_names(AdamW(decay=lambda n: n.endswith("weight")), ["fc.weight", "fc.bias"]))
        ['fc.weight']
    """
    names, aliases = tuple(trainable), aliases or {}
    if config.decay is None:
        return frozenset(names)
    if callable(config.decay):
        return frozenset(n for n in names if config.decay(n))
    unknown = sorted(n for n in config.decay if aliases.get(n, n) not in names)
    if unknown:
        raise ValueError(f"{type(config).__name__}(decay=...): {', '.join(map(repr, unknown[:5]))}"
                         f"{f' and {len(unknown) - 5} more' if len(unknown) > 5 else ''} "
                         f"{'is not a trainable parameter' if len(unknown) == 1 else 'are not trainable parameters'}"
                         f" of the model (trainable: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''})")
    return frozenset(aliases.get(n, n) for n in config.decay)


def make_torch_optimizer(config: AdamW | SGD, params: Sequence[Any], decayed: Sequence[bool] | None = None) -> Any:
    """The torch optimizer that `config` describes, over `params`.

    Args:
        config: an `rpcompile.AdamW` or `rpcompile.SGD`.
        params: leaf tensors (their `.grad` is read by `step()`).
        decayed: per parameter, whether `config.weight_decay` applies to it (None = all); the others
            go into a second param group with weight_decay 0.
    Returns:
        `torch.optim.AdamW` or `torch.optim.SGD` with the kernel `config.impl`.

    Example:
        >>> import torch
        >>> make_torch_optimizer(AdamW(lr=1e-3, impl="foreach"), [torch.zeros(3)]).defaults["foreach"]
        True
    """
    if getattr(config, "state_dtype", torch.float32) != torch.float32:
        raise ValueError(f"{type(config).__name__}(state_dtype={config.state_dtype}): torch's optimizers keep "
                         f"float32 moments; the host state steps bf16 moments itself (rpcompile.runtime.host.lean)")
    if master_dtype(config) != torch.float32:
        raise ValueError(f"{type(config).__name__}(master_dtype={config.master_dtype}): torch's optimizers update "
                         f"the weights they are given; the host state steps a bf16 master itself "
                         f"(rpcompile.runtime.host.lean)")
    kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}[config.impl]
    flags = [True] * len(params) if decayed is None else list(decayed)
    groups = [g for g in ({"params": [p for p, d in zip(params, flags) if d]},
                          {"params": [p for p, d in zip(params, flags) if not d], "weight_decay": 0.0}) if g["params"]]
    if isinstance(config, AdamW):
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                                 weight_decay=config.weight_decay, **kernel)
    if isinstance(config, SGD):
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov,
                               weight_decay=config.weight_decay, **kernel)
    raise TypeError(f"optimizer must be rpcompile.AdamW or rpcompile.SGD, got {type(config).__name__}")
