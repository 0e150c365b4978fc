"""Lean host state: bf16 AdamW moments (`state_dtype=torch.bfloat16`) and bf16 masters (`master_dtype=
torch.bfloat16`, AdamW and SGD): the stochastic rounding, and the update in torch operations; and the split
float32 masters beside bf16 moments (`split`, `join`, `SplitMasters`).

The moments are stored in bf16; each step widens them to float32, updates them and the weight in
float32 (torch.optim.AdamW's formulas, as the fp32 kernels), and stores them rounded stochastically:
16 random bits are added to the float32 bits below the 16 that bf16 keeps, then those low bits are
cut (a NaN stays a NaN; the result is x rounded up with probability equal to the fraction of the ulp
it lies above the lower neighbour, so it is unbiased). Round to nearest would freeze `exp_avg_sq`:
its relative change per step (1 - beta2 = 0.001) is below half a bf16 ulp (2**-9).

The random bits are a counter-based hash, so any implementation and any thread count draw the same:

- `rounding_key(seed, group, step)`: one 32-bit key per (run seed, layer group, 1-based step count);
- element i of the group's flat buffers (its offset in them, modulo 2**32) takes
  `r = hash32(i ^ key)`: the low 16 bits round `exp_avg`, the high 16 `exp_avg_sq`;
- a bf16 master rounds the new weight (computed in float32 from the widened bf16 one) with
  `master_bits(r)`: the xor of r's two halves, and of 0x8000. Any two of the three draws are
  independent and uniform (the halves of a uniform r are; their xor is independent of each), which is
  all each rounding's mean and any two roundings' covariance depend on; one hash serves all three,
  which keeps the kernels' update as fast as the bytes it moves. The 0x8000 makes an r of 0x80008000
  (every draw one half: round to nearest, ties away) one half for the master too.

- a bf16 gradient (`grad_dtype=torch.bfloat16`) is stored with the low 16 bits of `hash32(i ^ k)`,
  `k = grad_key(seed, group, iteration, write)`: a key of its own per layer group, iteration (0-based) and
  write of that parameter in the iteration (0-based), so each accumulation round draws fresh bits. The sum
  is taken in float32 and rounded stochastically because round to nearest drops a contribution below half
  an ulp of the running sum: rounds that accumulate would lose the small ones, always in the same direction.
  A value already in bf16 (one write of a bf16 device gradient) is stored exactly: its low 16 bits are 0,
  and adding fewer than 2**16 to them never carries.

`hash32` is Wellons' lowbias32 (two multiply-xorshift rounds, a bijection of 32-bit integers). The
"generator state" a resume needs is the seed and the per-parameter step counts, both in the host
state's checkpoint. runtime/host/kernels.cpp does the same in its one pass (`adamw_lean`, `sgd`);
`TorchLean` here is the torch fallback (`impl="foreach"/"single"`, or no C++ compiler), with the
same float32 operations in the same order and a correctly rounded square root (`sqrt_rn`; torch's
vectorised float32 sqrt is not always), so it computes the same float32 values and takes the same
rounding decisions: the same bits.

Split masters (AReno's split): an exact float32 master kept as two 16-bit halves, so that its bf16 half
is the compute copy instead of a second buffer beside it.

With `AdamW(state_dtype=torch.bfloat16)` and float32 masters, an unsharded state keeps each master this way
(`FlatGroups.split`): `hi`, the bf16 value the forward uses (the float32 value rounded to nearest, ties away from
zero), and `lo`, the 16 bits that make it whole again. The update reads both, computes in float32 exactly as with a
float32 master (the same bits), and writes both back; at staleness 1 the hi halves alternate with the compute copies
as a bf16 master does (runtime/host/layout.py `Alternation`), so master and copies cost 6 bytes a parameter instead
of 8, and the update writes no separate copy.

For bits u of a float32 value (a NaN stored as the canonical 0x7FC00000, as the roundings store it):
hi = (u + 0x8000) >> 16, lo = u mod 2^16, and u = (hi << 16) + lo with lo read as a signed 16-bit number. The
copy differs from round-to-nearest-even only on exact ties (low 16 bits 0x8000: 1 value in 65,536). The kernels
do the same (runtime/host/kernels_update.h `split_value`, `split_hi`).

    >>> x = torch.tensor([1.0 + 2**-9])   # halfway between two bf16 values
    >>> sorted({stochastic_round(x, torch.tensor([r])).item() for r in (0, 0x7FFF, 0x8000, 0xFFFF)})
    [1.0, 1.0078125]
"""
from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

