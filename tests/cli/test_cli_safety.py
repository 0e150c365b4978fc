"""Nothing lost, nothing misread (issue 23 items 1, 2 and 7): the commands never overwrite a finished run,
check where they will write before the work starts, turn file and floating-point errors into one line,
never pack a sequence that predicts nothing, read JSONL by "\\n" only, name a bad data file or run record,
and write their JSON atomically.

The fine-tuning runs use the tiny local model of tests/hf_fixtures.py (2 host workers, a few steps).
"""
import json
import math
import os
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from rpcompile.finetune import FinetuneConfig, finetune  # noqa: E402
from rpcompile.finetune.data import IGNORE, Document, pack, read_documents  # noqa: E402
from rpcompile.finetune.run import CHECKPOINT, RUN_FILE  # noqa: E402
from rpcompile.cli.main import main  # noqa: E402
import hf_fixtures as fx  # noqa: E402

SEQ = 32
SMALL = dict(seq=SEQ, gpus=2, lr=3e-3, progress=False, memory_gib=2**19 / 2**30, lm_head_shards=1)


def tail_rows(tok) -> list[dict]:
    """Corpus rows whose packing into SEQ-token sequences leaves exactly one token for the last sequence."""
    rows, total = [], 0
    for r in fx.text_rows(60):
        rows.append(r)
        total += len(tok(r["text"])["input_ids"]) + 1  # the document and its EOS
        if total % SEQ == 1 and total > 4 * SEQ:
            return rows
    return rows + [{"text": ""}] * ((1 - total) % SEQ)  # each empty document adds one token (its EOS)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from transformers import AutoTokenizer
    d = tmp_path_factory.mktemp("safety")
    model = fx.model_folder(d / "tiny")
    tok = AutoTokenizer.from_pretrained(model)
    return SimpleNamespace(dir=d, tok=tok, model=model,
                           tail=fx.write_jsonl(d / "tail.jsonl", tail_rows(tok)),
                           train=fx.write_jsonl(d / "train.jsonl", fx.text_rows(24)))


def one_line(capsys, *argv) -> str:
    """main(argv) must exit 2 with one line on stderr and no traceback; returns the line."""
    capsys.readouterr()
    rc = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (rc, err)
    return err


def finetune_args(files, out, *extra) -> list[str]:
    return ["finetune", "--model", files.model, "--data", files.train, "--out", str(out), "--seq", str(SEQ),
            "--gpus", "2", "--microbatches", "2", "--micro-batch-size", "2", "--memory-gib", str(2**19 / 2**30),
            "--lm-head-shards", "1", "--no-progress", *extra]


# item 1: never overwrite a finished run; check the output path before the work starts

