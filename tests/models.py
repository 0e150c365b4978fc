"""Small deterministic model zoo shared by the tests (nothing is downloaded).

Each builder takes a seed and returns a model in train mode with dropout off;
`*_batch` helpers build matching examples. transformers is imported lazily.

Example:
    >>> model = llama(); batch = lm_batch(model, batch=2, seq=8)
    >>> model(**batch).loss
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 128


# ---------------------------------------------------------------- nanoGPT


@dataclass(frozen=True)
class GPTConfig:
    """nanoGPT hyper-parameters (tiny defaults)."""

    block_size: int = 32  # max sequence length
    vocab_size: int = VOCAB  # tokens
    n_layer: int = 2  # transformer blocks
    n_head: int = 4  # attention heads
    n_embd: int = 32  # hidden size


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (nanoGPT)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.n_head = cfg.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block (nanoGPT)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT with tied token embedding / LM head; forward(idx, targets) -> (logits, loss)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd), wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(0.0), h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd)))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def nanogpt(seed: int = 0, **overrides: Any) -> NanoGPT:
    """A tiny nanoGPT with deterministic random weights."""
    torch.manual_seed(seed)
    return NanoGPT(GPTConfig(**overrides))


def gpt_loss(output: Any, example: Any) -> torch.Tensor:
    """loss_fn for NanoGPT: its forward returns (logits, loss)."""
    return output[1]


def token_batch(vocab: int = VOCAB, batch: int = 2, seq: int = 8, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """(idx, targets) for NanoGPT."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


# ---------------------------------------------------------------- plain Sequential


def sequential(seed: int = 0, width: int = 16, depth: int = 3) -> nn.Sequential:
    """An MLP as a plain nn.Sequential (Linear/Tanh blocks)."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for _ in range(depth):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods, nn.Linear(width, 4))


def mse_loss(output: torch.Tensor, example: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """loss_fn for `sequential`: mean squared error against example[1]."""
    return F.mse_loss(output, example[1])


def regression_batch(batch: int = 4, width: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) for `sequential`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, width, generator=g), torch.randn(batch, 4, generator=g)


# ---------------------------------------------------------------- Hugging Face transformers


def _tiny(**extra: Any) -> dict[str, Any]:
    """Common tiny-config fields."""
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base.update(extra)
    return base


def _build(cls_name: str, cfg: Any, seed: int) -> nn.Module:
    """Instantiate a transformers model class with deterministic random weights, train mode."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg)
    return model.train()


def llama(seed: int = 0, attn: str = "eager", **overrides: Any) -> nn.Module:
    """Tiny LlamaForCausalLM (random weights)."""
    from transformers import LlamaConfig

    return _build("LlamaForCausalLM", LlamaConfig(**_tiny(**overrides), attn_implementation=attn), seed)


def qwen3(seed: int = 0, attn: str = "eager", **overrides: Any) -> nn.Module:
    """Tiny Qwen3ForCausalLM (random weights, q/k norm)."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(**_tiny(head_dim=8, **overrides), attn_implementation=attn)
    return _build("Qwen3ForCausalLM", cfg, seed)


def qwen3_moe(seed: int = 0, attn: str = "eager", **overrides: Any) -> nn.Module:
    """Tiny Qwen3MoeForCausalLM (random weights, 4 experts, top-2)."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**_tiny(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 decoder_sparse_step=1, **overrides), attn_implementation=attn)
    return _build("Qwen3MoeForCausalLM", cfg, seed)


def gpt2(seed: int = 0, attn: str = "eager", **overrides: Any) -> nn.Module:
    """Tiny GPT2LMHeadModel (random weights, tied embedding / LM head, dropout off)."""
    from transformers import GPT2Config

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn, **overrides)
    return _build("GPT2LMHeadModel", cfg, seed)


def lm_batch(batch: int = 2, seq: int = 8, seed: int = 1, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """{"input_ids", "labels"} for the transformers causal LMs (they shift labels themselves)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def param_count(model: nn.Module) -> int:
    """Number of distinct parameter elements."""
    return sum(p.numel() for p in model.parameters())


def llama_134m(device: str = "cpu") -> nn.Module:
    """A 12-layer Llama with ~134M parameters (hidden 768, 12 heads, FFN 2048, vocab 32000, untied head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                      attn_implementation="eager")
    with torch.device(device):
        return LlamaForCausalLM(cfg).train()


class LossMLP(nn.Module):
    """Three blocks (two Linear+ReLU, one Linear) returning the MSE loss of (x, y): a model that returns its loss."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(nn.Sequential(nn.Linear(8, width), nn.ReLU()),
                                    nn.Sequential(nn.Linear(width, 8), nn.ReLU()), nn.Linear(8, 1))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.blocks(x), y)


def xy(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A (4, 8) input and (4, 1) target for LossMLP, from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
