"""Fine-tuning runs that stop (issue 25): Ctrl-C and SIGTERM (one line, exit 130 or 143, the checkpoint kept), out of
memory and timeouts during training, and resuming after a stop or a kill as the same run, bit for bit. The runs
you watch (metrics.jsonl, TensorBoard, the held-out eval) are test_finetune_run.py; the 6-step run a resumed one
must repeat is conftest.py's `six`."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("transformers")

import rpcompile  # noqa: E402
from rpcompile import checkpoint  # noqa: E402
from rpcompile.finetune.run import CHECKPOINT  # noqa: E402
from rpcompile.cli.main import main  # noqa: E402
from rpcompile.finetune.metrics import read_metrics  # noqa: E402
import hf_fixtures as fx  # noqa: E402
from test_finetune_run import FLAGS, errors, run  # noqa: E402 - the same command line and error lines


def _interrupt_in_step(n: int):
    """A Compiled.step that gets a real SIGINT while the caller waits inside step `n` (1-based)."""
    real = rpcompile.Compiled.step

    def step(self, batch):
        if self.steps == n - 1:
            its = self._runtime.iterations
            read = its.read_losses

            def slow(t, ctx, give):
                if threading.current_thread() is threading.main_thread():
                    threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
                    threading.Event().wait(5)  # interrupted by the signal's KeyboardInterrupt
                return read(t, ctx, give)
            its.read_losses = slow
        return real(self, batch)
    return step


def _count_tokenizer_calls(monkeypatch) -> list[str]:
    """Record every tokenizing call of any Hugging Face tokenizer from now on."""
    from transformers import PreTrainedTokenizerBase
    calls: list[str] = []
    for name in ("__call__", "encode", "batch_encode_plus", "encode_plus", "apply_chat_template"):
        real = getattr(PreTrainedTokenizerBase, name, None)
        if real is None:  # not in this transformers version
            continue
        monkeypatch.setattr(PreTrainedTokenizerBase, name,
                            lambda self, *a, _n=name, _f=real, **k: (calls.append(_n), _f(self, *a, **k))[1])
    return calls


def test_ctrl_c_in_step_3_exits_130_and_resuming_logs_each_step_once(files, six, tmp_path, monkeypatch, capsys):
    out = tmp_path / "o"
    with monkeypatch.context() as mp:
        mp.setattr(rpcompile.Compiled, "step", _interrupt_in_step(3))
        assert run(files, out, "--save-every", "1") == 130
    mine = errors(capsys)  # no traceback, and one line that says what was kept
    assert len(mine) == 1 and re.fullmatch(r"python -m rpcompile finetune: interrupted in step 3 \((undone|finished), "
                                           r"the checkpoint of step 2 is kept; continue with --resume\)", mine[0]), mine
    saved = checkpoint.load(os.path.join(out, CHECKPOINT))  # loadable
    assert saved["steps"] in (2, 3)  # step 3 undone, or finished if its update had begun
    calls = _count_tokenizer_calls(monkeypatch)
    assert run(files, out, "--save-every", "1", "--resume") == 0
    assert calls == [] and "token cache: hit, nothing tokenized" in capsys.readouterr().out  # read from OUT
    lines = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in lines] == six.losses  # and the same run, bit for bit


SIGTERM_IN_STEP_3 = r"""
import os, signal, sys, threading
import rpcompile
from rpcompile.cli.main import main
real = rpcompile.Compiled.step
def step(self, batch):  # SIGTERM from outside while the caller waits inside step 3
    if self.steps == 2:
        its = self._runtime.iterations
        read = its.read_losses
        def slow(t, ctx, give):
            if threading.current_thread() is threading.main_thread():
                os.kill(os.getppid(), signal.SIGUSR1)  # the test sends SIGTERM now
                threading.Event().wait(60)  # ended by the SIGTERM
            return read(t, ctx, give)
        its.read_losses = slow
    return real(self, batch)
