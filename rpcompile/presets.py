"""The five RoundPipe paper models, built on the `meta` device from their public configs.

Nothing is downloaded and no weight is allocated: the architecture numbers
below are the models' published configs (hidden size, heads, KV heads, FFN
size, experts, layers, vocabulary). transformers is needed (the `test` extra);
without it `build_meta` says how to install it.

    >>> sorted(MODELS)
    ['gpt-oss-20b', 'llama3.1-8b', 'qwen3-1.7b', 'qwen3-235b-a22b', 'qwen3-32b']
"""
from __future__ import annotations

import json
import os
from typing import Any

# name -> (transformers config class, config fields)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-1.7b": ("Qwen3Config", dict(
        hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1000000.0)),
    "llama3.1-8b": ("LlamaConfig", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0)),
    "gpt-oss-20b": ("GptOssConfig", dict(
        hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
        vocab_size=201088, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"] * 12)),
    "qwen3-32b": ("Qwen3Config", dict(
        hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, intermediate_size=25600, vocab_size=151936, tie_word_embeddings=False,
        rope_theta=1000000.0)),
    "qwen3-235b-a22b": ("Qwen3MoeConfig", dict(
        hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
        head_dim=128, intermediate_size=12288, moe_intermediate_size=1536, num_experts=128,
        num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
        tie_word_embeddings=False, rope_theta=1000000.0)),
}


def _transformers():
    """Import transformers or explain how to get it."""
    try:
        import transformers
    except ImportError:
        raise ImportError("planning a transformers model needs the optional dependency transformers: "
                          "pip install 'rpcompile[test]' (or pip install transformers)") from None
    return transformers


def config_for(name_or_path: str):
    """A transformers config for a preset name or a config.json path."""
    tf = _transformers()
    if name_or_path in MODELS:
        cls, fields = MODELS[name_or_path]
        return getattr(tf, cls)(**fields)
    if os.path.isfile(name_or_path):
        with open(name_or_path) as f:
            raw = json.load(f)
        return tf.AutoConfig.for_model(raw.pop("model_type"), **raw)
    raise ValueError(f"unknown model {name_or_path!r}: use one of {sorted(MODELS)} or a config.json path")


def build_meta(name_or_path: str, dtype=None):
    """The causal LM on the meta device (no weights allocated) in `dtype` (default bf16), eager attention."""
    import torch
    tf = _transformers()
    cfg = config_for(name_or_path)
    cfg._attn_implementation = "eager"
    cfg.use_cache = False
    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.bfloat16)


def example_batch(vocab: int, batch: int, seq: int, device: str = "cpu") -> dict:
    """A token batch (input_ids and labels) of the given shape."""
    import torch
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    return {"input_ids": ids, "labels": ids.clone()}
