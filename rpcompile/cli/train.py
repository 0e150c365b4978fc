"""`python -m rpcompile train --config run.json`: scripted training of a byte-level Llama on a text file.

    {"text": "corpus.txt", "steps": 100, "gpus": 2, "microbatches": 4, "batch": 8, "seq": 128,
     "dim": 128, "layers": 4, "lr": 0.003, "save": "run.ckpt"}

With "resume": true and an existing "save" file, training continues from it.
The "save" path is checked before anything is built (its folder exists and is
writable, the path is not a folder), so a bad path fails at once, not hours later.
`python -m rpcompile train --help` lists every key (`RunConfig`); an unknown key
or a value of the wrong type is refused naming the key (`RunConfig.from_json`).
"""
from __future__ import annotations

import difflib
import json
import math
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from rpcompile.api import compile
from rpcompile.resume import load
from rpcompile.cli.demo import DemoConfig, batches
from rpcompile.finetune.config import MAX_COUNT, MAX_SEED
from rpcompile.models.zoo import LlamaConfig, TinyLlama
from rpcompile.ir.optim import AdamW


def _key(default: Any, meaning: str) -> Any:
    """A RunConfig field with its meaning (listed by `python -m rpcompile train --help`)."""
    return field(default=default, metadata={"help": meaning})


@dataclass(frozen=True, slots=True)
class RunConfig:
    """A training run; every field has a default except the corpus."""

    text: str = field(metadata={"help": "path of a text file, read as byte-level tokens"})
    steps: int = _key(100, "training iterations")
    gpus: int = _key(2, "workers (GPUs, or host threads without CUDA)")
    microbatches: int = _key(4, "microbatches per iteration (must divide batch)")
    batch: int = _key(8, "sequences per iteration")
    seq: int = _key(128, "tokens per sequence")
    dim: int = _key(128, "model hidden size (a multiple of 2 x heads)")
    layers: int = _key(4, "decoder blocks")
    heads: int = _key(4, "attention heads")
    lr: float = _key(3e-3, "AdamW learning rate")
    staleness: int = _key(1, "optimizer staleness (0 or 1)")
    seed: int = _key(0, "data order and initial weights")
    save: str | None = _key(None, "checkpoint path written at the end (and every save_every steps)")
    save_every: int = _key(0, "checkpoint every this many steps (0 = only at the end)")
    resume: bool = _key(False, "continue from save if it exists")

    def __post_init__(self) -> None:
        """ValueError naming the first key whose value has the wrong type or range."""
        for f in fields(self):
            value = getattr(self, f.name)
            why = _bad_value(f.name, value, f.type)
            if why:
                raise ValueError(f"{f.name!r} must be {why}, got {value!r}")
        if self.batch % self.microbatches:
            raise ValueError(f"'microbatches' ({self.microbatches}) must divide 'batch' ({self.batch})")
        if self.dim % (2 * self.heads):
            raise ValueError(f"'dim' ({self.dim}) must be a multiple of 2 x 'heads' ({self.heads}): an even head "
                             f"size, for the rotary embeddings")

    @classmethod
    def from_dict(cls, raw: Any, source: str = "the run config") -> RunConfig:
        """A RunConfig from a parsed JSON object; ValueError naming `source` and the first bad key."""
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: a run config is a JSON object of keys, got {type(raw).__name__} "
                             f"(python -m rpcompile train --help lists the keys)")
        known = {f.name: f for f in fields(cls)}
        for key in raw:
            if key not in known:
                near = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ValueError(f"{source}: unknown key {key!r}{hint}; the keys are {', '.join(known)}")
        for name, f in known.items():
            if f.default is MISSING and name not in raw:
                raise ValueError(f"{source}: missing key {name!r}: {f.metadata['help']}")
        try:
            return cls(**raw)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def from_json(cls, path: str) -> RunConfig:
        """Read a JSON run config file (ValueError naming the file for bad JSON or a bad key)."""
        with open(path) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not valid JSON: {exc}") from None
        return cls.from_dict(raw, source=path)


_POSITIVE = {"steps", "gpus", "microbatches", "batch", "seq", "dim", "layers", "heads"}


