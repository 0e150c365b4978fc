"""Hugging Face defaults that `trace` switches off while it traces (used by `trace`).

Note:
    A training step never reads a key/value cache, but a transformers model builds
    one whenever `use_cache` is true, and takes the default from `config.use_cache`
    when the caller passes nothing. `trace` passes `use_cache=False` when the
    model's `forward` names it; a wrapper whose `forward(**kwargs)` hides it (a
    peft `PeftModel`, for instance) would still build a cache, which tracing
    freezes into the graph as a constant that every layer then appends to. So for
    the duration of the trace every config in the model has `use_cache=False`; the
    user's values are restored afterwards.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["no_kv_cache"]


@contextlib.contextmanager
def no_kv_cache(model: torch.nn.Module) -> Iterator[None]:
    """Set `use_cache=False` on every module's `config` (and its sub-configs) while tracing `model`."""
    saved: dict[int, tuple[object, object]] = {}
    seen: set[int] = set()

    def visit(cfg: object) -> None:
        if id(cfg) in seen or not hasattr(type(cfg), "to_dict"):  # a transformers PretrainedConfig
            return
        seen.add(id(cfg))
        if getattr(cfg, "use_cache", None) is not None:
            saved[id(cfg)] = (cfg, cfg.use_cache)
        for sub in vars(cfg).values():  # encoder-decoder and multimodal models nest configs
            visit(sub)

    for mod in model.modules():
        cfg = vars(mod).get("config")
        if cfg is not None:
            visit(cfg)
    try:
        for cfg, _ in saved.values():
            cfg.use_cache = False
        yield
    finally:
        for cfg, val in saved.values():
            cfg.use_cache = val
