"""The kernels of `shard_lm_head`'s layers: a vocabulary shard of the LM head + loss, run in token chunks.

`chunked_lse(x, w, b, target, lo, chunk, steps, dim, m, s, t)` folds the
logits of vocabulary rows [lo, lo + Vk) into the online log-sum-exp statistics
(running max `m`, sum of exponentials `s`, target logit `t`; `lse_update`),
`chunk` tokens at a time, so the largest logits
tensor that ever exists is chunk x Vk, whatever the sequence length:

- forward: per chunk, logits = x_c W^T (+ b), then the head's chain (casts,
  constant scales), then the statistics of those tokens; no logits are kept;
- backward: per chunk, the logits are recomputed and autograd differentiates
  the chunk's statistics with respect to x_c, W, b and the incoming `s`; x's
  gradient is written chunk by chunk, W's and b's are summed over the chunks
  (in fp32 when W is a low-precision type).

Both loops are `chunk_loop`s, which cost counting folds into one op per loop
position. Chunks are balanced: ceil(T / chunk) chunks whose sizes differ by at
most one token. `lse_loss` turns the statistics into the cross-entropy in the
loss layer; a shard reads its rows of W through `vocab_slice`.

    >>> x, w = torch.randn(5, 3), torch.randn(7, 3)
    >>> m, s, t = chunked_lse(x, w, None, torch.arange(5), 0, 2, (), 0)
    >>> torch.allclose(m + s.log() - t, F.cross_entropy(x @ w.t(), torch.arange(5), reduction="none"))
    True
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rpcompile.passes.meta.regions import chunk_loop

__all__ = ["chunked_lse", "chunk_bounds", "lse_update", "lse_loss", "same_sizes", "vocab_slice"]


def chunk_bounds(tokens: int, chunk: int) -> list[tuple[int, int]]:
    """[start, stop) of ceil(tokens / chunk) balanced chunks (sizes differ by at most one).

    >>> chunk_bounds(10, 4)
    [(0, 3), (3, 6), (6, 10)]
    """
    n = max(1, -(-tokens // max(1, chunk)))
    cuts = [tokens * i // n for i in range(n + 1)]
    return list(zip(cuts, cuts[1:]))


def same_sizes(bounds: list[tuple[int, int]]) -> bool:
    """Whether every chunk has the same size (then every iteration of a chunk loop runs the same ops).

    >>> same_sizes(chunk_bounds(12, 4)), same_sizes(chunk_bounds(10, 4))
    (True, False)
    """
    return len({e - a for a, e in bounds}) <= 1


def _logits(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, steps: tuple, dim: int) -> torch.Tensor:
    """One chunk's logits: the head matmul then the chain steps (cast / mul / rmul / div by a constant)."""
    z = F.linear(x, w, b) if dim == 0 else torch.matmul(x, w)
    for kind, arg in steps:
        if kind == "cast":
            z = z.to(arg)
        elif kind == "mul":
            z = z * arg
        elif kind == "rmul":
            z = arg * z
        elif kind == "div":
            z = z / arg
        else:
            raise ValueError(f"chunked_lse: unknown chain step {kind!r}")
    return z