__all__ = ["hash32", "rounding_key", "master_bits", "grad_key", "random_bits", "stochastic_round", "sqrt_rn",
           "TorchLean", "M32", "land", "to_float32", "split", "join", "split_into", "SplitMasters"]

M32 = 0xFFFFFFFF  # 32-bit mask
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
GRAD_SALT = 0x85EBCA77  # grad_key's constant (a prime of xxHash32), apart from every update's keys
CHUNK = 1 << 20  # elements per torch pass of the fallback (bounds its float32 temporaries)


def hash32(x: int) -> int:
    """Wellons' lowbias32 of a 32-bit integer (Python ints).

    >>> hash32(0), hash32(1)
    (0, 1753845952)
    """
    x &= M32
    x ^= x >> 16
    x = (x * _C1) & M32
    x ^= x >> 15
    x = (x * _C2) & M32
    return x ^ (x >> 16)


def rounding_key(seed: int, group: int, step: int) -> int:
    """The 32-bit key of one update: the run's seed (any int, 64 bits used), the layer group, the 1-based step.

    >>> rounding_key(0, 3, 1) != rounding_key(0, 3, 2) != rounding_key(0, 4, 1)
    True
    """
    k = hash32((seed & M32) ^ hash32((seed >> 32) & M32))
    k = hash32(k ^ (group & M32))
    return hash32(k ^ (step & M32))


def master_bits(r: Tensor) -> Tensor:
    """A bf16 master's 16 random bits from its element's `random_bits` r (int64): `(r ^ r >> 16 ^ 0x8000) & 0xFFFF`.

    >>> master_bits(torch.tensor([0x80008000, 0x12345678])).tolist() == [0x8000, 0x1234 ^ 0x5678 ^ 0x8000]
    True
    """
    return (r ^ (r >> 16) ^ 0x8000) & 0xFFFF


