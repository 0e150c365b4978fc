"""The command line refuses bad values in one line on stderr with exit status 2 (issue 14 item 7), lists the
train config keys, keeps a plan whose baseline cannot be built, and prints max_seq_len with what binds it
(issue 13). Everything runs `rpcompile.cli.main.main` in this process."""
import json
from dataclasses import fields

import pytest

from rpcompile.cli.main import main

SMALL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096}


def run(capsys, *argv):
    """main(argv) -> (exit status, stdout, stderr)."""
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def refused(capsys, *argv) -> str:
    """Run a command that must be refused: exit 2, one line on stderr, no traceback, nothing on stdout."""
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err and not out.strip(), (rc, err)
    return err


@pytest.fixture
def small_model(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL))
    return str(path)


@pytest.mark.parametrize("option, value", [("--gpus", "0"), ("--microbatches", "0"), ("--seq", "0"),
                                           ("--micro-batch-size", "0"), ("--gpus", "-1"), ("--seq", "two")])
def test_plan_refuses_a_bad_value_in_one_line(capsys, small_model, option, value):
    err = refused(capsys, "plan", "--model", small_model, option, value)
    assert err.startswith("python -m rpcompile plan: error: ") and option in err and value in err, err


@pytest.mark.parametrize("argv", [("simulate", "--program", "p.csv", "--iterations", "0"),
                                  ("demo", "--steps", "0"),
                                  ("finetune", "--model", "m", "--data", "d.txt", "--out", "o", "--gpus", "0"),
                                  ("finetune", "--model", "m", "--data", "d.txt", "--out", "o", "--seq", "0"),
                                  ("finetune", "--model", "m", "--data", "d.txt", "--out", "o", "--microbatches", "0")])
def test_other_commands_refuse_a_bad_count_in_one_line(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    err = refused(capsys, *argv)
    assert argv[-2] in err and "must be a positive integer" in err, err


@pytest.mark.parametrize("config, words", [
    ({"gpus": 0}, ("'gpus'", "positive integer", "0")),
    ({"microbatches": 0}, ("'microbatches'", "positive integer")),
    ({"seq": 0}, ("'seq'", "positive integer")),
    ({"stpes": 3}, ("unknown key 'stpes'", "did you mean 'steps'")),
    ({"lr": "3e-3"}, ("'lr'", "number", "'3e-3'")),
    ({"resume": "yes"}, ("'resume'", "true or false")),
    ({"batch": 8, "microbatches": 3}, ("'microbatches' (3) must divide 'batch' (8)",)),
])
def test_train_config_refuses_a_bad_key_or_value_naming_it(capsys, tmp_path, config, words):
    (tmp_path / "corpus.txt").write_text("some text " * 200)
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"text": str(tmp_path / "corpus.txt"), "steps": 1, **config}))
    err = refused(capsys, "train", "--config", str(path))
    assert str(path) in err and all(w in err for w in words), err


def test_train_config_that_is_not_an_object_or_not_json_is_one_line(capsys, tmp_path):
    path = tmp_path / "run.json"
    path.write_text("[1, 2]")
    assert "JSON object" in refused(capsys, "train", "--config", str(path))
    path.write_text("{'text': 'x'}")
    assert "not valid JSON" in refused(capsys, "train", "--config", str(path))
    path.write_text("{}")
    assert "missing key 'text'" in refused(capsys, "train", "--config", str(path))


def test_train_help_lists_every_config_key_with_its_meaning(capsys):
    from rpcompile.cli.train import RunConfig
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    lines = out.splitlines()
    for f in fields(RunConfig):
        line = next((x for x in lines if x.split()[:1] == [f.name]), None)
        assert line is not None and f.metadata["help"] in line, (f.name, out)
    assert "default 100" in next(x for x in lines if x.split()[:1] == ["steps"])


def test_plan_keeps_the_baselines_that_can_be_built_and_prints_the_length_limit(capsys, small_model):
    pytest.importorskip("transformers")
    # 6 decoder layers (+ embedding, norm, head): interleaved and looped BFS need 2 x 8 bound stages
    rc, out, err = run(capsys, "plan", "--model", small_model, "--gpus", "8", "--seq", "64", "--microbatches", "8",
                       "--micro-batch-size", "2")
    assert rc == 0, err
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    assert "GPipe" in rows and "1F1B" in rows and "rpcompile (RoundPipe)" in rows
    for name in ("interleaved 1F1B (V=2)", "looped BFS (V=2)"):
        assert "n/a: cannot split" in rows[name] and "bound stages" in rows[name], rows[name]
    assert "8 microbatches of 2 sequences" in out
    line = next(x for x in out.splitlines() if x.startswith("max_seq_len"))
    assert line.startswith("max_seq_len on 8x rtx4090, 2 sequences per microbatch: ") and " tokens; at " in line
    assert "the device: " in line or "the host: " in line, line  # the binding term is named


@pytest.mark.parametrize("argv", [
    *[("plan", "--model", "MODEL", "--host-memory", v) for v in ("inf", "nan", "-1", "0", "1e300")],
    *[("plan", "--model", "MODEL", flag, str(10**20)) for flag in ("--gpus", "--seq", "--microbatches",
                                                                   "--micro-batch-size", "--servers")],
    ("simulate", "--program", "p.csv", "--iterations", str(10**20)), ("demo", "--steps", str(10**20)),
])
def test_a_number_that_is_not_finite_positive_or_representable_is_refused_naming_its_flag(capsys, tmp_path,
                                                                                          monkeypatch, small_model, argv):
    monkeypatch.chdir(tmp_path)
    err = refused(capsys, *[small_model if a == "MODEL" else a for a in argv])
    assert argv[-2] in err and ("positive number of GiB, and finite" in err or "at most 2,147,483,647" in err), err


@pytest.mark.parametrize("config, words", [
    ({"seed": 10**20}, ("'seed'", "from 0 to 4294967295")), ({"seed": -1}, ("'seed'", "from 0 to")),
    ({"steps": 10**20}, ("'steps'", "at most 2,147,483,647")), ({"save_every": 10**20}, ("'save_every'", "at most")),
    ({"lr": float("nan")}, ("'lr'", "finite")), ({"lr": float("inf")}, ("'lr'", "finite")),
])
def test_train_config_refuses_a_number_too_large_or_not_finite_naming_its_key(capsys, tmp_path, config, words):
    (tmp_path / "corpus.txt").write_text("some text " * 200)
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"text": str(tmp_path / "corpus.txt"), "steps": 1, **config}))  # NaN, Infinity
    err = refused(capsys, "train", "--config", str(path))
    assert str(path) in err and all(w in err for w in words), err
