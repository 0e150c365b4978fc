"""Fine-tuning runs you can watch (issue 25): metrics.jsonl and TensorBoard, throughput, the metrics log a resumed
run continues, and the held-out eval. Runs that stop (Ctrl-C, SIGTERM, out of memory, timeouts, a kill) and
resuming them are test_finetune_stop.py; the dry run and the checks before the weights load are
test_finetune_preflight.py. `FLAGS`, `run` and `errors` here are the command line and error lines those files
share; the `files` and `six` fixtures are conftest.py's."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

import rpcompile  # noqa: E402
from rpcompile.cli.main import main  # noqa: E402
from rpcompile.finetune.metrics import read_metrics  # noqa: E402
import hf_fixtures as fx  # noqa: E402

FLAGS = ["--seq", "32", "--micro-batch-size", "2", "--microbatches", "2", "--gpus", "2", "--lr", "3e-3",
         "--warmup", "2", "--memory-gib", str(2**19 / 2**30), "--lm-head-shards", "1", "--no-progress",
         "--steps", "6"]


def errors(capsys) -> list[str]:
    """The command's own lines on stderr (transformers' loading bars left out), and no traceback anywhere."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("python -m rpcompile")]


def run(files, out, *extra) -> int:
    return main(["finetune", "--model", files.model, "--data", files.train, "--out", str(out), *FLAGS, *extra])


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
