"""Attention that stops at packed-document boundaries, with memory linear in the sequence length.

Packed fine-tuning puts several documents back to back in one row; each
document's `position_ids` restart at 0. Attention must not cross from one
document into another. Ways to do it, and why this module does what it does:

- a block-diagonal (B, 1, S, S) mask (what transformers' own "sdpa" path builds
  when it sees packed `position_ids` and no padding mask): exact, but S^2 bytes
  per row rebuilt in every layer, and the fused SDPA kernels fall back to
  slower masked ones; its memory is quadratic, so `max_seq_len` would be false;
- flex attention's block masks: linear memory, but only fast under
  `torch.compile`, which the host and CUDA runtimes do not use;
- flash-attention's varlen kernel (`flash_attn_varlen_func`, transformers'
  "flash_attention_2"): the ideal, but a CUDA-only optional package;
- **chosen: varlen by a loop.** `packed_sdpa` finds each row's document starts
  (where a position is not the previous one + 1, transformers' own rule, so a
  restart at 0 starts a document) and runs one causal
  `F.scaled_dot_product_attention` (`is_causal=True`, no mask) per document:
  exact, the fused flash / memory-efficient kernels on every device, memory
  linear in S (each call saves only its q, k, v, output and log-sum-exp), and
  no (query, key) pair across documents is even scored. The outputs are
  written by one `torch.cat`, so the activation bytes equal one whole-row call.
  When all rows have the same document starts (batch 1, or the position ids
  given once), each document is one call over the whole batch; otherwise
  one call per row and document.

On meta or fake tensors (predict mode, `max_seq_len`) the document starts are
unknown, so one causal SDPA over the whole row runs instead: the
single-document worst case, so the predicted time and memory bound what any
packing of that length costs. In measure mode (real tensors) the recorder sees
the per-document SDPA calls, each priced as the flash op (`passes.meta.attention`).

`use_packed_attention(model)` registers the attention under `NAME` (with a
mask function that builds no S x S mask unless a padding mask is given) and
switches the model to it. The model must hand `position_ids` to its attention
function, as transformers' Llama-family models do (Llama, Mistral, Qwen2/3,
...: the decoder layer passes them through `**kwargs`). Without them the
function warns and attends over the whole row.

    >>> import torch
    >>> q = torch.randn(1, 2, 5, 8)
    >>> pos = torch.tensor([[0, 1, 2, 0, 1]])
    >>> packed_sdpa(q, q, q, pos).shape
    torch.Size([1, 5, 2, 8])
"""
from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from rpcompile.models.attention import NAME as SINKS_NAME
from rpcompile.models.attention import sdpa_with_sinks
from rpcompile.passes.meta.attention import _is_meta_like
from rpcompile.passes.trace.tracer import leaf_function

__all__ = ["NAME", "packed_sdpa", "packed_attention_forward", "packed_mask", "register", "use_packed_attention",
           "document_starts"]

NAME = "rpcompile_packed"  # must not contain "sdpa": transformers would check its own SDPA support


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) bool: True where a document starts (first token, or a position that is not the previous + 1).

    >>> document_starts(torch.tensor([[0, 1, 2, 0, 1]])).tolist()
    [[True, False, False, True, False]]
    """
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def _segments(position_ids: torch.Tensor, batch: int) -> list[list[tuple[int, int]]] | None:
    """Each row's documents as [(start, end), ...] (one host sync); a single list if all rows share them."""
    starts = document_starts(position_ids).cpu()
    seq = starts.shape[1]
    rows = []
    for row in starts.tolist():
        at = [i for i, st in enumerate(row) if st]
        rows.append(list(zip(at, [*at[1:], seq])))
    return rows if len(rows) > 1 and any(r != rows[0] for r in rows) else [rows[0]]