def test_finetune_refuses_an_out_that_holds_a_finished_run(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(finetune_args(files, out, "--steps", "2")) == 0  # --save-every 0: no checkpoint is written
    assert not (out / CHECKPOINT).exists()
    before = {n: (out / n).read_bytes() for n in ("model.safetensors", RUN_FILE, "config.json")}

    err = one_line(capsys, *finetune_args(files, out, "--steps", "3", "--lr", "1e-3"))
    assert str(out) in err and "--resume" in err and "--overwrite" in err and "model.safetensors" in err, err
    assert {n: (out / n).read_bytes() for n in before} == before  # nothing was touched

    for name in (RUN_FILE, "adapter_model.safetensors", "pytorch_model.bin", "config.json"):
        lone = tmp_path / f"only-{name}"
        lone.mkdir()
        (lone / name).write_text("{}")
        assert name in one_line(capsys, *finetune_args(files, lone, "--steps", "1"))
    (tmp_path / "a-file").write_text("not a folder")
    assert "not a folder" in one_line(capsys, *finetune_args(files, tmp_path / "a-file", "--steps", "1"))
    assert "not both" in one_line(capsys, *finetune_args(files, out, "--resume", "--overwrite"))

    (out / CHECKPOINT).write_bytes(b"an older run's checkpoint")
    assert main(finetune_args(files, out, "--steps", "3", "--lr", "1e-3", "--overwrite")) == 0
    run = json.loads((out / RUN_FILE).read_text())
    assert run["settings"]["lr"] == 1e-3 and run["settings"]["steps"] == 3
    assert not (out / CHECKPOINT).exists()  # replaced: a later --resume cannot pick up the older run's state
    assert (out / "model.safetensors").read_bytes() != before["model.safetensors"]


def test_train_checks_its_save_path_before_compiling(capsys, tmp_path, monkeypatch):
    import rpcompile.cli.train as train_mod

    def no_compile(*a, **k):
        raise AssertionError("compiled before the save path was checked")

    monkeypatch.setattr(train_mod, "compile", no_compile)
    (tmp_path / "corpus.txt").write_text("some text " * 200)
    (tmp_path / "folder").mkdir()
    for save, words in [(tmp_path / "missing" / "run.ckpt", ("does not exist",)),
                        (tmp_path / "folder", ("is a folder",)),
                        (tmp_path / "corpus.txt" / "run.ckpt", ("is a file",))]:
        path = tmp_path / "run.json"
        path.write_text(json.dumps({"text": str(tmp_path / "corpus.txt"), "steps": 1, "save": str(save)}))
        err = one_line(capsys, "train", "--config", str(path))
        assert "'save'" in err and str(save) in err and all(w in err for w in words), err


def test_every_command_turns_os_and_floating_point_errors_into_one_line(capsys, tmp_path, monkeypatch):
    import rpcompile.cli.main as main_mod
    assert "Is a directory" in one_line(capsys, "simulate", "--program", str(tmp_path))  # IsADirectoryError

    def nan(cfg):
        raise FloatingPointError("step 3 has a NaN loss; the update was not applied\n  w0 | F1.m0 ...\n  w1 | ...")

    monkeypatch.setattr(main_mod, "train", nan)
    (tmp_path / "run.json").write_text(json.dumps({"text": "corpus.txt"}))
    assert one_line(capsys, "train", "--config", str(tmp_path / "run.json")).endswith("was not applied")
    monkeypatch.setattr(main_mod, "train", lambda cfg: open(tmp_path, "w"))
    assert "Is a directory" in one_line(capsys, "train", "--config", str(tmp_path / "run.json"))


def test_a_runtime_failure_that_escapes_a_command_is_its_first_line_and_exit_1(capsys, tmp_path, monkeypatch):
    """A RuntimeFailure outside a finetune step (closing a handle after a hang, a train step): one line, exit 1."""
    import rpcompile.cli.main as main_mod
    from rpcompile.runtime import RuntimeFailure

    def hang(cfg):
        raise RuntimeFailure("rpcompile runtime: w1/compute did not drain (waited 600 s): a hang\n  w0 | F1.m0 ...",
                             "w1 F1.m0", 3)
    monkeypatch.setattr(main_mod, "train", hang)
    (tmp_path / "run.json").write_text(json.dumps({"text": "corpus.txt"}))
    assert main(["train", "--config", str(tmp_path / "run.json")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["python -m rpcompile train: error: rpcompile runtime: w1/compute did not drain (waited 600 s): "
                   "a hang"], err


# item 2: no packed sequence without a token to predict

def test_one_token_tail_trains_and_evaluates_finite(files, tmp_path):
    ids = [t for d in read_documents(files.tail) for t in (*files.tok(d.text)["input_ids"], files.tok.eos_token_id)]
    assert len(ids) % SEQ == 1  # the data leaves one token for a last sequence
    p = pack(read_documents(files.tail), files.tok, SEQ, packing="split")  # the tail exists when cut every SEQ
    targets = (p.labels[:, 1:] != IGNORE).sum(dim=1)
    assert len(p) == len(ids) // SEQ and bool((targets >= 1).all()) and p.tokens == len(ids) - 1  # tail dropped
    # one sequence per microbatch, every sequence trained and evaluated
    r = finetune(FinetuneConfig(model=files.model, data=files.tail, eval=files.tail, out=str(tmp_path / "o"),
                                micro_batch_size=1, microbatches=2, steps=-(-len(p) // 2), **SMALL))
    assert r.losses and all(math.isfinite(x) for x in r.losses), r.losses
    assert r.evals and all(math.isfinite(v) for _, v in r.evals), r.evals


def test_pack_never_emits_a_sequence_with_fewer_than_two_tokens(files):
    # issue 24: a document's first token is never a target, so a lone EOS trains nothing; "a" + EOS trains 1
    for n in range(1, 3 * 4 + 2):
        for packing in ("whole", "split", "none"):
            p = pack([Document("a", False)] * n, files.tok, seq=8, packing=packing)  # n two-token documents
            assert bool(((p.labels[:, 1:] != IGNORE).sum(dim=1) >= 1).all()), (n, packing)  # a target in each
            assert p.trained == n and len(p) == (n if packing == "none" else -(-n // 4)), (n, packing)
    with pytest.raises(ValueError, match="no token to train on"):
        pack([Document("", False)] * 5, files.tok, seq=8)


# item 7: data files and the run record

def test_u2028_inside_a_jsonl_string_is_one_line(tmp_path, files):
    texts = ["first\u2028still the first", "second\u2029and \x85 more", "third\r"]
    path = tmp_path / "sep.jsonl"
    path.write_bytes(("".join(json.dumps({"text": t}, ensure_ascii=False) + "\r\n" for t in texts)).encode())
    assert [d.text for d in read_documents(str(path), files.tok)] == texts
    txt = tmp_path / "sep.txt"
    txt.write_bytes("a\u2028b\r\nc\n".encode())
    assert [d.text for d in read_documents(str(txt))] == ["a\u2028b", "c"]


def test_a_non_utf8_data_file_is_named_with_its_line(tmp_path, files, capsys):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl' line 2: not UTF-8 .*save it as UTF-8"):
        read_documents(str(path), files.tok)
    args = ["--model", files.model, "--data", str(path), "--out", str(tmp_path / "o"), "--seq", str(SEQ)]
    err = one_line(capsys, "finetune", "--no-progress", *args)
    assert str(path) in err and "line 2" in err and "UTF-8" in err, err


def test_a_truncated_run_record_is_named_on_resume(files, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / CHECKPOINT).write_bytes(b"a checkpoint")  # the record is read (and refused) before the checkpoint
    (out / RUN_FILE).write_text('{"settings": {"seq": 32, "lr": 0.0')  # cut off mid-write
    err = one_line(capsys, *finetune_args(files, out, "--resume", "--steps", "2"))
    assert str(out / RUN_FILE) in err and "corrupt" in err and "JSONDecodeError" not in err, err
    (out / RUN_FILE).write_text('{"data": {}}')  # valid JSON, but not a run record
    assert "corrupt" in one_line(capsys, *finetune_args(files, out, "--resume", "--steps", "2"))


def test_an_atomic_json_write_gives_a_new_file_0644_and_keeps_an_existing_files_mode(tmp_path):
    """Not mkstemp's 0600 for a new run record, and a mode the user set survives the rename."""
    from rpcompile import checkpoint
    path = tmp_path / "record.json"
    checkpoint.write_text_atomic(str(path), json.dumps({"a": 1}))
    assert os.stat(path).st_mode & 0o777 == 0o644
    os.chmod(path, 0o640)
    checkpoint.write_text_atomic(str(path), json.dumps({"a": 2}))
    assert os.stat(path).st_mode & 0o777 == 0o640 and json.loads(path.read_text()) == {"a": 2}


def test_json_is_written_atomically(tmp_path, monkeypatch):
    from rpcompile import checkpoint
    path = tmp_path / "record.json"
    checkpoint.write_text_atomic(str(path), json.dumps({"a": 1}))

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        checkpoint.write_text_atomic(str(path), json.dumps({"a": 2}))
    assert json.loads(path.read_text()) == {"a": 1} and os.listdir(tmp_path) == ["record.json"]  # no temp file