rpcompile.Compiled.step = step
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # a fresh process: its imports
def test_sigterm_in_step_3_is_one_line_exit_143_and_resume_continues_the_same_run(files, six, tmp_path, capsys):
    """What a cluster scheduler sends: handled as Ctrl-C (the step undone, the checkpoint kept), one line, 143."""
    out = tmp_path / "o"
    argv = ["finetune", "--model", files.model, "--data", files.train, "--out", str(out), *FLAGS, "--save-every", "1"]
    asked = threading.Event()
    previous = signal.signal(signal.SIGUSR1, lambda *_: asked.set())
    try:
        p = subprocess.Popen([sys.executable, "-c", SIGTERM_IN_STEP_3, *argv], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        assert asked.wait(300), "the run never reached step 3"
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert p.returncode == 143 and "Traceback" not in err, (p.returncode, err[-2000:])
    mine = [line for line in err.splitlines() if line.startswith("python -m rpcompile")]
    assert re.fullmatch(r"python -m rpcompile finetune: terminated \(SIGTERM\) in step 3 \((undone|finished), the "
                        r"checkpoint of step 2 is kept; continue with --resume\)", "\n".join(mine)), err[-2000:]
    assert checkpoint.load(os.path.join(out, CHECKPOINT))["steps"] in (2, 3)
    assert run(files, out, "--save-every", "1", "--resume") == 0
    lines = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in lines] == six.losses  # the same run, bit for bit


def test_the_sigterm_handler_is_the_commands_only(tmp_path):
    """main() sets its SIGTERM handler for the command's run and puts the previous one back, on every exit."""
    def mine(*_):
        pass
    previous = signal.signal(signal.SIGTERM, mine)
    try:
        assert main(["simulate", "--program", str(tmp_path / "missing.csv")]) == 2
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_out_of_memory_in_step_4_is_one_line_and_the_step_2_checkpoint_loads(files, tmp_path, monkeypatch, capsys):
    real = rpcompile.Compiled.step

    def step(self, batch):
        if self.steps == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(self, batch)
    monkeypatch.setattr(rpcompile.Compiled, "step", step)
    out = tmp_path / "o"
    assert run(files, out, "--save-every", "2") == 2
    err = errors(capsys)
    assert len(err) == 1, err
    assert "out of device memory in step 4" in err[0] and "--micro-batch-size" in err[0] and "step 2" in err[0]
    assert checkpoint.load(os.path.join(out, CHECKPOINT))["steps"] == 2
    assert [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3]


def test_a_worker_out_of_memory_names_the_worker_and_the_stage(files, tmp_path, monkeypatch, capsys):
    real = rpcompile.Compiled.step

    def step(self, batch):
        if self.steps == 1:
            fused = self._runtime.handlers[rpcompile.Op.FUSED]

            def oom(t, ins, dev):
                raise torch.OutOfMemoryError("CUDA out of memory")
            self._runtime.handlers[rpcompile.Op.FUSED] = lambda t, ins, dev: oom(t, ins, dev) if t == 1 else \
                fused(t, ins, dev)
        return real(self, batch)
    monkeypatch.setattr(rpcompile.Compiled, "step", step)
    assert run(files, tmp_path / "o") == 2
    err = errors(capsys)
    assert len(err) == 1 and "out of device memory in step 2 on worker" in err[0] and ", stage " in err[0], err


def test_a_wait_past_timeout_is_one_line_naming_the_instruction_and_a_file_with_the_grid(files, tmp_path, monkeypatch,
                                                                                         capsys):
    """Step 2's layer 1 sleeps 1 s under --timeout 0.6: exit 1, one line, the grid and tracebacks in OUT."""
    real = rpcompile.Compiled.step

    def step(self, batch):
        if self.steps == 1:
            for runner in self._runtime.runners:
                def slow(index, *rest, orig=runner.run_layer):
                    if index == 1:
                        time.sleep(1.0)
                    return orig(index, *rest)
                runner.run_layer = slow
        return real(self, batch)
    monkeypatch.setattr(rpcompile.Compiled, "step", step)
    out = tmp_path / "o"
    assert run(files, out, "--timeout", "0.6", "--save-every", "1") == 1
    (line,) = errors(capsys)
    path = os.path.join(out, "rpcompile-failure.txt")
    assert re.fullmatch(r"python -m rpcompile finetune: error: step 2 failed: (instruction (w\d \S+|h \S+) "
                        r"\((worker \d|the host)\)|the \w+ stream of worker \d) waited 0.6 s for .+ \(the deadline: "
                        r"raise it with --timeout "
                        r"SECONDS if the machine is just slow\); the checkpoint of step 1 is kept; the instruction "
                        rf"grid and tracebacks are in {re.escape(path)}", line), line
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert "--- worker traceback ---" in text and "DeadlineExceeded" in text and "step  w0" in text  # the grid
    if "failed: instruction " in line:  # the grid marks it
        assert f">>{line.split('failed: instruction ')[1].split(' (')[0].split()[1]}<<" in text
    assert checkpoint.load(os.path.join(out, CHECKPOINT))["steps"] == 1


