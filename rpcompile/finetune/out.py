"""The output folder of a fine-tuning run: what a run writes there, what it refuses, what a resume must match.

    >>> check_out(cfg)          # raises unless cfg.out may be written (see finetune's docstring)  # doctest: +SKIP
    >>> lock = claim_out(cfg)   # check_out (and check_resume); the folder is this run's alone    # doctest: +SKIP
    >>> lock.hold(cfg)          # just before the run writes: OUT created if new, and locked      # doctest: +SKIP
    >>> check_resume_data(cfg, run_record(cfg, train)); ...; lock.release()                      # doctest: +SKIP

One run owns its output folder: `claim_out` takes an exclusive lock (`fcntl.flock` on the folder
itself, opened read-only) for the whole run, so a second run on the same folder is refused at once,
naming the pid that holds it (read from /proc/locks where there is one). Nothing is written for the
lock, and a refused command writes nothing at all: every check (`check_out`, and for a resume
`check_resume`: the checkpoint is there, the settings are the run's) comes before any write, and a
folder that does not exist yet is created, and locked, only by `OutLock.hold`, when the run starts
writing into it. The operating system releases the lock with the process, so a killed run leaves no
lock behind. Where there is no `flock` (Windows), or the file system refuses one on a folder, there is
no lock.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from typing import Any, Callable, Iterator

try:
    import fcntl  # POSIX only: no lock without it
except ImportError:  # pragma: no cover - Windows
    fcntl = None

from rpcompile.finetune.config import FinetuneConfig
from rpcompile.finetune.hf import TOKENIZER_FILES
from rpcompile.finetune.metrics import METRICS_FILE, TENSORBOARD_DIR, read_records

__all__ = ["CHECKPOINT", "RUN_FILE", "TOKEN_CACHE", "FREE", "PATHS", "OutLock", "check_out", "claim_out",
           "previous_run", "remove_previous", "run_settings", "run_record", "read_run", "check_resume",
           "check_resume_data", "taken_back_if_refused"]

CHECKPOINT = "rpcompile-checkpoint.rp"  # in `out`: the training state (rpcompile.load format)
RUN_FILE = "rpcompile-run.json"  # in `out`: the run's settings and data fingerprint, checked on resume
TOKEN_CACHE = "token-cache"  # in `out`: the tokenized data files (rpcompile.finetune.data.token_cache), kept for reruns
# a resume may change these (the data file is checked by the fingerprint of its packed tokens, not its path)
FREE = ("out", "data", "resume", "overwrite", "save_every", "eval", "eval_every", "progress", "logging_steps",
        "report_to", "dry_run", "num_proc", "timeout", "dist_timeout", "shard_state")
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
    """An exclusive lock on an output folder (`flock` on the folder itself), held until `release` (or the process
    ends); nothing is written for it.

    Args:
        out: the folder; locked now if it exists, else by `hold`, which creates it.
    Raises:
        ValueError: another process holds the folder (names its pid where /proc/locks tells it).
    """

    def __init__(self, out: str) -> None:
        self.out = out
        self._fd: int | None = None
        self.held = False  # this run owns the folder: it locked it (or the platform has no lock to take)
        if os.path.isdir(out):
            self._lock()

    def _lock(self) -> None:
        """Lock the existing folder `out` (no lock where the platform or the file system has none)."""
        if fcntl is None:
            self.held = True
            return
        try:
            fd = os.open(self.out, os.O_RDONLY)
        except OSError as exc:
            raise PermissionError(f"--out {self.out!r}: cannot open the folder to lock it ({exc.strerror or exc})") \
                from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            pid = f"pid {holder}" if holder is not None else "another process"
            raise ValueError(f"--out {self.out!r} is in use by another run ({pid} holds a lock on that folder): wait "
                             f"for it to end, or give another --out") from None
        except OSError:  # no flock on this file system (some network ones): no lock, as on Windows
            os.close(fd)
            self.held = True
            return
        except BaseException:
            os.close(fd)
            raise
        self._fd, self.held = fd, True

    def hold(self, cfg: FinetuneConfig) -> None:
        """The run starts writing: create `out` if it does not exist, lock it if it is not locked yet, and check it
        again under the lock (another run may have written it since `claim_out`); raises as `claim_out`."""
        if self._fd is None:
            os.makedirs(self.out, exist_ok=True)
            self._lock()
        _check_claim(cfg)

    def release(self) -> None:
        """Let another run have the folder (closing the descriptor drops the lock)."""
        self.held = False
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _lock_holder(fd: int) -> int | None:
    """The pid that holds a flock on the file open as `fd`, from /proc/locks (None where that is not known)."""
    st = os.fstat(fd)
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 12923 fe:00:2146710 0 EOF" (device numbers in hex)
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":  # a waiter's line reads "1: -> FLOCK ..."
            continue
        dev = fields[5].split(":")
        try:
            if len(dev) == 3 and (int(dev[0], 16), int(dev[1], 16), int(dev[2])) == (
                    os.major(st.st_dev), os.minor(st.st_dev), st.st_ino):
                return int(fields[4])
        except ValueError:
            continue
    return None


def claim_out(cfg: FinetuneConfig) -> OutLock:
    """`check_out` (and with `resume`, `check_resume`), then lock `cfg.out` for this run if it exists (else
    `OutLock.hold` creates and locks it) and check again under the lock; nothing is written. The caller
    calls `hold` before the run writes into `cfg.out`, and releases the lock when the run ends.

    Raises:
        as `check_out` and `check_resume`, and ValueError when another run holds the folder (naming its pid).
    """
    _check_claim(cfg)
    lock = OutLock(cfg.out)
    try:
        _check_claim(cfg)
    except BaseException:
        lock.release()
        raise
    return lock


def _check_claim(cfg: FinetuneConfig) -> None:
    """What a run checks of `cfg.out` before it may write there: `check_out`, and `check_resume` for a resume."""
    check_out(cfg)
    if cfg.resume:
        check_resume(cfg)


def previous_run(out: str) -> list[str]:
    """The files of `out` (and `out/adapter`) a run writes: run record, checkpoint, model, adapters, tokenizer."""
    found = []
    for folder in (out, os.path.join(out, "adapter")):
        if os.path.isdir(folder):
            found += [os.path.relpath(os.path.join(folder, n), out) for n in sorted(os.listdir(folder))
                      if (n in RUN_OUTPUTS or n.endswith(WEIGHTS)) and os.path.isfile(os.path.join(folder, n))]
    return sorted(found, key=lambda n: (n not in (RUN_FILE, CHECKPOINT), not n.endswith(WEIGHTS), n))  # the
    # run's own files first, then the weights


def run_settings(cfg: FinetuneConfig) -> dict[str, Any]:
    """The run record's "settings": every field of `cfg`, tuples as lists (JSON)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()}


