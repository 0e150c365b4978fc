"""Attention-mask creation on the meta device: the decisions transformers takes from data, taken from shapes.

Hugging Face's `masking_utils` decides from tensor values whether a mask is
needed: it looks for packed sequences in the position ids and for padding in
the [B, S] attention mask. On `meta` those values do not exist (and on fake
tensors it assumes it is being compiled and always builds the S x S mask,
which the real run does not). While predict mode counts a layer,
`meta_masks()` answers both questions from what is known without data:

- position ids on meta or fake tensors hold no packed sequences (positions
  0..S-1 per sequence, as the traced model computes them);
- a padding mask on meta or fake tensors pads, so the (B, 1, S, S) mask is
  built: a model given an attention mask is priced with it.

Real tensors go to the original functions, so a runtime using the model at
the same time is unaffected.

    >>> with meta_masks():
    ...     pass
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

from rpcompile.passes.meta.attention import _is_meta_like

__all__ = ["meta_masks"]


@contextlib.contextmanager
def meta_masks() -> Iterator[None]:
    """Within the block, transformers' mask creation takes its data-dependent decisions as the module says."""
    mu = sys.modules.get("transformers.masking_utils")
    if mu is None or not hasattr(mu, "find_packed_sequence_indices") or not hasattr(mu, "_ignore_causal_mask_sdpa"):
        yield
        return
    find, ignore = mu.find_packed_sequence_indices, mu._ignore_causal_mask_sdpa

    def find_packed(position_ids: Any) -> Any:
        return None if _is_meta_like(position_ids) else find(position_ids)

    def ignore_mask(padding_mask: Any, *args: Any, **kwargs: Any) -> bool:
        if padding_mask is not None and _is_meta_like(padding_mask):
            return False
        return ignore(padding_mask, *args, **kwargs)

    mu.find_packed_sequence_indices, mu._ignore_causal_mask_sdpa = find_packed, ignore_mask
    try:
        yield
    finally:
        mu.find_packed_sequence_indices, mu._ignore_causal_mask_sdpa = find, ignore
