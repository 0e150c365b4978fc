"""Memory-efficient attention for transformers models that have no SDPA path (attention sinks).

GPT-OSS adds a learned per-head "sink" logit to every softmax row and its
transformers code supports only eager attention, whose (B, H, S, S) scores
make long sequences impossible. `sdpa_with_sinks` computes the same attention
with one fused `F.scaled_dot_product_attention` call, so its memory is linear
in S without a mask (and the flash kernel runs on CUDA):

- a sink is a key that every query sees and whose value is zero. It is
  prepended to the keys; one extra head-dim channel carries it: the sink key is
  1 there, real keys 0, and query head h holds `sink_h / scale`, so the sink's
  score is exactly `sink_h` and every other score is unchanged;
- to keep `is_causal` exact, a zero query is prepended too (its output row is
  dropped): query i + 1 then sees the sink and keys 0..i;
- head dims are padded to a multiple of 8 (the fused kernels' alignment);
- a mask (padding or a sliding window, from transformers' `sdpa_mask`) gets the
  sink column and the dummy row added.

`register()` adds it to transformers' attention and mask registries under
`NAME`; `rpcompile.models.presets.build_meta` uses it for models without SDPA.

    >>> register()
    'rpcompile_attention'
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["NAME", "sdpa_with_sinks", "register"]

NAME = "rpcompile_attention"  # must not contain "sdpa": transformers would check its own SDPA support


def sdpa_with_sinks(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention function: softmax(q k^T * scale, with sinks) v through one SDPA call.

    Args:
        module: the attention module (`num_key_value_groups` > 1 means grouped-query attention).
        query, key, value: (B, H, S, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv).
        attention_mask: None (causal) or a (B, 1, S, Sk) bool / additive mask that includes causality.
        dropout, scaling: as transformers passes them.
        s_aux: per-query-head sink logits (H,), or None (then this is plain SDPA).
    Returns:
        (attention output (B, S, H, Dv), None), like transformers' `sdpa_attention_forward`.

    Example:
        >>> q = torch.randn(1, 2, 5, 8)
        >>> sdpa_with_sinks(torch.nn.Module(), q, q, q, None, s_aux=torch.zeros(2))[0].shape
        torch.Size([1, 5, 2, 8])
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if s_aux is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, h, s, d = query.shape
    hkv, dv = key.shape[1], value.shape[-1]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    width = 8 * math.ceil((max(d, dv) + 1) / 8)  # channel `d` carries the sink; padded for the fused kernels
    sink_q = (s_aux.to(query.dtype) / scale).view(1, h, 1, 1).expand(b, h, s, 1)
    q = F.pad(torch.cat([query, sink_q], dim=-1), (0, width - d - 1, 1, 0))  # + dummy query row 0
    sink_k = torch.zeros(width, dtype=key.dtype, device=key.device)
    sink_k[d] = 1.0
    k = torch.cat([sink_k.expand(b, hkv, 1, width), F.pad(key, (0, width - d))], dim=2)  # + sink key row 0
    v = F.pad(value, (0, width - dv, 1, 0))  # the sink's value is zero
    gqa = hkv != h
    if gqa and attention_mask is not None:  # as transformers' SDPA path: fused masked kernels need equal heads
        k, v, gqa = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1), False
    if attention_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale,
                                             enable_gqa=gqa)
    else:
        see = True if attention_mask.dtype == torch.bool else 0.0
        mask = F.pad(attention_mask, (1, 0, 1, 0), value=see)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale,
                                             enable_gqa=gqa)
    return out[:, :, 1:, :dv].transpose(1, 2).contiguous(), None


def register() -> str:
    """Register `sdpa_with_sinks` (and transformers' SDPA masks) under `NAME`; returns NAME. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(NAME, sdpa_with_sinks)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
