"""The output folder of a fine-tuning run (`rpcompile.finetune.out`): one run at a time owns it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from rpcompile.cli.main import main  # noqa: E402
from rpcompile.finetune.metrics import read_metrics  # noqa: E402
from rpcompile.finetune.out import LOCK_FILE, OutLock  # noqa: E402
import hf_fixtures as fx  # noqa: E402

FLAGS = ["--seq", "32", "--micro-batch-size", "2", "--microbatches", "2", "--gpus", "2", "--warmup", "0",
         "--memory-gib", str(2**19 / 2**30), "--lm-head-shards", "1", "--no-progress", "--steps", "3"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("out_lock")
    return SimpleNamespace(model=fx.model_folder(d / "tiny"), train=fx.write_jsonl(d / "train.jsonl", fx.text_rows()[:24]))


def argv(files, out, lr):
    return ["finetune", "--model", files.model, "--data", files.train, "--out", str(out), "--lr", lr, *FLAGS]


def test_two_runs_started_at_once_on_one_out_one_trains_the_other_is_refused(files, tmp_path):
    out = tmp_path / "shared"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = {lr: subprocess.Popen([sys.executable, "-m", "rpcompile", *argv(files, out, lr)], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for lr in ("1e-3", "2e-3")}
    done = {lr: (p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for lr, p in runs.items()}
    codes = sorted(code for code, _, _ in done.values())
    assert codes == [0, 2], {lr: (c, e[-1500:]) for lr, (c, _, e) in done.items()}
    (won,) = [lr for lr, (c, _, _) in done.items() if c == 0]
    (lost,) = [lr for lr, (c, _, _) in done.items() if c == 2]
    refusal = [line for line in done[lost][2].splitlines() if line.startswith("python -m rpcompile")]
    assert len(refusal) == 1 and "Traceback" not in done[lost][2]
    assert (f"is in use by another run (pid {runs[won].pid}" in refusal[0]  # refused while the other trains, or
            or "already holds a run or a model" in refusal[0]), refusal  # (had it finished first) by its files
    with open(out / "rpcompile-run.json") as f:
        assert json.load(f)["settings"]["lr"] == float(won)  # the folder is the winner's alone
    assert [r["step"] for r in read_metrics(str(out / "metrics.jsonl"))] == [1, 2, 3]


def test_a_held_folder_is_refused_at_once_naming_the_pid_and_free_again_after_release(files, tmp_path, capsys):
    out = tmp_path / "o"
    lock = OutLock(str(out))
    assert main(argv(files, out, "1e-3")) == 2
    err = capsys.readouterr().err
    assert f"--out {str(out)!r} is in use by another run (pid {os.getpid()}, which holds {out / LOCK_FILE})" in err
    assert os.listdir(out) == [LOCK_FILE]  # nothing was written
    lock.release()
    assert main(argv(files, out, "1e-3")) == 0
    assert main(argv(files, out, "1e-3") + ["--overwrite"]) == 0  # the lock of the ended run is free


KILLED = r"""
import os, sys
from rpcompile.finetune.out import OutLock
lock = OutLock(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()  # held until killed
"""


def test_a_killed_runs_lock_does_not_block(files, tmp_path):
    out = tmp_path / "o"
    p = subprocess.Popen([sys.executable, "-c", KILLED, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline() == "locked\n"
    with pytest.raises(ValueError, match=f"pid {p.pid}"):
        OutLock(str(out))
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert main(argv(files, out, "1e-3")) == 0
