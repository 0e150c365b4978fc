"""Mixture-of-experts blocks on the meta device: balanced routing instead of data-dependent dispatch.

A Hugging Face experts module (`Qwen3MoeExperts`, `GptOssExperts`, ...) picks
the tokens of each expert with `nonzero`/`where`, which cannot run on `meta`.
For shapes and FLOP counts we only need what an average step does: with T
tokens routed to K of E experts each, every expert sees ceil(T*K/E) tokens.
Inside `balanced_experts(model)` such modules compute exactly that: one batched
matmul per projection over all experts, output shaped like the input, with a
gradient path to every parameter and to the routing weights.

    >>> import torch
    >>> with balanced_experts(torch.nn.Linear(2, 2)):  # no experts module: nothing changes
    ...     pass
"""
from __future__ import annotations

import contextlib
import types
from typing import Iterator

import torch
import torch.nn.functional as F


def _is_experts(m: torch.nn.Module) -> bool:
    """True for modules holding stacked expert weights `gate_up_proj` and `down_proj` (E, ., .)."""
    gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return (isinstance(gu, torch.nn.Parameter) and isinstance(dn, torch.nn.Parameter)
            and gu.dim() == 3 and dn.dim() == 3 and gu.shape[0] == dn.shape[0])


def _project(x: torch.Tensor, w: torch.Tensor, in_features: int) -> torch.Tensor:
    """x (E, n, in) times stacked weights stored as (E, out, in) or (E, in, out)."""
    return x @ (w if w.shape[1] == in_features and w.shape[2] != in_features else w.transpose(1, 2))


def _balanced_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                      top_k_weights: torch.Tensor | None = None, *args, **kwargs) -> torch.Tensor:
    """Every expert processes ceil(T*K/E) tokens; returns a (T, H) tensor like the real forward."""
    experts, tokens, hidden = self.gate_up_proj.shape[0], hidden_states.shape[0], hidden_states.shape[-1]
    k = top_k_index.shape[-1] if top_k_index is not None else 1
    n = max(1, min(tokens, -(-tokens * k // experts)))
    x = hidden_states[:n].unsqueeze(0).expand(experts, n, hidden)
    gate_up = _project(x, self.gate_up_proj, hidden)
    if getattr(self, "gate_up_proj_bias", None) is not None:
        gate_up = gate_up + self.gate_up_proj_bias.unsqueeze(1)
    gate, up = gate_up.chunk(2, dim=-1)
    y = _project(F.silu(gate) * up, self.down_proj, gate.shape[-1])
    if getattr(self, "down_proj_bias", None) is not None:
        y = y + self.down_proj_bias.unsqueeze(1)
    weight = top_k_weights.sum(-1, keepdim=True) if top_k_weights is not None else 1.0
    return hidden_states * 0 + y.mean(dim=(0, 1)) * weight


@contextlib.contextmanager
def balanced_experts(model: torch.nn.Module) -> Iterator[int]:
    """Within the block, every experts module of `model` routes tokens evenly; yields how many were patched."""
    patched = [m for m in model.modules() if _is_experts(m)]
    for m in patched:
        m.forward = types.MethodType(_balanced_forward, m)
    try:
        yield len(patched)
    finally:
        for m in patched:
            del m.forward
