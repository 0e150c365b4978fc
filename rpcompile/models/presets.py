"""The five RoundPipe paper models, built on the `meta` device from their public configs.

Nothing is downloaded and no weight is allocated: the architecture numbers
below are the models' published configs (hidden size, heads, KV heads, FFN
size, experts, layers, vocabulary). transformers is needed (the `test` extra);
without it `build_meta` says how to install it.

    >>> sorted(MODELS)
    ['gpt-oss-20b', 'llama3.1-8b', 'qwen3-1.7b', 'qwen3-235b-a22b', 'qwen3-32b']
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch

from rpcompile.models.attention import register
from rpcompile.models.model_config import read_model_config
from rpcompile.ir.hardware import Hardware
from rpcompile.passes.cost.seqlen import units_limit
from rpcompile.passes.trace import sublayer_units, trace

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
        raw = read_model_config(name_or_path)  # ValueError naming the file and the field
        kind = raw.pop("model_type", None)
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        if not isinstance(kind, str) or kind not in CONFIG_MAPPING:
            raise ValueError(f"{name_or_path}: model_type must name a transformers model type (e.g. \"llama\"), got "
                             f"{'none' if kind is None else repr(kind)}")
        try:
            return tf.AutoConfig.for_model(kind, **raw)
        except Exception as exc:  # noqa: BLE001 - a config class's own validation (TypeError, ValueError...)
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
            raise ValueError(f"{name_or_path}: {lines[0]}") from None
    raise ValueError(f"unknown model {name_or_path!r}: use one of {sorted(MODELS)} or a config.json path")


def default_attention(cfg) -> str:
    """The memory-efficient attention for a transformers config: "sdpa", or rpcompile's own for models without it.

    transformers' SDPA path is used where the model supports it (flash / memory-efficient kernels on
    CUDA, the flash kernel on CPU); a model without one (GPT-OSS: attention sinks) gets
    `rpcompile.models.attention.sdpa_with_sinks`, the same attention through one SDPA call.

    >>> default_attention(config_for("llama3.1-8b"))
    'sdpa'
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(cfg), None)
    if cls is None or getattr(cls, "_supports_sdpa", False):
        return "sdpa"
    return register()


def build_meta(name_or_path: str, dtype=None, attn_implementation: str | None = None,
               experts_implementation: str | None = None):
    """The causal LM on the meta device (no weights allocated) in `dtype` (default bf16).

    Args:
        name_or_path: a preset name (`MODELS`) or a config.json path.
        dtype: parameter dtype (default torch.bfloat16).
        attn_implementation: the attention to use ("sdpa", "eager", ...). Default: the config's own
            choice if it names one (a config.json with "attn_implementation"), else memory-efficient
            attention (`default_attention`).
        experts_implementation: how mixture-of-experts layers run ("eager": one expert after the
            other; "grouped_mm": one grouped matmul per projection). Default: transformers' default.
    Returns:
        The model, in train mode, with `use_cache=False`.

    >>> build_meta("qwen3-1.7b").config._attn_implementation
    'sdpa'
    """
    tf = _transformers()
    cfg = config_for(name_or_path)
    cfg._attn_implementation = attn_implementation or cfg._attn_implementation or default_attention(cfg)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(cfg), None)
    if experts_implementation is not None and cls is not None and cls._can_set_experts_implementation():
        cfg._experts_implementation = experts_implementation
    cfg.use_cache = False
    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.bfloat16)


def example_batch(vocab: int, batch: int, seq: int, device: str = "cpu") -> dict:
    """A token batch (input_ids and labels) of the given shape."""
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    return {"input_ids": ids, "labels": ids.clone()}