def vocab_slice(w: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """`w.narrow(dim, start, stop - start)`, or `w` itself if it already is that slice (see module note)."""
    return w if w.shape[dim] == stop - start else w.narrow(dim, start, stop - start)


def lse_update(z: torch.Tensor, target: torch.Tensor, lo: int, m: torch.Tensor | None = None,
               s: torch.Tensor | None = None, t: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one shard's logits z (tokens, Vk) for vocab ids [lo, lo+Vk) into (max, sum exp, target logit)."""
    z = z.float()
    mk = z.detach().amax(-1) if m is None else torch.maximum(m, z.detach().amax(-1))
    sk = torch.exp(z - mk.unsqueeze(-1)).sum(-1) + (0.0 if s is None else s * torch.exp(m - mk))
    hit = (target >= lo) & (target < lo + z.shape[-1])
    idx = (target - lo).clamp(0, z.shape[-1] - 1)
    tk = torch.where(hit, z.gather(-1, idx.unsqueeze(-1)).squeeze(-1), 0.0)
    return mk, sk, tk if t is None else t + tk


def lse_loss(m: torch.Tensor, s: torch.Tensor, t: torch.Tensor, target: torch.Tensor, ignore_index: int,
             reduction: str, dtype: torch.dtype) -> torch.Tensor:
    """Cross-entropy from online log-sum-exp statistics, as `F.cross_entropy(..., reduction=)` would give."""
    valid = target != ignore_index
    nll = torch.where(valid, m + torch.log(s) - t, 0.0)
    return (nll.sum() / valid.sum() if reduction == "mean" else nll.sum() if reduction == "sum" else nll).to(dtype)


class _ChunkedLSE(torch.autograd.Function):
    """Autograd of `chunked_lse`: nothing vocabulary-sized is saved; backward recomputes per chunk."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
                m: torch.Tensor | None, s: torch.Tensor | None, t: torch.Tensor | None, lo: int, chunk: int,
                steps: tuple, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x2 = x.reshape(-1, x.shape[-1])
        tokens = x2.shape[0]
        out = [torch.empty(tokens, dtype=torch.float32, device=x.device) for _ in range(3)]
        bounds = chunk_bounds(tokens, chunk)
        with chunk_loop() as loop:
            for a, e in loop.over(bounds, alike=same_sizes(bounds), meta=x.is_meta):
                with loop.iteration():
                    z = _logits(x2[a:e], w, b, steps, dim)
                    part = lse_update(z, target[a:e], lo, *(None if v is None else v[a:e] for v in (m, s, t)))
                    for o, p in zip(out, part):
                        o[a:e] = p
        ctx.save_for_backward(x, w, b, target, m, s)
        ctx.args = (lo, chunk, steps, dim, t is not None)
        ctx.mark_non_differentiable(out[0])
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, gm: torch.Tensor, gs: torch.Tensor, gt: torch.Tensor):
        x, w, b, target, m, s = ctx.saved_tensors
        lo, chunk, steps, dim, has_t = ctx.args
        need_x, need_w, need_b, _, _, need_s = ctx.needs_input_grad[:6]
        x2 = x.reshape(-1, x.shape[-1])
        acc = torch.float32 if w.dtype in (torch.float16, torch.bfloat16) else w.dtype
        gx = torch.zeros_like(x2) if need_x else None
        gw = torch.zeros(w.shape, dtype=acc, device=w.device) if need_w else None
        gb = torch.zeros(b.shape, dtype=acc, device=b.device) if need_b else None
        g_s = torch.empty_like(s) if need_s else None
        wl = w.detach().requires_grad_(need_w)
        bl = None if b is None else b.detach().requires_grad_(need_b)
        bounds = chunk_bounds(x2.shape[0], chunk)
        with chunk_loop() as loop:
            for a, e in loop.over(bounds, alike=same_sizes(bounds), meta=x.is_meta):
                with loop.iteration(), torch.enable_grad():
                    xc = x2[a:e].detach().requires_grad_(need_x)
                    sc = None if s is None else s[a:e].detach().requires_grad_(need_s)
                    z = _logits(xc, wl, bl, steps, dim)
                    _, sk, tk = lse_update(z, target[a:e], lo, None if m is None else m[a:e], sc, None)
                    wrt = [v for v, need in ((xc, need_x), (wl, need_w), (bl, need_b), (sc, need_s)) if need]
                    grads = iter(torch.autograd.grad([sk, tk], wrt, [gs[a:e], gt[a:e]], allow_unused=True))
                    for buf, need in ((gx, need_x), (gw, need_w), (gb, need_b), (g_s, need_s)):
                        if need:
                            g = next(grads)
                            if g is None:
                                continue
                            if buf is gx or buf is g_s:
                                buf[a:e] = g
                            else:
                                buf += g
        return (None if gx is None else gx.view(x.shape), None if gw is None else gw.to(w.dtype),
                None if gb is None else gb.to(b.dtype), None, None, g_s, gt if has_t else None,
                None, None, None, None)


def chunked_lse(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor, lo: int,
                chunk: int, steps: tuple, dim: int, m: torch.Tensor | None = None, s: torch.Tensor | None = None,
                t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one vocabulary shard's logits into (max, sum exp, target logit), `chunk` tokens at a time.

    Args:
        x: hidden states (..., H); its leading dims flatten to the T tokens of `target`.
        w, b: the shard's rows of the head weight (Vk, H) if `dim` is 0 (`F.linear`), its columns
            (H, Vk) if `dim` is 1 (`x @ w`); the bias slice or None.
        target: (T,) token ids; `lo`: the shard's first vocabulary id.
        chunk: tokens per chunk.
        steps: the head's chain as ("cast", dtype) / ("mul", c) / ("rmul", c) / ("div", c).
        m, s, t: the previous shards' statistics (T,), or None for the first shard.
    Returns:
        (m, s, t) including this shard, fp32; `m` carries no gradient.
    """
    return _ChunkedLSE.apply(x, w, b, target, m, s, t, lo, chunk, steps, dim)