def test_a_one_ms_timeout_ends_every_run_in_one_line_and_exit_1(files, tmp_path, capsys):
    """--timeout 0.001, 10 runs: each ends with exit status 1 and one line naming the step that failed, never the
    recovery's "did not drain" traceback (from the step, or from closing the handle after it)."""
    for i in range(10):
        assert run(files, tmp_path / f"o{i}", "--timeout", "0.001") == 1
        (line,) = errors(capsys)
        assert re.match(r"python -m rpcompile finetune: error: step \d+ failed: .* waited ", line), line


def test_a_token_cache_overwritten_in_place_is_rebuilt_before_a_resume_trains_on_it(files, six, tmp_path,
                                                                                   monkeypatch, capsys):
    """ids.i32 rewritten with the same size and other tokens between a stop and --resume: rebuilt, same run."""
    out = tmp_path / "o"
    with monkeypatch.context() as mp:
        mp.setattr(rpcompile.Compiled, "step", _interrupt_in_step(4))
        assert run(files, out, "--save-every", "1") == 130
    (key,) = os.listdir(out / "token-cache")
    ids = out / "token-cache" / key / "ids.i32"
    data = ids.read_bytes()
    ids.write_bytes(data[4:] + data[:4])  # same size: only the content digest tells
    capsys.readouterr()
    assert run(files, out, "--save-every", "1", "--resume") == 0
    captured = capsys.readouterr()
    assert "token cache: hit" not in captured.out and ids.read_bytes() == data
    assert f"token cache {out / 'token-cache' / key}: damaged, its files' sha256 is not the one in meta.json" \
        in captured.err
    lines = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["loss"] for r in lines] == six.losses  # steps 4-6 trained on the right tokens


KILL_AT_CHECKPOINT = r"""
import os, signal, sys
from rpcompile.finetune import FinetuneConfig, finetune
from rpcompile.finetune.metrics import MetricsLog
model, train, held, out, where, mem = sys.argv[1:]
cfg = FinetuneConfig(model=model, data=train, eval=held, out=out, seq=32, micro_batch_size=2, microbatches=2, gpus=2,
                     steps=6, save_every=2, eval_every=2, memory_gib=float(mem), lm_head_shards=1, progress=False,
                     lr=3e-3, warmup=2)
kill = lambda: os.kill(os.getpid(), signal.SIGKILL)
if where == "eval line":  # right after step 4's line with its eval loss is written
    real = MetricsLog.write
    def write(self, record):
        real(self, record)
        if record.get("step") == 4 and "eval_loss" in record:
            kill()
    MetricsLog.write = write
finetune(cfg, on_step=lambda step, loss: kill() if where == "after step" and step == 4 else None)
"""


@pytest.mark.parametrize("where", ["after step", "eval line"])
def test_a_kill_at_a_checkpoint_step_never_loses_the_eval_the_checkpoint_covers(files, tmp_path, where):
    """--save-every 2 --eval-every 2, SIGKILL after step 4 (checkpoint and eval done) or as its eval line is
    written: the resumed run's metrics hold every eval, at steps 0, 2, 4 and 6, each step's line once."""
    out, held = tmp_path / "o", fx.write_jsonl(tmp_path / "held.jsonl", fx.text_rows()[40:48])
    r = subprocess.run([sys.executable, "-c", KILL_AT_CHECKPOINT, files.model, files.train, held, str(out), where,
                        str(2**19 / 2**30)], capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    flags = ["--eval", held, "--save-every", "2", "--eval-every", "2"]
    assert run(files, out, *flags, "--resume") == 0
    lines = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in lines if "eval_loss" in r] == [0, 2, 4, 6]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4, 5, 6]
