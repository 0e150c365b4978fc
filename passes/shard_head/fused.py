"""The fused linear cross-entropy head: the LM head + loss takes its gradients in its forward, chunk by chunk.

`fused_ce(x, w, b, target, prev, part, chunk, steps, dim, ignore_index)` is
one token shard of the head: tokens [T*i/K, T*(i+1)/K) of the flattened hidden
states (`part` = (i, K)), over the whole vocabulary, `chunk` tokens at a time:

- per chunk: logits = x_c W^T (+ b) and the head's chain (casts, constant
  scales), then one elementwise pass (`ce_chunk`) that gives the chunk's summed
  NLL over its trained tokens and d(NLL sum)/d(logits) = softmax - one-hot
  (zero on ignored tokens), then dX_c = d(logits) W and dW += d(logits)^T x_c
  (db += its column sums): three GEMM passes in all, and the chunk's logits are
  dropped before the next chunk;
- it returns `prev` + the shard's NLL sum (a scalar), so the loss layer
  (`fused_loss`) divides by the trained-token count (mean) or not (sum);
- the backward only scales the gradients it kept by the scalar output's
  gradient: nothing is recomputed. This is exact because a sum (or mean) loss
  hands every token the same output gradient.

Without autograd (an F stage, evaluation) the shard runs the logits GEMM and
the loss only. On CUDA `ce_chunk` runs as one `torch.compile` kernel (one read
of the logits, one write of their gradient); on host workers it runs eagerly.
Cost counting sees the elementwise pass as a `fused_region` (priced as one
kernel for CUDA hardware) and the gradient work as a `grad_region` (counted
with the backward: an F stage does not run it).

    >>> x, w, t = torch.randn(6, 4), torch.randn(9, 4), torch.tensor([1, 2, 3, 4, 5, 6])
    >>> loss = fused_loss(fused_ce(x, w, None, t, None, (0, 1), 4, (), 0, -100), t, -100, "mean", torch.float32)
    >>> torch.allclose(loss, F.cross_entropy(x @ w.t(), t))
    True
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F

from rpcompile.passes.meta.regions import chunk_loop, fused_region, grad_region
from rpcompile.passes.shard_head.chunked import chunk_bounds, same_sizes

__all__ = ["fused_ce", "fused_loss", "ce_chunk", "token_part", "chain_scale"]


def token_part(tokens: int, part: tuple[int, int]) -> tuple[int, int]:
    """[start, stop) of token shard `part` = (i, K) of `tokens` (sizes differ by at most one).

    >>> [token_part(10, (i, 3)) for i in range(3)]
    [(0, 3), (3, 6), (6, 10)]
    """
    i, k = part
    return tokens * i // k, tokens * (i + 1) // k


def chain_scale(steps: tuple) -> float:
    """The constant factor the head's chain applies to the logits (casts are the identity for gradients)."""
    c = 1.0
    for kind, arg in steps:
        c = c * arg if kind in ("mul", "rmul") else c / arg if kind == "div" else c
    return c


def _logits(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, steps: tuple, dim: int) -> torch.Tensor:
    """One chunk's raw logits (the head matmul, in the weight's dtype)."""
    return F.linear(x, w, b) if dim == 0 else torch.matmul(x, w)


def _chained(z: torch.Tensor, steps: tuple) -> torch.Tensor:
    """The chain steps (cast / mul / rmul / div by a constant) applied to raw logits, as the model did."""
    for kind, arg in steps:
        z = z.to(arg) if kind == "cast" else z * arg if kind == "mul" else arg * z if kind == "rmul" else z / arg
    return z


