"""The output folder of a fine-tuning run (`rpcompile.finetune.out`): one run at a time owns it, a refused command
writes nothing into it, and a resume matches its run's settings (paths as the folders they name)."""
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
from rpcompile.finetune import FinetuneConfig  # noqa: E402
from rpcompile.finetune.out import CHECKPOINT, RUN_FILE, OutLock, check_resume, run_settings  # noqa: E402
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
    out.mkdir()
    lock = OutLock(str(out))
    assert os.listdir(out) == []  # the lock is on the folder itself: nothing is written for it
    assert main(argv(files, out, "1e-3")) == 2
    err = capsys.readouterr().err
    assert f"--out {str(out)!r} is in use by another run (pid {os.getpid()} holds a lock on that folder)" in err
    assert os.listdir(out) == []  # nothing was written
    lock.release()
    assert main(argv(files, out, "1e-3")) == 0
    assert main(argv(files, out, "1e-3") + ["--overwrite"]) == 0  # the lock of the ended run is free


KILLED = r"""
import os, sys
from rpcompile.finetune.out import OutLock
os.makedirs(sys.argv[1])
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


def tree(root) -> dict:
    """Every folder and file under `root`: a file's size, mtime and bytes (None: `root` does not exist)."""
    if not os.path.exists(root):
        return None
    found = {}
    for folder, dirs, names in os.walk(root):
        for n in dirs:
            found[os.path.relpath(os.path.join(folder, n), root)] = "folder"
        for n in names:
            path = os.path.join(folder, n)
            st = os.stat(path)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns, f.read())
    return found


@pytest.fixture(scope="module")
def finished(files, tmp_path_factory):
    """A finished 3-step run with a checkpoint, and one without (--save-every 0)."""
    d = tmp_path_factory.mktemp("finished")
    assert main(argv(files, d / "saved", "1e-3") + ["--save-every", "3"]) == 0
    assert main(argv(files, d / "unsaved", "1e-3")) == 0
    return SimpleNamespace(saved=d / "saved", unsaved=d / "unsaved")


def test_a_refused_command_writes_nothing_into_out_and_creates_no_folder(files, finished, tmp_path, capsys):
    """Bad values, a resume with other settings, a resume with no checkpoint or a bad metrics line, a model folder
    that is not one: refused in one line, OUT's tree (names, sizes, mtimes, bytes) as it was, a new OUT not made."""
    nothing = tmp_path / "typo"
    (tmp_path / "not-a-model").mkdir()
    cases = [(nothing, ["--steps", "0"]), (nothing, ["--resume"]),
             (nothing, ["--model", str(tmp_path / "not-a-model")]),
             (finished.saved, ["--resume", "--lr", "2e-3"]), (finished.saved, ["--resume", "--seq", "16"]),
             (finished.unsaved, ["--resume"]), (finished.saved, ["--lr", "2e-3"]),
             (finished.saved, ["--resume", "--model", str(tmp_path / "not-a-model")])]
    for out, extra in cases:
        before = tree(out)
        capsys.readouterr()
        assert main([*argv(files, out, "1e-3"), *extra]) == 2, extra
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("python -m rpcompile")]
        assert len(err) == 1, (extra, err)
        assert tree(out) == before, (out, extra)
    metrics = finished.saved / "metrics.jsonl"
    good = metrics.read_bytes()
    try:
        metrics.write_bytes(good + b"[1, 2]\n")
        before = tree(finished.saved)
        assert main([*argv(files, finished.saved, "1e-3"), "--resume"]) == 2
        assert f"the metrics file {str(metrics)!r} line 4 is not a metrics record" in capsys.readouterr().err
        assert tree(finished.saved) == before
    finally:
        metrics.write_bytes(good)


