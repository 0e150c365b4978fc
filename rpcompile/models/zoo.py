"""A small Llama-style causal LM in plain PyTorch (no transformers needed).

Used by the demo and the examples: RMSNorm, rotary position embeddings,
grouped-query causal attention (`F.scaled_dot_product_attention(...,
is_causal=True)` by default, so no S x S tensor exists outside the fused
kernel; `attention="eager"` keeps the explicit softmax), SwiGLU MLP, an untied
LM head, and the next-token cross-entropy loss computed inside `forward` (the
labels are shifted, as transformers does, so `shard_lm_head` can cut it).

    >>> cfg = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=64)
    >>> m = TinyLlama(cfg)
    >>> ids = torch.randint(0, 64, (2, 8))
    >>> m(ids, ids).shape
    torch.Size([])
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Architecture of `TinyLlama`."""

    vocab: int = 256        # vocabulary size (256 = byte-level tokens)
    dim: int = 128          # hidden size
    layers: int = 4         # decoder blocks
    heads: int = 4          # attention heads
    kv_heads: int = 2       # key/value heads (grouped-query attention)
    ffn: int = 344          # SwiGLU hidden size
    max_seq: int = 1024     # longest sequence the rotary table covers
    rope_theta: float = 10000.0  # rotary base
    dropout: float = 0.0    # dropout on attention and MLP outputs
    attention: str = "sdpa"  # "sdpa": fused causal SDPA (memory linear in S); "eager": explicit S x S softmax


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised in fp32, as transformers' LlamaRMSNorm: in fp16 the backward of rsqrt (-u^-1.5 / 2,
        ~6e4 for activations of scale 0.02) overflows; the same bits as before in fp32."""
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Rotary(nn.Module):
    """Computes the rotary cos/sin tables for the positions of a sequence (no parameters)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        hd = cfg.dim // cfg.heads
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape (T, head_dim), computed in fp32 and cast to `dtype` (the activations'),
        as transformers' Llama does: fp32 tables would promote q and k in a bf16/fp16 model."""
        pos = torch.arange(ids.shape[1], device=ids.device, dtype=torch.float32)
        ang = torch.outer(pos, self.inv_freq.float())
        emb = torch.cat([ang, ang], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply rotary embeddings to (B, H, T, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Block(nn.Module):
    """One decoder block: attention and SwiGLU MLP, each pre-normed with a residual."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg, hd = cfg, cfg.dim // cfg.heads
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        self.q = nn.Linear(cfg.dim, cfg.heads * hd, bias=False)
        self.kv = nn.Linear(cfg.dim, 2 * cfg.kv_heads * hd, bias=False)
        self.o = nn.Linear(cfg.heads * hd, cfg.dim, bias=False)
        self.gate_up = nn.Linear(cfg.dim, 2 * cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.dim, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        b, t, _ = x.shape
        hd = c.dim // c.heads
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, c.heads, hd).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, c.kv_heads, hd).permute(2, 0, 3, 1, 4)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if c.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=c.heads != c.kv_heads)
        elif c.attention == "eager":
            rep = c.heads // c.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            y = att.masked_fill(mask, float("-inf")).softmax(-1) @ v
        else:
            raise ValueError(f"LlamaConfig.attention must be 'sdpa' or 'eager', got {c.attention!r}")
        y = y.transpose(1, 2).reshape(b, t, c.dim)
        x = x + self.drop(self.o(y))
        g, u = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.drop(self.down(F.silu(g) * u))


class TinyLlama(nn.Module):
    """A Llama-style causal LM whose forward returns the next-token loss."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.rotary = Rotary(cfg)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.02, generator=gen)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        cos, sin = self.rotary(input_ids, x.dtype)
        for block in self.layers:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        target = F.pad(labels[:, 1:], (0, 1), value=-100)  # next token; the last position predicts nothing
        return F.cross_entropy(logits.reshape(-1, self.cfg.vocab), target.reshape(-1), ignore_index=-100)