def ce_chunk(raw: torch.Tensor, target: torch.Tensor, steps: tuple, ignore_index: int,
             grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(summed NLL of the chunk's trained tokens in fp32, d(that sum)/d(raw) in raw's dtype, or None).

    The elementwise work of one chunk: what `torch.compile` fuses into one kernel on CUDA.
    """
    z = _chained(raw, steps).float()
    lse = torch.logsumexp(z, -1)
    valid = target != ignore_index
    idx = torch.where(valid, target, 0).unsqueeze(-1)
    nll = torch.where(valid, lse - z.gather(-1, idx).squeeze(-1), 0.0).sum()
    if not grad:
        return nll, None
    p = torch.exp(z - lse.unsqueeze(-1)).scatter_add(-1, idx, torch.full_like(idx, -1, dtype=z.dtype))
    g = torch.where(valid.unsqueeze(-1), p, 0.0) * chain_scale(steps)
    return nll, g.to(raw.dtype)


def _acc_gemm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b in acc's dtype: one GEMM that adds into acc (fp16 / bf16 operands into an fp32 acc on CUDA:
    `addmm(out_dtype=)`); on the CPU, whose kernels have no mixed-dtype GEMM, the product is cast and added."""
    if a.dtype == acc.dtype:
        torch.addmm(acc, a, b, out=acc)
    elif acc.device.type in ("cuda", "meta"):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += (a @ b).to(acc.dtype)


@functools.cache
def _compiled() -> tuple[Callable, threading.Lock]:
    """`ce_chunk` compiled with torch.compile (once per process) and the lock its first calls take.

    Note: the compiled function is a process-wide cache (as torch's own kernel caches are); the lock
    serialises the calls from the worker threads, so dynamo never compiles one graph from two threads
    at once; a call launches one kernel and returns, so the workers hardly wait on it.
    """
    return torch.compile(ce_chunk, dynamic=True), threading.Lock()


def _chunk_fn(raw: torch.Tensor) -> Callable:
    """`ce_chunk` as it runs on raw's device: one compiled kernel on CUDA, eager elsewhere."""
    if raw.device.type != "cuda":
        return ce_chunk
    fn, lock = _compiled()

    def call(*args: Any) -> Any:
        with lock:
            return fn(*args)
    return call


def _forward(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor, a: int, e: int,
             chunk: int, steps: tuple, dim: int, ignore_index: int, grads: tuple[bool, bool, bool]):
    """The chunk loop over tokens [a, e): (NLL sum, dX of [a, e), dW, db) per unit output gradient."""
    need_x, need_w, need_b = grads
    acc = torch.float32 if w.dtype in (torch.float16, torch.bfloat16) else w.dtype
    nll = torch.zeros((), dtype=torch.float32, device=x2.device)
    gx = torch.empty((e - a, x2.shape[-1]), dtype=x2.dtype, device=x2.device) if need_x else None
    gw = torch.zeros(w.shape, dtype=acc, device=w.device) if need_w else None
    gb = torch.zeros(b.shape, dtype=acc, device=b.device) if need_b else None
    fn = _chunk_fn(x2)
    bounds = chunk_bounds(e - a, chunk)
    with chunk_loop() as loop:
        for lo, hi in loop.over(bounds, alike=same_sizes(bounds), meta=x2.is_meta):
            with loop.iteration():
                xc = x2[a + lo:a + hi]
                raw = _logits(xc, w, b, steps, dim)
                with fused_region():
                    part, g = fn(raw, target[a + lo:a + hi], steps, ignore_index, any(grads))
                del raw
                nll += part
                if g is None:
                    continue
                with grad_region():
                    if need_x:
                        gx[lo:hi] = g @ w if dim == 0 else g @ w.t()
                    if need_w:
                        _acc_gemm(gw, *((g.t(), xc) if dim == 0 else (xc.t(), g)))
                    if need_b:
                        gb += g.sum(0, dtype=acc)
    return nll, gx, gw, gb


class _FusedCE(torch.autograd.Function):
    """Autograd of `fused_ce`: the gradients are taken in the forward; the backward scales them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
                prev: torch.Tensor | None, part: tuple[int, int], chunk: int, steps: tuple, dim: int,
                ignore_index: int) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        a, e = token_part(x2.shape[0], part)
        grads = tuple(ctx.needs_input_grad[:3])
        nll, gx, gw, gb = _forward(x2, w, b, target, a, e, chunk, steps, dim, ignore_index, grads)
        ctx.save_for_backward(gx, gw, gb)
        ctx.args = (x.shape, x.dtype, w.dtype, None if b is None else b.dtype, a, e, prev is not None)
        return nll if prev is None else prev + nll

    @staticmethod
    def backward(ctx: Any, go: torch.Tensor):
        gx_part, gw, gb = ctx.saved_tensors
        shape, xdt, wdt, bdt, a, e, has_prev = ctx.args
        gx = None
        if gx_part is not None:
            gx = torch.zeros((shape[:-1].numel(), shape[-1]), dtype=xdt, device=go.device)
            gx[a:e] = gx_part * go.to(xdt)
            gx = gx.view(shape)
        return (gx, None if gw is None else gw.mul_(go).to(wdt), None if gb is None else gb.mul_(go).to(bdt),
                None, go if has_prev else None, None, None, None, None, None)


def fused_ce(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
             prev: torch.Tensor | None, part: tuple[int, int], chunk: int, steps: tuple, dim: int,
             ignore_index: int) -> torch.Tensor:
    """`prev` + the summed cross-entropy of token shard `part`, its gradients taken in the forward (module doc).

    Args:
        x: hidden states (..., H); its leading dims flatten to the T tokens of `target`.
        w, b: the head weight (V, H) if `dim` is 0 (`F.linear`), (H, V) if `dim` is 1 (`x @ w`); the bias or None.
        target: (T,) token ids, `ignore_index` where nothing is trained.
        prev: the previous token shards' NLL sum (a scalar), or None for the first.
        part: (i, K): this shard's tokens are [T*i//K, T*(i+1)//K).
        chunk: tokens per chunk.
        steps: the head's chain as ("cast", dtype) / ("mul", c) / ("rmul", c) / ("div", c).
        dim: the vocabulary dim of `w`.
        ignore_index: targets that count for nothing.
    Returns:
        A scalar fp32 tensor. Its gradient must be a scalar for every token (a sum or mean loss).

    >>> x, w, t = torch.randn(6, 4), torch.randn(9, 4), torch.tensor([1, 2, -100, 4, 5, 6])
    >>> s = fused_ce(x, w, None, t, None, (0, 2), 2, (), 0, -100)
    >>> s = fused_ce(x, w, None, t, s, (1, 2), 2, (), 0, -100)
    >>> torch.allclose(s, F.cross_entropy(x @ w.t(), t, reduction="sum"))
    True
    """
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, b, prev)):
        return _FusedCE.apply(x, w, b, target, prev, part, chunk, steps, dim, ignore_index)
    x2 = x.reshape(-1, x.shape[-1])
    a, e = token_part(x2.shape[0], part)
    nll = _forward(x2, w, b, target, a, e, chunk, steps, dim, ignore_index, (False, False, False))[0]
    return nll if prev is None else prev + nll


def fused_loss(total: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
               dtype: torch.dtype) -> torch.Tensor:
    """The cross-entropy from the token shards' NLL sum, as `F.cross_entropy(..., reduction=)` gives it (mean, sum)."""
    if reduction == "mean":
        total = total / (target != ignore_index).sum()
    return total.to(dtype)