def test_a_run_refused_after_its_data_is_prepared_takes_back_what_it_wrote(files, finished, tmp_path, monkeypatch,
                                                                            capsys):
    """Refusals that come after the token cache is built: a new run that cannot fit the RAM leaves no OUT, and a
    resume whose data file changed leaves the finished run's tree (its token cache included) as it was."""
    with monkeypatch.context() as m:
        m.setattr("rpcompile.ir.hardware._host_memory", lambda: 2**18)
        assert main(argv(files, tmp_path / "new", "1e-3")) == 2
    assert "host memory: the run needs" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    other = tmp_path / "other.jsonl"
    rows = [json.loads(line) for line in open(files.train, encoding="utf-8")]
    fx.write_jsonl(other, [{"text": r["text"] + " and more"} for r in rows])
    before = tree(finished.saved)
    capsys.readouterr()
    args = argv(files, finished.saved, "1e-3")
    args[args.index("--data") + 1] = str(other)
    assert main([*args, "--resume"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("python -m rpcompile")]
    assert len(err) == 1 and "data" in err[0], err
    assert tree(finished.saved) == before


def test_epochs_that_make_more_steps_than_a_count_holds_are_refused_naming_epochs(files, tmp_path, capsys):
    """--epochs 1e12 is finite, but its steps are not countable (the run would never end): one line naming it."""
    args = argv(files, tmp_path / "o", "1e-3")
    i = args.index("--steps")
    del args[i:i + 2]
    assert main([*args, "--epochs", "1e12"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("python -m rpcompile")]
    assert len(err) == 1 and "--epochs 1e+12 makes" in err[0], err
    assert not (tmp_path / "o").exists()


def test_resume_takes_the_model_folder_however_its_path_is_spelled(files, tmp_path, monkeypatch):
    """`tiny`, `tiny/`, `./tiny` and the absolute path are one folder (chat templates too); another folder is not."""
    import shutil
    monkeypatch.chdir(os.path.dirname(files.model))
    name = os.path.basename(files.model)
    (tmp_path / "chat.jinja").write_text("{{ messages }}")
    out = tmp_path / "run"
    out.mkdir()
    cfg = FinetuneConfig(model=name, data=files.train, out=str(out), chat_template=str(tmp_path / "chat.jinja"))
    (out / RUN_FILE).write_text(json.dumps({"settings": run_settings(cfg), "data": {}}))
    (out / CHECKPOINT).write_bytes(b"a checkpoint")
    up = os.path.join("..", os.path.basename(os.getcwd()), name)
    for spelling in (name, name + "/", f"./{name}", os.path.abspath(name), f"{name}//", up):
        check_resume(FinetuneConfig(model=spelling, data=files.train, out=str(out), resume=True,
                                    chat_template=os.path.relpath(tmp_path / "chat.jinja")))
    other = shutil.copytree(files.model, tmp_path / name)  # the same files, another folder
    with pytest.raises(ValueError, match=f"the settings differ .* model={name!r} then, {str(other)!r} now"):
        check_resume(FinetuneConfig(model=str(other), data=files.train, out=str(out), resume=True,
                                    chat_template=str(tmp_path / "chat.jinja")))


@pytest.mark.parametrize("key", ["state_dtype", "master_dtype", "grad_dtype"])
def test_the_run_record_holds_the_state_dtypes_and_a_resume_with_another_is_refused_naming_both(files, tmp_path, key):
    out = tmp_path / "run"
    out.mkdir()
    cfg = FinetuneConfig(model=files.model, data=files.train, out=str(out), **{key: "bf16"})
    assert run_settings(cfg)[key] == "bf16"
    (out / RUN_FILE).write_text(json.dumps({"settings": run_settings(cfg), "data": {}}))
    (out / CHECKPOINT).write_bytes(b"a checkpoint")
    check_resume(FinetuneConfig(model=files.model, data=files.train, out=str(out), resume=True, **{key: "bf16"}))
    with pytest.raises(ValueError, match=f"the settings differ .*{key}='bf16' then, 'fp32' now"):
        check_resume(FinetuneConfig(model=files.model, data=files.train, out=str(out), resume=True))


def test_a_run_refused_because_another_holds_the_folder_takes_nothing_back(tmp_path):
    # two runs started at once both find no folder; the one that then loses the lock must not remove the folder
    # (or the token cache) the other is writing
    from rpcompile.finetune.out import taken_back_if_refused
    out = tmp_path / "o"
    mine = OutLock(str(out))  # no folder yet: nothing locked
    with pytest.raises(ValueError, match="is in use by another run"):
        with taken_back_if_refused(str(out), held=lambda: mine.held):
            other = OutLock(str(out))
            other.hold(FinetuneConfig(model="m", data="d", out=str(out)))  # the other run makes it and locks it
            (out / "token-cache" / "abc").mkdir(parents=True)  # ... and writes its cache
            mine.hold(FinetuneConfig(model="m", data="d", out=str(out)))  # refused: the folder is the other's
    assert (out / "token-cache" / "abc").is_dir() and not mine.held and other.held
    other.release()