def _whole_row(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, dropout: float,
               scaling: float | None, groups: int, causal: bool, s_aux: Any) -> torch.Tensor:
    """Attention over the whole row, as transformers' "sdpa" (or the sinks function) computes it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    module = SimpleNamespace(num_key_value_groups=groups, is_causal=causal)
    if s_aux is not None:
        return sdpa_with_sinks(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                               s_aux=s_aux)[0]
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)[0]


def _packed_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position_ids: torch.Tensor | None,
                 attention_mask: torch.Tensor | None = None, dropout: float = 0.0, scaling: float | None = None,
                 groups: int = 1, causal: bool = True, s_aux: torch.Tensor | None = None) -> torch.Tensor:
    """`packed_sdpa` itself (the traced leaf)."""
    b, h, s, d = query.shape
    hkv, sk, dv = key.shape[1], key.shape[2], value.shape[-1]
    if (position_ids is None or not causal or sk != s or _is_meta_like(query) or _is_meta_like(position_ids)
            or tuple(position_ids.shape) not in ((b, s), (1, s))):
        return _whole_row(query, key, value, attention_mask, dropout, scaling, groups, causal, s_aux)
    if s_aux is None and hkv != h:  # grouped-query attention, as transformers' SDPA path does it
        if attention_mask is None and d == dv <= 256:
            gqa = True
        else:
            key, value, gqa = key.repeat_interleave(h // hkv, dim=1), value.repeat_interleave(h // hkv, dim=1), False
    else:
        gqa = False
    plan = _segments(position_ids, b)
    rows = [slice(None)] if len(plan) == 1 else [slice(r, r + 1) for r in range(b)]
    pieces: list[torch.Tensor] = []  # (rows, L, H, Dv) per document, rows in order
    for idx, segs in zip(rows, plan):
        m_r = None if attention_mask is None else attention_mask[idx] if attention_mask.shape[0] == b \
            else attention_mask
        for lo, hi in segs:
            q, k, v = query[idx, :, lo:hi], key[idx, :, lo:hi], value[idx, :, lo:hi]
            m = None if m_r is None else m_r[..., lo:hi, lo:hi]
            if s_aux is not None:
                out = sdpa_with_sinks(None, q, k, v, m, dropout=dropout, scaling=scaling, s_aux=s_aux)[0]
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout, is_causal=m is None,
                                                     scale=scaling, enable_gqa=gqa).transpose(1, 2)
            pieces.append(out)
    if len(plan) == 1:  # every row alike: join the documents along the sequence
        return torch.cat(pieces, dim=1)
    return torch.cat([p[0] for p in pieces], dim=0).view(b, s, h, dv)  # rows one after another, one copy


packed_sdpa = leaf_function(_packed_sdpa)
packed_sdpa.__doc__ = """Causal attention within each packed document: one SDPA call per document (see module docstring).

    Args:
        query, key, value: (B, H, S, D), (B, Hkv, S, D), (B, Hkv, S, Dv).
        position_ids: (B, S) or (1, S); a document starts where a position is not the previous + 1.
            None, meta/fake tensors, or keys longer than queries: one call over the whole row.
        attention_mask: None, or a (B or 1, 1, S, S) mask (padding): each document uses its diagonal block.
        dropout, scaling: as transformers passes them.
        groups: query heads per key/value head (grouped-query attention).
        causal: False runs one non-causal call over the whole row (an encoder: no packing).
        s_aux: GPT-OSS attention-sink logits (H,), or None (`rpcompile.models.attention.sdpa_with_sinks`).
    Returns:
        The attention output, (B, S, H, Dv), contiguous.

    An fx leaf: traced with proxies, it records one call_function node, so its data-dependent loop
    runs when the graph runs.

    >>> q = torch.randn(1, 2, 5, 8)
    >>> packed_sdpa(q, q, q, torch.tensor([[0, 1, 2, 0, 1]])).shape
    torch.Size([1, 5, 2, 8])
