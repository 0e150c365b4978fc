"""NEFTune: uniform noise on the input embeddings while training (Jain et al. 2023; TRL's `neftune_noise_alpha`).

    >>> import rpcompile, torch; from transformers import LlamaConfig, LlamaForCausalLM
    >>> _ = torch.manual_seed(0)
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    >>> ids = torch.randint(0, 128, (2, 16)); batch = {"input_ids": ids, "labels": ids}
    >>> handle = add_neftune(model, alpha=5.0)
    >>> c = rpcompile.compile(trainable_module(model), gpus=1, example=batch)   # doctest: +SKIP
    >>> loss = c.step(batch)   # training steps add the noise, evaluate() does not  # doctest: +SKIP
    >>> remove_neftune(model, handle)

In a training step the embedding output e (batch, L, d) becomes e + u, u uniform
in [-alpha / sqrt(L * d), alpha / sqrt(L * d)] elementwise (L: the sequence length
of the batch, padding included, as transformers' `neftune_post_forward_hook`);
in eval mode (`Compiled.evaluate`, `module.eval()`) nothing is added.

Note:
    The noise is a small module, `NEFTune`, registered as the embedding's child
    `neftune` and called by a forward hook on the embedding: its state is no
    parameter and no saved buffer (the exported weights are unchanged). It has
    `draws_random = True`, so the runtime runs its layer under the worker's seeded
    generator (`runtime/stage/rng.py`): the noise of step t, microbatch m is a function of
    (seed, t, m), the backward stage's recompute draws the same noise, and a resumed
    run draws the same noise as an uninterrupted one. It holds an empty,
    non-persistent buffer, so tracing keeps it as one call even where the embedding
    is traced through (a tied one): its `training` flag is read when it runs, not
    when the model is traced.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from rpcompile.finetune.hf import trainable_module

__all__ = ["NEFTune", "add_neftune", "remove_neftune"]


class NEFTune(torch.nn.Module):
    """Adds uniform noise of scale alpha / sqrt(L * d) to a (batch, L, d) tensor in training mode (module docstring).

    Args:
        alpha: the noise scale (TRL's neftune_noise_alpha; 5 is usual).

    Example:
        >>> n = NEFTune(5.0).eval(); x = torch.ones(1, 4, 8)
        >>> torch.equal(n(x), x)
        True
    """

    draws_random = True  # the runtime seeds the layer that runs this (runtime.stage.runner.random_layers)

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.alpha = float(alpha)
        # an empty buffer, saved nowhere: the tracer keeps a module with a buffer as one call (module Note)
        self.register_buffer("leaf", torch.empty(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        bound = self.alpha / math.sqrt(x.shape[1] * x.shape[2])
        return x + torch.empty_like(x).uniform_(-bound, bound)


def _noise(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """The embedding's forward hook: its output through its `neftune` child."""
    return module.neftune(output)


def add_neftune(model: Any, alpha: float) -> Any:
    """Put NEFTune noise of scale `alpha` on `model`'s input embeddings (before compiling it).

    Args:
        model: a transformers causal LM or a peft model of one.
        alpha: > 0.
    Returns:
        The hook's handle (for `remove_neftune`).
    Raises:
        ValueError: alpha is not > 0, or the model has no input embeddings.

    Example:
        >>> h = add_neftune(model, 5.0); type(model.get_input_embeddings().neftune).__name__   # doctest: +SKIP
        'NEFTune'
    """
    if not alpha > 0:
        raise ValueError(f"--neftune-alpha must be > 0 to add noise, got {alpha}")
    emb = trainable_module(model).get_input_embeddings()
    if emb is None:
        raise ValueError(f"{type(model).__name__} has no input embeddings (get_input_embeddings()) for NEFTune")
    emb.neftune = NEFTune(alpha)
    return emb.register_forward_hook(_noise)


def remove_neftune(model: Any, handle: Any) -> None:
    """Undo `add_neftune` (before export: the model saved is the plain one)."""
    handle.remove()
    del trainable_module(model).get_input_embeddings().neftune
