"""The output folder of a fine-tuning run: what a run writes there, what it refuses, what a resume must match.

    >>> check_out(cfg)                  # raises unless cfg.out may be written (see finetune's docstring)  # doctest: +SKIP
    >>> lock = claim_out(cfg); ...; lock.release()   # check_out, and the folder is this run's alone      # doctest: +SKIP
    >>> check_resume(cfg, run_record(cfg, train))                                                     # doctest: +SKIP

One run owns its output folder: `claim_out` takes an exclusive lock (`fcntl.flock` on `OUT/.lock`,
which holds the owner's pid) for the whole run, so a second run on the same folder is refused at
once, naming the pid that holds it. The operating system releases the lock with the process, so a
killed run leaves no lock behind (the file stays; it locks nothing). Where there is no `flock`
(Windows) there is no lock.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

try:
    import fcntl  # POSIX only: no lock without it
except ImportError:  # pragma: no cover - Windows
    fcntl = None

from rpcompile.finetune.config import FinetuneConfig
from rpcompile.finetune.hf import TOKENIZER_FILES
from rpcompile.finetune.metrics import METRICS_FILE, TENSORBOARD_DIR

__all__ = ["CHECKPOINT", "RUN_FILE", "TOKEN_CACHE", "FREE", "LOCK_FILE", "OutLock", "check_out", "claim_out",
           "previous_run", "remove_previous", "run_record", "read_run", "check_resume"]

CHECKPOINT = "rpcompile-checkpoint.rp"  # in `out`: the training state (rpcompile.load format)
RUN_FILE = "rpcompile-run.json"  # in `out`: the run's settings and data fingerprint, checked on resume
TOKEN_CACHE = "token-cache"  # in `out`: the tokenized data files (rpcompile.finetune.data.token_cache), kept for reruns
LOCK_FILE = ".lock"  # in `out`: locked (flock) by the run that owns the folder; holds its pid
# a resume may change these (the data file is checked by the fingerprint of its packed tokens, not its path)
FREE = ("out", "data", "resume", "overwrite", "save_every", "eval", "eval_every", "progress", "logging_steps",
        "report_to", "dry_run", "num_proc", "timeout", "dist_timeout")
# what a run writes into `out` (and `out/adapter`): found there, it is refused without --resume or --overwrite
RUN_OUTPUTS = (RUN_FILE, CHECKPOINT, METRICS_FILE, "config.json", "generation_config.json", "adapter_config.json",
               "special_tokens_map.json", "chat_template.jinja", *TOKENIZER_FILES)
WEIGHTS = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")  # ... and the weight files'
# endings (*.safetensors, sharded model-00001-of-00002.safetensors, pytorch_model.bin, their index files)


def check_out(cfg: FinetuneConfig) -> None:
    """Raise unless `cfg.out` is a folder this run may write: writable, and no other run's unless told."""
    out = os.path.abspath(cfg.out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise NotADirectoryError(f"--out {cfg.out!r} is a file, not a folder: give a folder for the trained model")
    existing = out
    while not os.path.exists(existing):  # the nearest existing folder above: os.makedirs creates the rest
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise NotADirectoryError(f"--out {cfg.out!r}: {existing!r} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"--out {cfg.out!r}: cannot write in {existing!r} (permission denied)")
    if os.path.isdir(out) and os.path.isdir(cfg.model) and os.path.samefile(out, cfg.model):
        raise ValueError(f"--out {cfg.out!r} is the --model folder: give another folder (it would replace the "
                         f"model being trained)")
    found = previous_run(cfg.out)
    if found and not cfg.resume and not cfg.overwrite:
        names = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ValueError(f"--out {cfg.out!r} already holds a run or a model ({names}): continue that run with "
                         f"--resume, replace it with --overwrite, or give another --out")


class OutLock:
    """An exclusive lock on an output folder, held until `release` (or the process ends).

    Args:
        out: the folder (created if missing).
    Raises:
        ValueError: another process holds the folder (names its pid).
    """

    def __init__(self, out: str) -> None:
        self.path = os.path.join(out, LOCK_FILE)
        self._fd: int | None = None
        if fcntl is None:
            return
        os.makedirs(out, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(f"--out {out!r} is in use by another run (pid {holder}, which holds {self.path}): "
                             f"wait for it to end, or give another --out") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Let another run have the folder (closing the descriptor drops the lock)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def claim_out(cfg: FinetuneConfig) -> OutLock:
    """`check_out`, then lock `cfg.out` for this run and check it again under the lock (another run may have
    written it in between); the caller releases the lock when the run ends.

    Raises:
        as `check_out`, and ValueError when another run holds the folder (naming its pid).
    """
    check_out(cfg)
    lock = OutLock(cfg.out)
    try:
        check_out(cfg)
    except BaseException:
        lock.release()
        raise
    return lock


def previous_run(out: str) -> list[str]:
    """The files of `out` (and `out/adapter`) a run writes: run record, checkpoint, model, adapters, tokenizer."""
    found = []
    for folder in (out, os.path.join(out, "adapter")):
        if os.path.isdir(folder):
            found += [os.path.relpath(os.path.join(folder, n), out) for n in sorted(os.listdir(folder))
                      if (n in RUN_OUTPUTS or n.endswith(WEIGHTS)) and os.path.isfile(os.path.join(folder, n))]
    return sorted(found, key=lambda n: (n not in (RUN_FILE, CHECKPOINT), not n.endswith(WEIGHTS), n))  # the
    # run's own files first, then the weights


def run_record(cfg: FinetuneConfig, train: Any, held: Any = None) -> dict[str, Any]:
    """The run's settings and a fingerprint of its packed training data (what resume must match).

    With `held` (the --val-size part), the record also lists its documents (`held.selection`: the
    indices of the data file's non-blank rows), so the split can be checked and reproduced.
    """
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()}
    data = {"sequences": len(train), "tokens": train.tokens, "trained": train.trained,
            "sha256": train.fingerprint()}
    if held is not None:
        data["held_out"] = {"documents": [int(i) for i in held.selection], "sha256": held.fingerprint()}
    return {"settings": settings, "data": data}


def remove_previous(out: str) -> None:
    """--overwrite: delete the files a run wrote into `out` (see `previous_run`), saying how many."""
    found = previous_run(out)
    for name in found:
        os.remove(os.path.join(out, name))
    board = os.path.join(out, TENSORBOARD_DIR)
    if os.path.isdir(board):  # the previous run's event files would show beside the new run's
        shutil.rmtree(board)
        found.append(TENSORBOARD_DIR)
    if found:
        print(f"--overwrite: removed {len(found)} files of the previous run or model in {out}")


def read_run(path: str) -> dict[str, Any]:
    """The run record at `path`; ValueError naming it if it is not valid JSON or not a run record."""
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if not isinstance(saved, dict) or not isinstance(saved.get("settings"), dict) or "data" not in saved:
            raise ValueError(f"a JSON {type(saved).__name__}, without 'settings' and 'data'")
    except json.JSONDecodeError as exc:
        why = f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
    except ValueError as exc:  # UnicodeDecodeError included
        why = str(exc)
    else:
        return saved
    raise ValueError(f"--resume: the run record {path!r} is corrupt ({why}); restore it, or start the run over "
                     f"with --overwrite")


def check_resume(cfg: FinetuneConfig, run: dict[str, Any]) -> None:
    """Raise unless out/ holds a checkpoint of a run with the same settings and data."""
    path, ckpt = os.path.join(cfg.out, RUN_FILE), os.path.join(cfg.out, CHECKPOINT)
    if not os.path.isfile(ckpt) or not os.path.isfile(path):
        missing = ckpt if not os.path.isfile(ckpt) else path
        raise FileNotFoundError(f"--resume: {missing!r} does not exist (run with --save-every K to write "
                                f"checkpoints)")
    saved = read_run(path)
    diff = [f"{k}={saved['settings'].get(k)!r} then, {v!r} now" for k, v in run["settings"].items()
            if k not in FREE and saved["settings"].get(k) != v]
    if diff:
        raise ValueError(f"--resume: the settings differ from the run in {cfg.out!r}: {'; '.join(diff)}")
    if saved["data"] != run["data"]:
        brief = lambda d: {k: v for k, v in d.items() if k != "held_out"}  # noqa: E731 - no document lists
        raise ValueError(f"--resume: the training data differs from the run's ({brief(saved['data'])} then, "
                         f"{brief(run['data'])} now)")