def _bad_value(key: str, value: Any, kind: str) -> str | None:
    """What `value` of `key` (annotated `kind`) must be, or None if it is fine."""
    if kind == "str | None":
        return None if value is None or isinstance(value, str) else "a string or null"
    if kind == "str":
        return None if isinstance(value, str) else "a string"
    if kind == "bool":
        return None if isinstance(value, bool) else "true or false"
    if kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
        return None if ok else "a finite number >= 0"
    if isinstance(value, bool) or not isinstance(value, int):
        return "an integer"
    if key == "seed":
        return None if 0 <= value <= MAX_SEED else f"an integer from 0 to {MAX_SEED} (2**32 - 1)"
    if key in _POSITIVE and not 1 <= value <= MAX_COUNT:
        return f"a positive integer (at most {MAX_COUNT:,})"
    if key == "staleness" and value not in (0, 1):
        return "0 or 1"
    return f"an integer >= 0 (at most {MAX_COUNT:,})" if not 0 <= value <= MAX_COUNT else None


def config_help() -> str:
    """The config keys, their types, defaults and meanings, one per line (for `train --help`)."""
    kinds = {"str": "string", "str | None": "string or null", "int": "integer", "float": "number",
             "bool": "true/false"}
    rows = []
    for f in fields(RunConfig):
        default = "required" if f.default is MISSING else f"default {json.dumps(f.default)}"
        rows.append((f.name, f"{kinds.get(f.type, f.type)}, {default}", f.metadata["help"]))
    w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
    return "\n".join(f"  {a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows)


def check_save_path(path: str) -> None:
    """Raise an OSError naming 'save' unless a checkpoint can be written at `path` (checked before compiling).

    Example:
        >>> check_save_path("no-such-folder/run.ckpt")
        Traceback (most recent call last):
        FileNotFoundError: 'save' 'no-such-folder/run.ckpt': the folder 'no-such-folder' does not exist; create it first
    """
    folder = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise IsADirectoryError(f"'save' {path!r} is a folder; give a file path such as "
                                f"{os.path.join(path, 'run.ckpt')!r}")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise NotADirectoryError(f"'save' {path!r}: {folder!r} is a file, not a folder")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"'save' {path!r}: the folder {folder!r} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"'save' {path!r}: cannot write in the folder {folder!r} (permission denied)")


def train(cfg: RunConfig) -> list[float]:
    """Run `cfg`; returns the losses of the steps it ran."""
    if cfg.save:
        check_save_path(cfg.save)
    with open(cfg.text, "rb") as f:
        data = f.read()
    if len(data) < cfg.seq + 2:
        raise ValueError(f"{cfg.text!r} holds {len(data)} bytes; need more than seq + 1 = {cfg.seq + 1}")
    model = TinyLlama(LlamaConfig(vocab=256, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads,
                                  kv_heads=cfg.heads, ffn=cfg.dim * 8 // 3, max_seq=cfg.seq), seed=cfg.seed)
    stream = batches(data, DemoConfig(batch=cfg.batch, seq=cfg.seq, seed=cfg.seed))
    if cfg.resume and cfg.save and os.path.exists(cfg.save):
        c = load(cfg.save, model)
        for _ in range(c.steps):  # the data stream continues where the run stopped
            next(stream)
        print(f"resumed {cfg.save} at step {c.steps}")
    else:
        c = compile(model, gpus=cfg.gpus, example=next(stream),
                    microbatches=cfg.microbatches, staleness=cfg.staleness,
                    optimizer=AdamW(lr=cfg.lr, weight_decay=0.0), seed=cfg.seed)
        stream = batches(data, DemoConfig(batch=cfg.batch, seq=cfg.seq, seed=cfg.seed))  # from the start
    losses = []
    with c:
        while c.steps < cfg.steps:
            losses.append(c.step(next(stream)))
            print(f"step {c.steps}: loss {losses[-1]:.4f}", flush=True)
            if cfg.save and cfg.save_every and c.steps % cfg.save_every == 0:
                c.save(cfg.save)
        if cfg.save:
            c.save(cfg.save)
            print(f"saved {cfg.save}")
    return losses