"""


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             position_ids: torch.Tensor | None = None, s_aux: torch.Tensor | None = None,
                             is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function (registered as `NAME`): `packed_sdpa` with the module's settings.

    Args:
        module: the attention module (`num_key_value_groups`, `is_causal`).
        query, key, value, attention_mask, dropout, scaling: as transformers passes them.
        position_ids: the (B, S) positions the decoder layer passes in kwargs (Llama family).
        s_aux: attention-sink logits (GPT-OSS), if the model has them.
        is_causal: overrides `module.is_causal`, as in transformers' SDPA function.
    Returns:
        (attention output (B, S, H, Dv), None), like transformers' `sdpa_attention_forward`.

    >>> q = torch.randn(1, 2, 5, 8)
    >>> packed_attention_forward(torch.nn.Module(), q, q, q, None, position_ids=torch.tensor([[0, 1, 0, 1, 2]]))[0].shape
    torch.Size([1, 5, 2, 8])
    """
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if position_ids is None and causal:
        warnings.warn(f"{NAME}: the model passes no position_ids to its attention function, so packed documents "
                      f"are not kept apart (attention runs over the whole row)", stacklevel=2)
    out = packed_sdpa(query, key, value, position_ids, attention_mask, dropout=dropout, scaling=scaling,
                      groups=int(getattr(module, "num_key_value_groups", 1)), causal=causal, s_aux=s_aux)
    return out, None


def packed_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask function registered under `NAME`: no mask for a plain causal (packed or not) row.

    transformers builds a block-diagonal S x S mask when it detects packing; `packed_sdpa` keeps
    documents apart itself, so without a padding mask this returns None (causality comes from
    `is_causal`). With a padding mask, a sliding window or chunk (`local_size`), a bidirectional
    mask, a custom mask function (`use_vmap`) or queries shorter than keys (a KV cache) it is
    transformers' `sdpa_mask`, and `packed_sdpa` applies each document's diagonal block of it.

    >>> packed_mask(batch_size=1, q_length=4, kv_length=4, attention_mask=None) is None
    True
    """
    from transformers.masking_utils import sdpa_mask
    plain = (kwargs.get("attention_mask") is None and kwargs.get("local_size") is None
             and "allow_is_bidirectional_skip" not in kwargs and not kwargs.get("use_vmap", False)
             and not args and kwargs.get("q_length") == kwargs.get("kv_length")
             and not kwargs.get("q_offset", 0) and not kwargs.get("kv_offset", 0))
    return None if plain else sdpa_mask(*args, **kwargs)


def register() -> str:
    """Register `packed_attention_forward` and `packed_mask` with transformers under `NAME`; returns NAME. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(NAME, packed_attention_forward)
    AttentionMaskInterface.register(NAME, packed_mask)
    return NAME


def use_packed_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switch a transformers model to packed-document attention (`NAME`); returns the model.

    Call it before `rpcompile.compile` when batches pack several documents per row with
    `position_ids` restarting at 0 at each document start. Works for models that use
    transformers' attention interface and pass `position_ids` to it (the Llama family); the
    GPT-OSS sink attention (`rpcompile.models.attention`) is kept, per document.

    Raises:
        ValueError: the model does not use transformers' attention interface, or its attention
            is one that packing cannot follow (flash / flex kernels: use their own varlen paths).

    >>> use_packed_attention(llama).config._attn_implementation   # doctest: +SKIP
    'rpcompile_packed'
    """
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if config is None or can_set is None or not can_set():
        raise ValueError(f"{type(model).__name__} does not use transformers' attention interface; "
                         f"packed documents cannot be kept apart by use_packed_attention")
    if current not in (None, "eager", "sdpa", SINKS_NAME, NAME):
        raise ValueError(f"{type(model).__name__} uses attention {current!r}; use_packed_attention replaces only "
                         f"'eager', 'sdpa' or {SINKS_NAME!r}")
    register()
    for mod in model.modules():  # every sub-config (a composite model's text model) and the model's own
        cfg = getattr(mod, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = NAME
    return model
