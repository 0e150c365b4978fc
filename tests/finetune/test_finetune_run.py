"""Fine-tuning runs you can watch and stop (issue 25): metrics.jsonl and TensorBoard, Ctrl-C, out of memory and
timeouts during training, and resuming after a stop or a kill. The dry run and the checks before the weights load
are test_finetune_preflight.py."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

import rpcompile  # noqa: E402
from rpcompile import checkpoint  # noqa: E402
from rpcompile.finetune.run import CHECKPOINT  # noqa: E402
from rpcompile.cli.main import main  # noqa: E402
from rpcompile.finetune.metrics import read_metrics  # noqa: E402
import hf_fixtures as fx  # noqa: E402

FLAGS = ["--seq", "32", "--micro-batch-size", "2", "--microbatches", "2", "--gpus", "2", "--lr", "3e-3",
         "--warmup", "2", "--memory-gib", str(2**19 / 2**30), "--lm-head-shards", "1", "--no-progress",
         "--steps", "6"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("finetune_run")
    rows = fx.text_rows()
    return SimpleNamespace(model=fx.model_folder(d / "tiny"), train=fx.write_jsonl(d / "train.jsonl", rows[:40]))


def errors(capsys) -> list[str]:
    """The command's own lines on stderr (transformers' loading bars left out), and no traceback anywhere."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("python -m rpcompile")]


def run(files, out, *extra) -> int:
    return main(["finetune", "--model", files.model, "--data", files.train, "--out", str(out), *FLAGS, *extra])


@pytest.fixture(scope="module")
def six(files, tmp_path_factory):
    """A 6-step run with a metrics line per step and TensorBoard, its losses captured from the handle."""
    out = tmp_path_factory.mktemp("six") / "out"
    losses = []
    real = rpcompile.Compiled.step

    def step(self, batch):
        losses.append(real(self, batch))
        return losses[-1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rpcompile.Compiled, "step", step)
        assert run(files, out, "--logging-steps", "1", "--report-to", "tensorboard") == 0
    return SimpleNamespace(out=out, losses=losses)


def test_metrics_file_has_a_line_per_step_with_the_losses(six):
    lines = read_metrics(os.path.join(six.out, "metrics.jsonl"))
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in lines] == six.losses  # the very floats step() returned
    for r in lines:
        assert r["trained_tokens"] > 0 and r["tokens_per_s"] > 0 and r["peak_host_bytes"] > 2**20
        assert r["grad_norm"] > 0 and r["bytes_to_device"] > 0 and "host_waits" in r
        assert any(k.startswith("w0/") for k in r["busy_share"])
    assert [r["lr"] for r in lines[:3]] == pytest.approx([0, 1.5e-3, 3e-3])  # warmup 2: the first update uses 0


def test_tensorboard_reads_six_loss_points(six):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(os.path.join(six.out, "tensorboard"))
    acc.Reload()
    points = acc.Scalars("train/loss")
    assert [p.step for p in points] == [1, 2, 3, 4, 5, 6]
    assert [p.value for p in points] == pytest.approx(six.losses, rel=1e-6)  # stored as float32


def test_logging_steps_thins_the_lines(files, tmp_path):
    assert run(files, tmp_path / "o", "--logging-steps", "4") == 0
    assert [r["step"] for r in read_metrics(os.path.join(tmp_path / "o", "metrics.jsonl"))] == [4, 6]  # and the end


def test_throughput_counts_real_and_trained_tokens_not_padding(files, tmp_path, monkeypatch):
    batches = []
    real = rpcompile.Compiled.step

    def step(self, batch):
        batches.append({k: v.clone() for k, v in batch.items()})
        return real(self, batch)
    monkeypatch.setattr(rpcompile.Compiled, "step", step)
    short = fx.write_jsonl(tmp_path / "short.jsonl",
                           [{"text": " ".join(r["text"].split()[:3])} for r in fx.text_rows(40)])
    assert main(["finetune", "--model", files.model, "--data", short, "--out", str(tmp_path / "o"), *FLAGS,
                 "--packing", "none", "--steps", "3"]) == 0
    pad = fx.tokenizer().pad_token_id  # the fixture's <pad> is no real token: the padding is where it is
    lines = read_metrics(os.path.join(tmp_path / "o", "metrics.jsonl"))
    assert [r["step"] for r in lines] == [1, 2, 3] and len(batches) == 3
    for r, b in zip(lines, batches):
        ids, labels = b["input_ids"], b["labels"]
        tokens, trained = int((ids != pad).sum()), int((labels[:, 1:] != -100).sum())
        assert tokens < 0.8 * ids.numel()  # one short line per padded sequence: padding is a good part
        assert (r["tokens"], r["trained_tokens"]) == (tokens, trained)
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_s"], rel=1e-12)
        assert r["trained_tokens_per_s"] == pytest.approx(trained / r["step_s"], rel=1e-12)
        assert r["padded_tokens_per_s"] == pytest.approx(ids.numel() / r["step_s"], rel=1e-12)


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


