"""The demo's model data: this repository's own text as byte-level tokens, and the demo's settings.

`python -m rpcompile demo` (`rpcompile.cli.demo`) trains a `TinyLlama` on it; the examples use it as a
data source that needs no download.

    >>> from rpcompile.models.demo import DemoConfig, batches, corpus
    >>> next(batches(corpus(), DemoConfig(batch=2, seq=16)))["input_ids"].shape
    torch.Size([2, 16])
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# The corpus: the package's own .py and .md files (rpcompile/, every sub-folder), the checkout's top-level
# files (README.md, when installed -e), then passes/, runtime/ and docs/ next to rpcompile/ (an installed
# package holds passes/ and runtime/ inside rpcompile/, so they are read there).
_SIBLING_FOLDERS = ("passes", "runtime", "docs")
_SUFFIXES = (".py", ".md")


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What the demo trains and for how long."""

    steps: int = 200           # training iterations
    batch: int = 8             # sequences per iteration
    seq: int = 128             # bytes per sequence
    gpus: int = 2              # workers (host threads without CUDA)
    microbatches: int = 4      # microbatches per iteration
    lr: float = 3e-3           # AdamW learning rate
    memory_mib: float = 8.0    # device budget per worker: small on purpose, so the model does not fit
                               # one worker and runs as a pipeline, as a model larger than one GPU would
    out: str = "rpcompile-demo"  # folder for the charts and traces
    seed: int = 0              # data order and initial weights


def corpus() -> bytes:
    """The project's own source and docs as one byte string (fixed folder order, sorted paths)."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # rpcompile/models/demo.py -> rpcompile/
    root = os.path.dirname(pkg)
    paths = _text_files(pkg)
    paths += sorted(os.path.join(root, n) for n in os.listdir(root) if n.endswith(_SUFFIXES))
    for folder in _SIBLING_FOLDERS:
        paths += _text_files(os.path.join(root, folder))
    chunks = []
    for path in paths:
        with open(path, "rb") as f:
            chunks.append(f.read())
    data = b"\n".join(dict.fromkeys(chunks))  # a file reachable twice counts once
    if len(data) < 10_000:
        raise RuntimeError(f"found only {len(data)} bytes of text under {root}")
    return data


def _text_files(folder: str) -> list[str]:
    """The .py and .md files under `folder`, every sub-folder included, in sorted path order."""
    out = []
    for dirpath, dirnames, files in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        out += [os.path.join(dirpath, n) for n in sorted(files) if n.endswith(_SUFFIXES)]
    return out


def batches(data: bytes, cfg: DemoConfig):
    """Endless random windows of the corpus as {"input_ids", "labels"} batches."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(cfg.seed)
    while True:
        start = torch.randint(0, len(tokens) - cfg.seq - 1, (cfg.batch,), generator=gen)
        ids = torch.stack([tokens[s:s + cfg.seq] for s in start.tolist()])
        yield {"input_ids": ids, "labels": ids.clone()}
