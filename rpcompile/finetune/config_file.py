"""Read a finetune config file: `python -m rpcompile finetune --config FILE`.

    python -m rpcompile finetune --config run.yaml --steps 100        # flags override the file
    python -m rpcompile finetune --config OUT/rpcompile-run.json --out OUT2   # rerun a run, bit for bit

A config file is `.json` or `.yaml`/`.yml` (YAML needs PyYAML: `pip install pyyaml`). It holds a
mapping whose keys are `FinetuneConfig` fields (an option's name with `_` for `-`: `micro_batch_size`,
`lora_targets`; `progress` is the opposite of `--no-progress`), e.g.

    model: ./Qwen3-1.7B
    data: chat.jsonl
    out: ./qwen3-chat
    seq: 2048
    lr: 2e-5                  # YAML floats may be written without a dot
    lora: 8
    lora_targets: [q_proj, v_proj]

The run record a run writes, `OUT/rpcompile-run.json` ({"settings": {...every field...}, "data":
{...fingerprint...}}), is such a file too: its "settings" are read and its "data" is ignored. From a
run record `resume`, `overwrite` and `dry_run` are *not* taken (they stay False unless given as flags):
they said how that run treated its own `out`, not how a rerun should treat another one, and a rerun
into a new `--out` must not try to resume. A plain config file may set them. The record's `out` is
taken: without `--out` the rerun is refused (that folder holds the run) unless `--resume` continues it.
Paths in the file are used as written: relative ones are relative to the current folder, as on the
command line (a run record holds the paths as that run was given them).

Each value is checked against the field's annotation (`typing.get_type_hints(FinetuneConfig)`): an
integer field takes an integer (not `"32"`, not `true`), a number field an integer or a float, a list
field (`lora_targets`) a list of strings, and `null` only where the field allows None. An unknown key,
a wrong type, a file that does not parse (named with its line) or an unreadable file raises one line
(ValueError / FileNotFoundError / ImportError), which the command line prints, exiting with status 2.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import types
import typing
from typing import Any

from rpcompile.finetune.config import FinetuneConfig

__all__ = ["read_config", "check_settings", "did_you_mean", "FROM_RECORD_NOT_TAKEN", "EXTENSIONS"]

EXTENSIONS = (".json", ".yaml", ".yml")
FROM_RECORD_NOT_TAKEN = ("resume", "overwrite", "dry_run")  # a run record's values of these are dropped
HINTS = typing.get_type_hints(FinetuneConfig)  # field -> resolved annotation (the module uses string ones)
_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")  # 2e-5, 1.5E3


def did_you_mean(key: Any, known: typing.Iterable[str]) -> str:
    """' (did you mean 'seq'?)' for an unknown `key` near one of `known` (a `-` for `_` counts as near), or ''.

        >>> did_you_mean("micro-batch-size", ["seq", "micro_batch_size"])
        " (did you mean 'micro_batch_size'?)"
    """
    known = list(known)
    text = str(key)
    near = [text.replace("-", "_")] if text.replace("-", "_") in known else \
        difflib.get_close_matches(text, known, n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def read_config(path: str) -> dict[str, Any]:
    """The settings in the config file `path`: field -> checked value (only the keys the file has).

    A run record's "settings" are read, without `FROM_RECORD_NOT_TAKEN`. Raises one line naming
    the file: ValueError (bad extension, syntax with its line, unknown key, wrong type),
    FileNotFoundError, ImportError (a YAML file without PyYAML).
    """
    source = f"--config {path}"
    ext = os.path.splitext(path)[1].lower()
    if ext not in EXTENSIONS:
        raise ValueError(f"{source}: a config file is .json, .yaml or .yml, got {ext or 'no extension'!r}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{source}: the file does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{source}: not UTF-8 text (byte {exc.start})") from None
    raw = _parse_json(text, source) if ext == ".json" else _parse_yaml(text, source)
    if raw is None:  # an empty YAML file: nothing set
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: a config is a mapping of FinetuneConfig keys (or a run record), got a "
                         f"{type(raw).__name__}")
    if "settings" in raw:  # a run record: {"settings": {...}, "data": {...}}
        extra = [k for k in raw if k not in ("settings", "data")]
        if extra:
            raise ValueError(f"{source}: unknown key {extra[0]!r} beside 'settings' (a run record holds "
                             f"'settings' and 'data')")
        if not isinstance(raw["settings"], dict):
            raise ValueError(f"{source}: 'settings' must be a mapping of FinetuneConfig keys, got a "
                             f"{type(raw['settings']).__name__}")
        settings = {k: v for k, v in raw["settings"].items() if k not in FROM_RECORD_NOT_TAKEN}
        return check_settings(settings, f"{source}: settings:")
    return check_settings(raw, f"{source}:")


def check_settings(raw: dict, source: str) -> dict[str, Any]:
    """`raw` with each value as its field's type (lists as tuples, ints as floats for number fields).

    ValueError starting with `source`, naming the first unknown key (with a did-you-mean) or the first
    value of the wrong type, e.g. "--config run.json: key 'seq' must be an integer, got 'abc'".
    """
    names = [f.name for f in dataclasses.fields(FinetuneConfig)]
    for key in raw:
        if key not in HINTS:
            raise ValueError(f"{source} unknown key {key!r}{did_you_mean(key, names)}; the keys are "
                             f"{', '.join(names)}")
    return {key: _conform(key, value, HINTS[key], source) for key, value in raw.items()}


def _conform(key: str, value: Any, hint: Any, source: str) -> Any:
    """`value` as a `hint` (a field's annotation); ValueError naming `key` and what it must be."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = typing.get_args(hint) if union else (hint,)
    for kind in kinds:
        ok, converted = _as(value, kind)
        if ok:
            return converted
    raise ValueError(f"{source} key {key!r} must be {' or '.join(_describe(k) for k in kinds)}, got {value!r}")


def _as(value: Any, kind: Any) -> tuple[bool, Any]:
    """(True, value converted) if `value` is a `kind`, else (False, None)."""
    if kind is type(None):
        return value is None, None
    if kind is bool:
        return isinstance(value, bool), value
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else None
    if kind is str:
        return isinstance(value, str), value
    if typing.get_origin(kind) is tuple:  # tuple[X, ...]: a list of X
        item = typing.get_args(kind)[0]
        ok = isinstance(value, (list, tuple)) and all(_as(v, item)[0] for v in value)
        return ok, tuple(_as(v, item)[1] for v in value) if ok else None
    raise TypeError(f"run_config: no check for the annotation {kind!r}: extend _as and _describe")


def _describe(kind: Any) -> str:
    """What a value of `kind` is, for the error line."""
    if typing.get_origin(kind) is tuple:
        return f"a list of {_describe(typing.get_args(kind)[0])[2:]}s"
    return {type(None): "null", bool: "true or false", int: "an integer", float: "a number",
            str: "a string"}.get(kind, repr(kind))


def _parse_json(text: str, source: str) -> Any:
    """The parsed JSON; ValueError with the line and column of a syntax error."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None


def _parse_yaml(text: str, source: str) -> Any:
    """The parsed YAML (safe loader; 2e-5 is a float, as in JSON); ImportError without PyYAML."""
    try:
        import yaml
    except ImportError:
        raise ImportError(f"{source}: reading YAML needs PyYAML: pip install pyyaml (or give a .json file)") \
            from None

    class Loader(yaml.SafeLoader):
        """SafeLoader that also reads 1e-3 (YAML 1.1 floats need a dot: PyYAML reads it as a string)."""

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
    try:
        return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        why = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
        raise ValueError(f"{source}: not valid YAML{where}: {why}") from None