def long_sequence_graph(name_or_path: str, *, frozen_base: bool = False,
                        experts_implementation: str | None = None, model: torch.nn.Module | None = None,
                        units: str = "sub-blocks"):
    """A preset (or config.json) built on meta and traced for long sequences, with `sublayer_units` (or `units=`).

    Args:
        name_or_path: a preset name (`MODELS`) or a config.json path.
        frozen_base: train only the 1-D weights (norms), as `python -m rpcompile plan --frozen-base`;
            frozen weights need no gradient, master or optimizer state.
        experts_implementation: for mixture-of-experts models. Default: "eager" (one expert after
            the other) with a frozen base, since frozen experts have no weight gradients and the
            loop then holds one expert's intermediates at a time; else transformers' default
            (grouped matmuls: a trainable expert loop would build a full-size weight gradient per expert).
        model: that model already built by `build_meta` (and frozen as asked), traced instead of building
            it again (`plan_model` does this); it is not modified. Its experts run as its config says
            (`seq_len_limit` switches a frozen base's to "eager" while it traces and counts).
        units: "sub-blocks" (norms, attention, MLP as layers: `sublayer_units`) or "blocks" (the decoder
            blocks as layers, as `compile` traces first).
    Returns:
        The LayerGraph (memory-efficient attention, bf16, traced at one sequence of 2048 tokens).

    >>> [layer.name for layer in long_sequence_graph("qwen3-1.7b").layers][1:3]   # doctest: +SKIP
    ['model.layers.0.input_layernorm', 'model.layers.0.self_attn']
    """
    if units not in ("sub-blocks", "blocks"):
        raise ValueError(f"long_sequence_graph: units must be 'sub-blocks' or 'blocks', got {units!r}")
    net = _built(name_or_path, frozen_base, experts_implementation, model)
    layers = sublayer_units(net) if units == "sub-blocks" else None
    return trace(net, example_batch(net.config.vocab_size, 1, 2048), layers=layers)


def seq_len_limit(name_or_path: str, hardware: Any = "rtx4090", *, gpus: int | None = None,
                  microbatch_size: int = 1, microbatches: int | None = None, host_memory: int | None = None,
                  frozen_base: bool = False, experts_implementation: str | None = None,
                  model: torch.nn.Module | None = None, optimizer: Any = None,
                  shard: tuple[int, int] | None = None):
    """The longest trainable sequence of a preset (or config.json) on `hardware`, and what binds it.

    `rpcompile.max_seq_len` with the layer units `compile` uses at each length
    (`passes.cost.seqlen.units_limit`: whole decoder blocks, then sub-blocks where a block no longer fits).

    Args:
        name_or_path: a preset name (`MODELS`) or a config.json path.
        hardware: a `Hardware` or preset name.
        gpus, microbatch_size, microbatches, host_memory: as `max_seq_len`
            (`microbatch_size`: sequences per microbatch; `host_memory`: bytes).
        frozen_base, experts_implementation, model: as `long_sequence_graph`.
        optimizer: the run's `rpcompile.AdamW` / `SGD` (default AdamW()): its state and master dtypes set
            the parameter state's host bytes.
        shard: (rank, world) of a run whose masters and moments are sharded over `world` servers: the host
            term counts server `rank`'s share (`max_seq_len(shard=)`); None: the whole state.
    Returns:
        A `rpcompile.SeqLenLimit` (`.length`, `.binding`, `.bytes`, `.terms`; `str()` reads well).

    >>> print(seq_len_limit("qwen3-1.7b", host_memory=2048 * 2**30))   # doctest: +SKIP
    """
    hw = Hardware.preset(hardware) if isinstance(hardware, str) else hardware
    impl = experts_implementation or ("eager" if frozen_base else None)
    kw = dict(gpus=gpus, microbatch_size=microbatch_size, microbatches=microbatches, host_memory=host_memory,
              optimizer=optimizer, shard=shard)
    net = _built(name_or_path, frozen_base, experts_implementation, model)

    def sub_blocks():
        try:
            sublayer_units(net)
        except ValueError:  # no list of decoder blocks to cut
            return None
        return long_sequence_graph(name_or_path, model=net)
    with _experts_running(net, impl):  # through the counts too: the traced layers call the model's modules
        return units_limit(long_sequence_graph(name_or_path, model=net, units="blocks"), sub_blocks, hw, **kw)


def _built(name_or_path: str, frozen_base: bool, experts_implementation: str | None,
           model: torch.nn.Module | None) -> torch.nn.Module:
    """`model`, or the preset built on meta (its experts eager with a frozen base, unless told otherwise) with
    only its 1-D weights trainable if `frozen_base`."""
    if model is not None:
        return model
    impl = experts_implementation or ("eager" if frozen_base else None)
    net = build_meta(name_or_path, experts_implementation=impl)
    if frozen_base:
        for p in net.parameters():
            p.requires_grad_(p.dim() == 1)
    return net


@contextlib.contextmanager
def _experts_running(model: torch.nn.Module | None, impl: str | None) -> Iterator[None]:
    """Inside, `model`'s mixture-of-experts layers run `impl` (transformers reads the config's
    `_experts_implementation` at every call; a model without one, or None, is left as it is); restored after."""
    cfg = getattr(model, "config", None)
    old = getattr(cfg, "_experts_implementation", None)
    if impl is None or old is None or old == impl:
        yield
        return
    cfg._experts_implementation = impl
    try:
        yield
    finally:
        cfg._experts_implementation = old