def grad_key(seed: int, group: int, iteration: int, write: int) -> int:
    """The 32-bit key of a bf16 gradient's write number `write` (0-based, per parameter) in `iteration` (0-based).

    >>> len({grad_key(0, 3, 0, 0), grad_key(0, 3, 0, 1), grad_key(0, 3, 1, 0), rounding_key(0, 3, 1)})
    4
    """
    return hash32(hash32(rounding_key(seed, group, iteration) ^ GRAD_SALT) ^ (write & M32))


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without int64 overflow (16-bit halves)."""
    return (((x >> 16) * c & 0xFFFF) << 16) + (x & 0xFFFF) * c & M32


def random_bits(offset: int, n: int, key: int) -> Tensor:
    """`hash32((offset + i) mod 2**32 ^ key)` for i in [0, n), as int64 (torch: the kernels' bits).

    >>> random_bits(5, 2, 0).tolist() == [hash32(5), hash32(6)]
    True
    """
    x = (torch.arange(offset, offset + n, dtype=torch.int64) & M32) ^ key
    x ^= x >> 16
    x = _mul32(x, _C1)
    x ^= x >> 15
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def stochastic_round(x: Tensor, r16: Tensor) -> Tensor:
    """float32 `x` to bf16: add the 16-bit integers `r16` (int64) below the kept bits and cut them; NaN stays NaN."""
    bits = x.view(torch.int32).to(torch.int64) & M32
    out = (bits + r16) >> 16
    out = torch.where(x.isnan(), 0x7FC0, out)
    return _int16(out).view(torch.bfloat16)


def sqrt_rn(x: Tensor) -> Tensor:
    """The correctly rounded float32 square root of float32 `x` (as C++'s std::sqrt): taken in float64, whose
    53 bits make the one rounding to float32 exact; torch's vectorised float32 sqrt can be an ulp off."""
    return x.double().sqrt_().float()


def to_float32(x: float) -> float:
    """x rounded to the nearest float32 (ties to even), as a Python float; past float32's range: +-inf
    (struct's C cast; tests/runtime/host/test_grad_stats.py holds it to torch's conversion). Applied to the float64
    sum, product or quotient of two float32 values it gives their float32 operation's result: 53 >= 2 * 24 + 2
    bits, so rounding twice (to float64, then to float32) is the same as rounding once.

    >>> to_float32(0.1) == float(torch.tensor(0.1, dtype=torch.float32)), to_float32(1e39)
    (True, inf)
    """
    return struct.unpack("f", struct.pack("f", x))[0]


def land(dst: Tensor, src: Tensor, *, add: bool, key: int, offset: int, divisor: float = 1.0) -> tuple[float, bool]:
    """dst (bf16) = SR(((dst if add else 0) + src) / divisor), the sum and the division in float32 (the kernels'
    `land` into a bf16 buffer, in torch operations: the same bits); src any float dtype (may be dst).

    A bf16 src written alone (no add, no division) is copied: exact, the bits the rounding would give (its
    NaNs kept as they are, as the kernels' copy).

    Returns:
        (sum of squares, non-finite) of the stored values (the sum in float64).
    """
    sq, bad = 0.0, False
    copy = src.dtype == torch.bfloat16 and not add and divisor == 1.0
    for lo in range(0, dst.numel(), CHUNK):
        hi = min(lo + CHUNK, dst.numel())
        if copy:
            dst[lo:hi] = src[lo:hi]
        else:
            x = dst[lo:hi].float() + src[lo:hi].float() if add else src[lo:hi].float()
            x = x / divisor if divisor != 1.0 else x
            dst[lo:hi] = stochastic_round(x, random_bits(offset + lo, hi - lo, key) & 0xFFFF)
        y = dst[lo:hi].double()
        sq += float(y.square().sum())
        bad = bad or not bool(torch.isfinite(y).all())
    return sq, bad


class TorchLean:
    """The lean update in torch operations: the fallback of the kernels' `adamw` and `sgd` (same signatures)."""

    def adamw(self, p: Tensor, g: Tensor, m: Tensor, v: Tensor, out: Tensor | None, *, factor: float, lr: float,
              betas: tuple[float, float], eps: float, weight_decay: float, step: int, key: int, offset: int,
              src: Tensor | None = None, low: Tensor | None = None) -> None:
        """AdamW step `step` (1-based) of p and m, v with g * factor; out (if given) = cast(new p); `src`: the master
        read from it, the new one written to p (None: p in place). `low`: p (and src) are a split master's hi halves
        and `low` its lo halves (`split`): float32 arithmetic, stored whole; a bf16 out takes hi.

        p is an fp32 or bf16 master, m and v both fp32 or both bf16, g an fp32 or bf16 gradient (widened).
        torch.optim.AdamW's float32 operations (which kernels.cpp's update follows), chunk by chunk, the
        square root correctly rounded; `key` and `offset` (p's first element's offset in its group's
        buffers) choose the random bits of the bf16 values (module docstring).
        """
        b1, b2 = betas
        bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
        lean_m, lean_p = m.dtype == torch.bfloat16, p.dtype == torch.bfloat16 and low is None
        for lo in range(0, p.numel(), CHUNK):  # torch.optim.AdamW's single-tensor operations, in its order
            hi = min(lo + CHUNK, p.numel())
            gi = g[lo:hi].float() * factor if factor != 1.0 else g[lo:hi].float()
            mi, vi = (m[lo:hi].float(), v[lo:hi].float()) if lean_m else (m[lo:hi], v[lo:hi])  # fp32: in place
            pi = _read(p, src, lo, hi) if low is None else join((p if src is None else src)[lo:hi], low[lo:hi])
            pi.mul_(1 - lr * weight_decay)
            mi.lerp_(gi, 1 - b1)
            vi.mul_(b2).addcmul_(gi, gi, value=1 - b2)
            pi.addcdiv_(mi, (sqrt_rn(vi) / bc2 ** 0.5).add_(eps), value=-(lr / bc1))
            r = random_bits(offset + lo, hi - lo, key) if lean_m or lean_p else None
            if low is None:
                _store(p, pi, lo, hi, r, out)
            else:
                split_into(pi, p[lo:hi], low[lo:hi])
                if out is not None:
                    out[lo:hi] = p[lo:hi] if out.dtype == torch.bfloat16 else join(p[lo:hi], low[lo:hi]).to(out.dtype)
            if lean_m:
                m[lo:hi] = stochastic_round(mi, r & 0xFFFF)
                v[lo:hi] = stochastic_round(vi, r >> 16)

    def sgd(self, p: Tensor, g: Tensor, buf: Tensor | None, out: Tensor | None, *, factor: float, lr: float,
            momentum: float, weight_decay: float, nesterov: bool, first: bool, key: int, offset: int,
            src: Tensor | None = None) -> None:
        """SGD step of an fp32 or bf16 master p (fp32 momentum `buf`, None without momentum) with an fp32 or bf16
        gradient g * factor, as torch.optim.SGD's float32 operations (kernels.cpp's `sgd`); a bf16 weight rounded
        stochastically.

        `first`: the buffer's first step (it becomes the gradient, as torch's clone). `src`: as for `adamw`.
        """
        for lo in range(0, p.numel(), CHUNK):
            hi = min(lo + CHUNK, p.numel())
            gi = g[lo:hi].float() * factor if factor != 1.0 else g[lo:hi].float()
            pi = _read(p, src, lo, hi)
            if weight_decay != 0.0:
                gi = gi.add(pi, alpha=weight_decay)  # grad.add(param, alpha=wd)
            if buf is not None:
                b = buf[lo:hi]
                b.copy_(gi) if first else b.mul_(momentum).add_(gi)  # buf.mul_(momentum).add_(grad)
                gi = gi.add(b, alpha=momentum) if nesterov else b
            pi.add_(gi, alpha=-lr)
            _store(p, pi, lo, hi, random_bits(offset + lo, hi - lo, key) if p.dtype == torch.bfloat16 else None, out)


def _read(p: Tensor, src: Tensor | None, lo: int, hi: int) -> Tensor:
    """The master's elements [lo, hi) in float32 to update: p's own view where an fp32 p is updated in place, else
    a new tensor (widened bf16, or a copy of an out-of-place fp32 source)."""
    if src is None:
        return p[lo:hi].float()  # fp32: the view itself
    return src[lo:hi].to(torch.float32, copy=True)


def _store(p: Tensor, pi: Tensor, lo: int, hi: int, r: Tensor | None, out: Tensor | None) -> None:
    """The new weight `pi` (float32) into p[lo:hi]: as is (fp32 p: nothing to do where pi is p's view) or rounded
    stochastically with `master_bits(r)` (bf16 p; r: the elements' `random_bits`); out[lo:hi] (if given) =
    cast(the stored weight)."""
    if p.dtype == torch.bfloat16:
        p[lo:hi] = stochastic_round(pi, master_bits(r))
    elif pi.data_ptr() != p[lo:hi].data_ptr():
        p[lo:hi] = pi
    if out is not None:
        out[lo:hi] = p[lo:hi].to(out.dtype)


# ---- split masters (module docstring) ----------------------------------------------------------------------

_NAN = 0x7FC00000  # the canonical NaN's bits


def _bits(x: Tensor) -> Tensor:
    """x's float32 bits as int64 in [0, 2^32), a NaN the canonical one."""
    u = x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(x.isnan(), _NAN, u)


def _int16(x: Tensor) -> Tensor:
    """int64 values in [0, 2^16) as int16 with the same 16 bits."""
    return (x - (x >= 0x8000).to(torch.int64) * 0x10000).to(torch.int16)


def split(x: Tensor) -> tuple[Tensor, Tensor]:
    """(hi as bfloat16, lo as int16) of float32 `x` (module docstring), both of x's shape.

    >>> x = torch.tensor([1.0, -2.5, 1.00390625, float("nan")])
    >>> hi, lo = split(x)
    >>> join(hi, lo)[:3].tolist(), hi.float().tolist()[:3], bool(join(hi, lo)[3].isnan())
    ([1.0, -2.5, 1.00390625], [1.0, -2.5, 1.0078125], True)
    """
    u = _bits(x)
    return _int16((u + 0x8000) >> 16).view(torch.bfloat16), _int16(u & 0xFFFF)


def split_into(x: Tensor, hi: Tensor, lo: Tensor) -> None:
    """hi[...], lo[...] = split(x) (views of x's shape, written in place)."""
    h, l = split(x)
    hi.copy_(h)
    lo.copy_(l)


def join(hi: Tensor, lo: Tensor) -> Tensor:
    """The float32 value of a split master (a new tensor of hi's shape)."""
    u = (hi.view(torch.int16).to(torch.int64) << 16) + lo.to(torch.int64)
    u = u & 0xFFFFFFFF
    return (u - (u >= 0x80000000).to(torch.int64) * 0x100000000).to(torch.int32).view(torch.float32)


class SplitMasters(Mapping):
    """name -> the float32 value of a split master: a new tensor at each read (a view cannot span two halves), so
    write with `set`, never into what a read returns.

    Args:
        hi, lo: name -> the views of its bf16 halves and of its int16 ones (the parameter's shape).

    >>> m = SplitMasters({"w": torch.zeros(2, dtype=torch.bfloat16)}, {"w": torch.zeros(2, dtype=torch.int16)})
    >>> m.set("w", torch.tensor([1.0, 3.14159])); m["w"].tolist() == torch.tensor([1.0, 3.14159]).tolist()
    True
    """

    def __init__(self, hi: Mapping[str, Tensor], lo: Mapping[str, Tensor]) -> None:
        self.hi, self.lo = dict(hi), dict(lo)

    def __getitem__(self, name: str) -> Tensor:
        return join(self.hi[name], self.lo[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.hi)

    def __len__(self) -> int:
        return len(self.hi)

    def set(self, name: str, value: Tensor) -> None:
        """Write float32 `value` (the parameter's shape, or as many elements) into `name`'s halves."""
        split_into(value.reshape(self.hi[name].shape), self.hi[name], self.lo[name])