def test_a_resumed_log_drops_the_lines_after_its_checkpoint(tmp_path):
    from rpcompile.finetune.metrics import MetricsLog
    with MetricsLog(str(tmp_path)) as log:
        for s in range(1, 6):
            log.write({"step": s, "loss": float(s)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a line torn by a kill
    with MetricsLog(str(tmp_path), resume_at=2) as log:
        log.write({"step": 3, "loss": 30.0, "eval_loss": float("nan")})
    assert read_metrics(str(tmp_path / "metrics.jsonl")) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0},
                                                             {"step": 3, "loss": 30.0, "eval_loss": None}]


@pytest.mark.parametrize("line, why", [(b"[1, 2]", "a JSON list, not an object"),
                                       (b'"text"', "a JSON str, not an object"),
                                       (b'{"step": "3"}', "its \"step\" is '3', not an integer"),
                                       (b'{"step": 3, "loss": "caf\xe9"}', "not UTF-8"), (b"{oops", "not JSON")])
def test_a_resumed_log_refuses_a_line_that_is_not_a_record_naming_the_file_and_line(tmp_path, line, why):
    from rpcompile.finetune.metrics import MetricsLog
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n' + line + b'\n{"step": 4, "loss": 4.0}\n')
    before = path.read_bytes()
    with pytest.raises(ValueError) as err:
        MetricsLog(str(tmp_path), resume_at=2)
    assert str(err.value).startswith(f"the metrics file {str(path)!r} line 3 is not a metrics record ({why}")
    assert str(err.value).endswith("): delete that line, or start the run over with --overwrite")
    assert path.read_bytes() == before


def test_val_size_holds_out_a_seeded_disjoint_part_and_records_it(files, tmp_path, capsys):
    import json
    assert run(files, tmp_path / "a", "--val-size", "0.25", "--steps", "2") == 0
    text = capsys.readouterr().out
    assert "--val-size 0.25: training: 30 documents" in text and "--val-size 0.25: held out: 10 documents" in text
    assert "step 0: eval loss" in text and "(final model)" in text
    with open(tmp_path / "a" / "rpcompile-run.json") as f:
        held = json.load(f)["data"]["held_out"]["documents"]
    assert len(held) == len(set(held)) == 10 and all(0 <= i < 40 for i in held)
    assert [r["step"] for r in read_metrics(os.path.join(tmp_path / "a", "metrics.jsonl")) if "eval_loss" in r] \
        == [0, 2]
    assert run(files, tmp_path / "b", "--val-size", "0.25", "--steps", "2", "--seed", "1") == 0
    with open(tmp_path / "b" / "rpcompile-run.json") as f:
        assert json.load(f)["data"]["held_out"]["documents"] != held  # the seed draws them



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


def test_the_eval_loss_under_split_packing_is_the_eager_token_mean(files):
    """--packing split: continued pieces start with a trained label, which predicts nothing after the shift; the
    eval loss must weigh each batch by its shifted labels, as the eager sum of NLLs / their count does."""
    from transformers import AutoModelForCausalLM
    from rpcompile.finetune.data import prepare
    from rpcompile.finetune.dist import Ranks
    from rpcompile.finetune.loop import evaluate_loss
    from rpcompile.finetune.packed_attention import use_packed_attention
    tok = fx.tokenizer()
    held = prepare(files.train, tok, seq=24, packing="split")
    assert bool((held.labels[:, 0] != -100).any())  # some rows start mid-document, their first label trained
    model = AutoModelForCausalLM.from_pretrained(files.model, local_files_only=True, dtype=torch.float32)
    model.config.use_cache = False
    use_packed_attention(model)
    model.eval()
    with torch.no_grad():
        nll = n = 0.0
        for r in range(len(held)):
            row = held.rows([r])
            logits = model(input_ids=row["input_ids"], position_ids=row["position_ids"]).logits[0, :-1]
            target = row["labels"][0, 1:]
            nll += float(torch.nn.functional.cross_entropy(logits.double(), target, ignore_index=-100,
                                                           reduction="sum"))
            n += int((target != -100).sum())
    with rpcompile.compile(model, gpus=2, example=held.batch(0, 4, seed=0), microbatches=2, loss_mean="tokens",
                           backend="host", dtype=torch.float32) as c:
        got, _ = evaluate_loss(c, held, 4, Ranks())  # (loss, token accuracy)
    assert abs(got - nll / n) < 5e-7, (got, nll / n)  # unshifted counts: off by 4e-6 here (3e-8 when right)