def run_record(cfg: FinetuneConfig, train: Any, held: Any = None) -> dict[str, Any]:
    """The run's settings and a fingerprint of its packed training data (what resume must match).

    With `held` (the --val-size part), the record also lists its documents (`held.selection`: the
    indices of the data file's non-blank rows), so the split can be checked and reproduced.
    """
    data = {"sequences": len(train), "tokens": train.tokens, "trained": train.trained,
            "sha256": train.fingerprint()}
    if held is not None:
        data["held_out"] = {"documents": [int(i) for i in held.selection], "sha256": held.fingerprint()}
    return {"settings": run_settings(cfg), "data": data}


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


def check_resume(cfg: FinetuneConfig) -> None:
    """Raise unless out/ holds a checkpoint, the record of a run with the same settings and a metrics file of records
    (checked before anything is read or written; the data is `check_resume_data`'s, once it is packed).

    The paths among the settings (`PATHS`) are compared as the files they name: `tiny`, `tiny/`, `./tiny` and
    its absolute path are one model folder (a relative path is taken from the current folder).
    """
    path, ckpt = os.path.join(cfg.out, RUN_FILE), os.path.join(cfg.out, CHECKPOINT)
    if not os.path.isfile(ckpt) or not os.path.isfile(path):
        missing = ckpt if not os.path.isfile(ckpt) else path
        raise FileNotFoundError(f"--resume: {missing!r} does not exist (run with --save-every K to write "
                                f"checkpoints)")
    saved = read_run(path)["settings"]
    diff = [f"{k}={saved.get(k)!r} then, {v!r} now" for k, v in run_settings(cfg).items()
            if k not in FREE and not _same_setting(k, saved.get(k), v)]
    if diff:
        raise ValueError(f"--resume: the settings differ from the run in {cfg.out!r}: {'; '.join(diff)}")
    metrics = os.path.join(cfg.out, METRICS_FILE)
    if os.path.isfile(metrics):
        read_records(metrics)  # the lines the resumed run keeps: refused now, before anything is written


PATHS = ("model", "chat_template")  # settings that name a file or folder: compared as resolved paths


def _same_setting(key: str, then: Any, now: Any) -> bool:
    """Whether a setting of the run record (`then`) and of this run (`now`) are the same; paths resolved."""
    if key in PATHS and isinstance(then, str) and isinstance(now, str):
        return os.path.realpath(then) == os.path.realpath(now)
    return then == now


def check_resume_data(cfg: FinetuneConfig, run: dict[str, Any]) -> None:
    """Raise unless the run record in out/ holds the training data of `run` (its fingerprint)."""
    saved = read_run(os.path.join(cfg.out, RUN_FILE))
    if saved["data"] != run["data"]:
        brief = lambda d: {k: v for k, v in d.items() if k != "held_out"}  # noqa: E731 - no document lists
        raise ValueError(f"--resume: the training data differs from the run's ({brief(saved['data'])} then, "
                         f"{brief(run['data'])} now)")


@contextlib.contextmanager
def taken_back_if_refused(out: str, active: bool = True, held: Callable[[], bool] = lambda: True) -> Iterator[None]:
    """While a run prepares (its token cache, the data and memory checks), a refusal or an interrupt takes back
    what it wrote into `out`: the folder itself if this run made it, else the token-cache entries it added.
    Only while `held()` (the run owns the folder's lock): a run refused because another one holds the folder
    touches nothing of it (two runs started at once both find no folder; the one that loses the lock must
    not remove what the other is writing).

    So a run refused before it trains leaves `out` as it found it (a data file that changed under `--resume`,
    a run that cannot fit the RAM); a cache entry it rebuilt in place (a damaged one) stays rebuilt.

        >>> import tempfile; out = os.path.join(tempfile.mkdtemp(), "o")
        >>> try:
        ...     with taken_back_if_refused(out):
        ...         os.makedirs(os.path.join(out, TOKEN_CACHE, "abc")); raise ValueError("refused")
        ... except ValueError:
        ...     os.path.exists(out)
        False
    """
    if not active:
        yield
        return
    made = not os.path.lexists(out)
    cache = os.path.join(out, TOKEN_CACHE)
    before = set(os.listdir(cache)) if os.path.isdir(cache) else None
    try:
        yield
    except BaseException:
        if not held():
            raise
        if made:
            shutil.rmtree(out, ignore_errors=True)
        elif os.path.isdir(cache):
            added = set(os.listdir(cache)) - (before or set())
            for name in added if before is not None else [""]:  # a cache folder it made goes whole
                shutil.rmtree(os.path.join(cache, name), ignore_errors=True)
        raise
