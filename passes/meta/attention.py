"""Attention in predict mode: SDPA on `meta` runs (and is priced) as the fused flash kernel.

`F.scaled_dot_product_attention` picks its kernel by device. On CPU and CUDA it
runs one fused op (`_scaled_dot_product_flash_attention_for_cpu`, or the CUDA
flash / memory-efficient kernels) whose forward saves only q, k, v, the output
and the log-sum-exp, so its memory is linear in S. On `meta` there is no fused
kernel and torch falls back to the math path, which materialises the S x S
scores in fp32: counting that would price an algorithm the runtime never runs.
`FlashOnMeta` (a TorchFunctionMode active while predict mode counts a layer)
sends SDPA calls on meta or fake tensors to the CPU flash op instead, which has
meta kernels for forward and backward; a boolean mask is first converted to an
additive one exactly as SDPA does before any fused kernel.

FLOPs of every fused attention op come from `attention_flops` (the flash
count): forward 2 * B * H * E * (D + Dv), where E is the number of (query, key)
pairs the kernel scores: Sq * Sk, or with `is_causal` only the pairs on or
below the diagonal (sum over queries i of min(i + 1, Sk)), about half. The
backward re-computes the scores and forms dV, dP, dQ and dK:
2 * B * H * E * (3 * D + 2 * Dv), i.e. 2.5x the forward. Bytes are what the
op reads and writes (q, k, v, mask if any, output, logsumexp, and the
gradients in the backward), counted by the recorder like any op.

    >>> q = torch.empty(1, 2, 8, 4, device="meta")
    >>> with FlashOnMeta():
    ...     F.scaled_dot_product_attention(q, q, q, is_causal=True).shape
    torch.Size([1, 2, 8, 4])
"""
from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["FlashOnMeta", "attention_flops", "FLOP_RULES"]

_aten = torch.ops.aten


def _scored_pairs(sq: int, sk: int, causal: bool) -> int:
    """(query, key) pairs a kernel scores: all of them, or with top-left causal masking those with key <= query."""
    if not causal:
        return sq * sk
    if sq <= sk:
        return sq * (sq + 1) // 2
    return sk * (sk + 1) // 2 + (sq - sk) * sk


def attention_flops(q_shape: tuple, k_shape: tuple, v_shape: tuple, causal: bool, backward: bool = False) -> int:
    """Flash-attention FLOPs of one fused SDPA call (see module docstring).

    Args:
        q_shape, k_shape, v_shape: (B, H, S, D) shapes (k and v may have fewer heads: GQA).
        causal: `is_causal`; only the pairs on or below the diagonal are scored.
        backward: the backward's FLOPs (scores recomputed, then dV, dP, dQ, dK).
    Returns:
        The FLOP count (an int).

    >>> attention_flops((1, 1, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8), causal=True)
    320
    """
    *batch, sq, d = q_shape
    sk, dv = k_shape[-2], v_shape[-1]
    bh = math.prod(batch)
    pairs = _scored_pairs(sq, sk, causal)
    return 2 * bh * pairs * ((3 * d + 2 * dv) if backward else (d + dv))


def _causal_kw(args: tuple, kwargs: dict, pos: int) -> bool:
    """The `is_causal` argument of an aten attention op (positional index `pos` or keyword)."""
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    return bool(args[pos]) if len(args) > pos and isinstance(args[pos], bool) else False


def _fwd_rule(causal_pos: int) -> Callable[..., int]:
    """FLOP rule for a forward fused attention op whose `is_causal` is positional arg `causal_pos`."""
    def rule(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        q, k, v = args[:3]
        return attention_flops(tuple(q.shape), tuple(k.shape), tuple(v.shape), _causal_kw(args, kwargs, causal_pos))
    return rule


def _bwd_rule(qkv_pos: int, causal_pos: int) -> Callable[..., int]:
    """FLOP rule for a fused attention backward op: q, k, v at args[qkv_pos:qkv_pos + 3]."""
    def rule(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        q, k, v = args[qkv_pos:qkv_pos + 3]
        return attention_flops(tuple(q.shape), tuple(k.shape), tuple(v.shape), _causal_kw(args, kwargs, causal_pos),
                               backward=True)
    return rule


# aten overload packet -> FLOP rule(*args, out_val=..., **kwargs); these take precedence over torch's
# flop_registry, which counts every (query, key) pair even with is_causal and no score recompute in backward
FLOP_RULES = MappingProxyType({
    _aten._scaled_dot_product_flash_attention_for_cpu: _fwd_rule(4),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _bwd_rule(1, 7),
    _aten._scaled_dot_product_flash_attention: _fwd_rule(4),
    _aten._scaled_dot_product_flash_attention_backward: _bwd_rule(1, 11),
    _aten._scaled_dot_product_efficient_attention: _fwd_rule(6),
    _aten._scaled_dot_product_efficient_attention_backward: _bwd_rule(1, 11),
    _aten._scaled_dot_product_cudnn_attention: _fwd_rule(6),
    _aten._scaled_dot_product_cudnn_attention_backward: _bwd_rule(1, 14),
})


def _is_meta_like(t: Any) -> bool:
    """True for meta tensors and fake tensors (both have meta storage)."""
    if not isinstance(t, torch.Tensor):
        return False
    if t.is_meta:
        return True
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


def _flash_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False) -> torch.Tensor:
    """SDPA as the fused CPU flash op (GQA native; a bool mask converted as SDPA converts it)."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        zero = torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device)
        ninf = torch.scalar_tensor(-math.inf, dtype=query.dtype, device=query.device)
        attn_mask = torch.where(attn_mask, zero, ninf)
    kwargs = {"attn_mask": attn_mask} if attn_mask is not None else {}
    if scale is not None:
        kwargs["scale"] = scale
    return _aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, **kwargs)[0]


class FlashOnMeta(TorchFunctionMode):
    """While active, SDPA on meta/fake tensors runs as the fused flash op (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args and _is_meta_like(args[0]):
            return _flash_sdpa(*args, **kwargs)
        return func(*args, **kwargs)
