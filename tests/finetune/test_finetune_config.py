"""`finetune --config FILE` (issue 25, item 2): a .json/.yaml file or a run record, flags override it.

The end-to-end test reruns a short run from its `rpcompile-run.json` and compares the losses
bit for bit; the rest parse command lines (`parser()` + `config_from_args`) or call `main`
for the one-line refusals, without training.
"""
import dataclasses
import json
import sys

import pytest

from rpcompile.cli import finetune as finetune_args
from rpcompile.finetune.config import FinetuneConfig
from rpcompile.cli.main import main, parser
from rpcompile.finetune.config_file import FROM_RECORD_NOT_TAKEN, HINTS, check_settings, did_you_mean

PATHS = {"model": "m/", "data": "d.jsonl", "out": "o/"}
RUN_FILE = "rpcompile-run.json"  # the run record a run writes into --out


def config(*argv) -> FinetuneConfig:
    """The FinetuneConfig of `python -m rpcompile finetune ARGV`."""
    return finetune_args.config_from_args(parser().parse_args(["finetune", *map(str, argv)]))


def write(path, obj) -> str:
    """`obj` as JSON (a dict or list) or as the text given (a str); returns the path."""
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj), encoding="utf-8")
    return str(path)


def one_line(capsys, *argv) -> str:
    """main(argv) must exit 2 with one line on stderr and no traceback; returns the line."""
    capsys.readouterr()
    rc = main(["finetune", *map(str, argv)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (rc, err)
    return err


# the acceptance: a rerun from the run record reproduces the run

def test_a_rerun_from_the_run_record_reproduces_the_losses_bit_for_bit(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import hf_fixtures as fx
    from rpcompile.cli import main as cli_main
    from rpcompile.finetune.run import finetune

    results = []
    monkeypatch.setattr(cli_main, "finetune", lambda cfg: results.append((cfg, finetune(cfg))))
    model = fx.model_folder(tmp_path / "tiny")
    data = fx.write_jsonl(tmp_path / "train.jsonl", fx.text_rows()[:24])
    out, out2 = tmp_path / "out", tmp_path / "out2"
    assert main(["finetune", "--model", model, "--data", data, "--out", str(out), "--steps", "4", "--seq", "32",
                 "--gpus", "2", "--microbatches", "2", "--micro-batch-size", "2", "--lr", "3e-3", "--warmup", "1",
                 "--memory-gib", str(2**19 / 2**30), "--lm-head-shards", "1", "--no-progress",
                 "--overwrite"]) == 0  # --overwrite (of an empty folder) goes into the record
    record = json.loads((out / RUN_FILE).read_text())
    assert record["settings"]["overwrite"] is True and record["settings"]["seq"] == 32
    assert main(["finetune", "--config", str(out / RUN_FILE), "--out", str(out2)]) == 0
    (first_cfg, first), (second_cfg, second) = results
    assert len(first.losses) == 4 and second.losses == first.losses  # exact floats
    assert second_cfg == dataclasses.replace(first_cfg, out=str(out2), overwrite=False)  # not resumed/replaced
    again = json.loads((out2 / RUN_FILE).read_text())["settings"]
    assert {k: v for k, v in again.items() if k not in ("out", "overwrite")} == \
        {k: v for k, v in record["settings"].items() if k not in ("out", "overwrite")}


# flags override the file; the file overrides the defaults

def test_only_the_flags_given_override_the_file(tmp_path):
    f = write(tmp_path / "run.json", {**PATHS, "seq": 32, "warmup": 3, "schedule": "linear", "steps": 7})
    assert (config("--config", f).seq, config("--config", f).warmup) == (32, 3)  # not argparse's 512 and 0
    c = config("--config", f, "--seq", 16, "--out", "other/")
    assert (c.seq, c.out, c.warmup, c.schedule, c.steps, c.model) == (16, "other/", 3, "linear", 7, "m/")
    c = config("--config", f, "--epochs", 2)  # the flag of the exclusive pair drops the file's steps
    assert (c.epochs, c.steps) == (2.0, None)
    assert config(*sum((["--" + k, v] for k, v in PATHS.items()), [])) == FinetuneConfig(**PATHS)  # no file


def test_a_flat_file_and_a_run_record_give_the_same_settings(tmp_path):
    settings = dataclasses.asdict(FinetuneConfig(**PATHS, seq=64, lora=4, lora_targets=("q_proj", "v_proj")))
    flat = write(tmp_path / "flat.json", {**settings, "lora_targets": ["q_proj", "v_proj"]})
    rec = write(tmp_path / "rpcompile-run.json", {"settings": {**settings, "lora_targets": ["q_proj", "v_proj"]},
                                                   "data": {"sequences": 3, "sha256": "ab"}})
    assert config("--config", flat) == config("--config", rec) == FinetuneConfig(**settings)
    assert config("--config", rec).lora_targets == ("q_proj", "v_proj")  # a JSON list: a tuple


def test_a_run_records_resume_overwrite_and_dry_run_are_not_taken_but_flags_and_flat_files_set_them(tmp_path):
    assert FROM_RECORD_NOT_TAKEN == ("resume", "overwrite", "dry_run")
    on = {"resume": True, "overwrite": False, "dry_run": True}
    rec = write(tmp_path / "rpcompile-run.json", {"settings": {**PATHS, **on}, "data": {}})
    c = config("--config", rec)
    assert (c.resume, c.overwrite, c.dry_run) == (False, False, False)
    c = config("--config", rec, "--resume", "--dry-run")
    assert (c.resume, c.dry_run) == (True, True)
    rec2 = write(tmp_path / "rec2.json", {"settings": {**PATHS, "overwrite": True}, "data": {}})
    assert config("--config", rec2).overwrite is False and config("--config", rec2, "--overwrite").overwrite
    c = config("--config", write(tmp_path / "flat.json", {**PATHS, **on}))
    assert (c.resume, c.dry_run) == (True, True)  # a plain config file may set them


# refusals: one line, exit 2, naming the key

def test_an_unknown_key_exits_2_with_one_line_and_a_suggestion(tmp_path, capsys):
    err = one_line(capsys, "--config", write(tmp_path / "a.json", {**PATHS, "sqe": 32}))
    assert "unknown key 'sqe' (did you mean 'seq'?)" in err and "a.json" in err
    err = one_line(capsys, "--config", write(tmp_path / "b.json", {"settings": {"micro-batch-size": 2}, "data": {}}))
    assert "unknown key 'micro-batch-size' (did you mean 'micro_batch_size'?)" in err
    assert "unknown key 'setting' beside" in one_line(
        capsys, "--config", write(tmp_path / "c.json", {"settings": {}, "setting": 1}))
    assert did_you_mean("zzzz", HINTS) == ""


@pytest.mark.parametrize("key,value,must", [("seq", "abc", "an integer"), ("seq", True, "an integer"),
                                            ("seq", None, "an integer"), ("steps", 2.5, "an integer or null"),
                                            ("lr", "fast", "a number or null"), ("merge", 1, "true or false"),
                                            ("lora_targets", "q_proj", "a list of strings or null"),
                                            ("lora_targets", [1], "a list of strings or null"),
                                            ("model", 3, "a string")])
def test_a_wrong_type_exits_2_with_one_line_naming_the_key(tmp_path, capsys, key, value, must):
    err = one_line(capsys, "--config", write(tmp_path / "bad.json", {**PATHS, key: value}))
    assert err.endswith(f"--config {tmp_path / 'bad.json'}: key {key!r} must be {must}, got {value!r}"), err


def test_values_are_converted_where_the_annotation_allows(tmp_path):
    c = config("--config", write(tmp_path / "ok.json", {**PATHS, "lr": 1, "steps": None, "lm_head_shards": 2,
                                                        "max_grad_norm": 0, "memory_gib": None}))
    assert c.lr == 1.0 and type(c.lr) is float and c.steps is None and c.lm_head_shards == 2
    assert c.max_grad_norm is None  # 0 = off, as --max-grad-norm 0
    # every field's annotation has a check: each default passes as itself
    defaults = dataclasses.asdict(FinetuneConfig(**PATHS))
    assert check_settings(defaults, "x:") == defaults and set(HINTS) == set(defaults)


def test_files_that_cannot_be_read_are_one_line_naming_the_file(tmp_path, capsys):
    assert "'.toml'" in one_line(capsys, "--config", write(tmp_path / "run.toml", "seq = 3"))
    assert "does not exist" in one_line(capsys, "--config", tmp_path / "none.json")
    err = one_line(capsys, "--config", write(tmp_path / "broken.json", '{"seq": 3,\n "lr": }'))
    assert "broken.json: not valid JSON at line 2 column 8" in err
    err = one_line(capsys, "--config", write(tmp_path / "broken.yaml", "seq: 3\nlr: [1,\nwarmup: 2\n"))
    assert "broken.yaml: not valid YAML at line " in err
    assert "a mapping" in one_line(capsys, "--config", write(tmp_path / "list.json", [1, 2]))
    assert "--out DIR: required" in one_line(capsys, "--config", write(tmp_path / "p.json", {"model": "m",
                                                                                            "data": "d"}))


def test_yaml_works_with_pyyaml_and_says_how_to_install_it_without(tmp_path, capsys, monkeypatch):
    pytest.importorskip("yaml")
    f = write(tmp_path / "run.yaml", "model: m/\ndata: d.jsonl\nout: o/\nlr: 2e-5  # no dot\nseq: 64\n"
              "lora_targets: [q_proj, v_proj]\nsteps: null\n")
    c = config("--config", f, "--lora", 8)
    assert (c.lr, c.seq, c.lora_targets, c.steps, c.lora) == (2e-5, 64, ("q_proj", "v_proj"), None, 8)
    empty = write(tmp_path / "empty.yml", "# nothing set yet\n")
    assert config("--config", empty, *sum((["--" + k, v] for k, v in PATHS.items()), [])) == FinetuneConfig(**PATHS)
    assert "key 'seq' must be an integer, got 'abc'" in one_line(capsys, "--config",
                                                                 write(tmp_path / "bad.yml", "seq: abc\n"))
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    assert "pip install pyyaml" in one_line(capsys, "--config", f)


def test_the_new_flags_set_their_fields():
    c = config(*sum((["--" + k, v] for k, v in PATHS.items()), []), "--logging-steps", 5, "--report-to",
               "tensorboard", "--dry-run", "--num-proc", 3, "--val-size", 0.1)
    assert (c.logging_steps, c.report_to, c.dry_run, c.num_proc, c.val_size) == (5, "tensorboard", True, 3, 0.1)


HUGE = str(10**20)  # past every count and seed (an int64 overflows at 9.2e18)


@pytest.mark.parametrize("flag, value", [
    *[("--epochs", v) for v in ("inf", "nan", "-1", "0")], *[("--memory-gib", v) for v in ("inf", "nan", "0", "1e300")],
    *[("--lora-alpha", v) for v in ("nan", "inf", "-1")], *[("--max-grad-norm", v) for v in ("nan", "inf", "-1")],
    *[("--timeout", v) for v in ("nan", "inf", "-5")], ("--dist-timeout", "inf"), ("--dist-timeout", "nan"),
    ("--lr", "nan"), ("--lr", "inf"), ("--weight-decay", "nan"), ("--neftune-alpha", "inf"), ("--val-size", "nan"),
    ("--seed", HUGE), ("--seed", "-1"), ("--seed", "1e20"), ("--lm-head-shards", "0"), ("--lm-head-shards", HUGE),
    *[(f, HUGE) for f in ("--steps", "--gpus", "--seq", "--micro-batch-size", "--microbatches", "--num-proc",
                          "--logging-steps", "--warmup", "--save-every", "--eval-every", "--lora")],
])
def test_a_number_that_is_not_finite_in_range_or_representable_is_refused_naming_its_flag(tmp_path, capsys, flag,
                                                                                           value):
    out = tmp_path / "out"
    lora = ["--lora", "2"] if flag == "--lora-alpha" else []
    err = one_line(capsys, "--model", tmp_path / "m", "--data", tmp_path / "d.jsonl", "--out", out, *lora, flag, value)
    assert flag in err and not out.exists(), err


@pytest.mark.parametrize("ext, text", [(".json", '{"epochs": Infinity}'), (".json", '{"lora": 2, "lora_alpha": NaN}'),
                                       (".yaml", "memory_gib: .inf"), (".json", '{"seed": 100000000000000000000}')])
def test_a_config_file_number_goes_through_the_same_check(tmp_path, capsys, ext, text):
    if ext == ".yaml":
        pytest.importorskip("yaml")
    path = write(tmp_path / f"run{ext}", text)
    err = one_line(capsys, "--config", path, "--model", tmp_path / "m", "--data", tmp_path / "d.jsonl", "--out",
                   tmp_path / "out")
    key = next(k for k in ("epochs", "lora-alpha", "memory-gib", "seed") if k.replace("-", "_") in text)
    assert f"--{key} must be" in err and not (tmp_path / "out").exists(), err


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    """A folder holding only the tiny tokenizer: a model folder once a config.json is written beside it."""
    pytest.importorskip("transformers")
    import hf_fixtures as fx
    folder = tmp_path_factory.mktemp("tokenizer")
    fx.tokenizer().save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("change, words", [
    ({"hidden_size": -32}, "hidden_size must be a positive integer, got -32"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
    ({"hidden_size": "32"}, "hidden_size must be a positive integer, got '32'"),
    ({"num_hidden_layers": None}, "num_hidden_layers must be a positive integer, got None"),
    ({"num_key_value_heads": 3}, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
])
def test_a_model_folder_whose_config_cannot_build_the_model_is_refused_naming_the_file_and_field(
        tmp_path, capsys, saved_tokenizer, change, words):
    import shutil
    folder = tmp_path / "model"
    shutil.copytree(saved_tokenizer, folder)
    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 64}
    write(folder / "config.json", {**config, **change})  # no weights: refused before they would load
    data = write(tmp_path / "d.jsonl", '{"text": "a document"}\n')
    err = one_line(capsys, "--model", folder, "--data", data, "--out", tmp_path / "out", "--seq", 32, "--steps", 1)
    assert f"{folder / 'config.json'}: {words}" in err and not (tmp_path / "out").exists(), err


@pytest.mark.parametrize("key", ["state_dtype", "master_dtype", "grad_dtype"])
def test_state_and_master_dtypes_are_flags_and_keys_checked_by_name(tmp_path, capsys, key):
    flag, paths = "--" + key.replace("_", "-"), sum((["--" + k, v] for k, v in PATHS.items()), [])
    assert getattr(config(*paths), key) == "fp32"  # the default
    assert getattr(config(*paths, flag, "bf16"), key) == "bf16"
    rec = write(tmp_path / "run.json", {**PATHS, key: "bf16"})
    assert getattr(config("--config", rec), key) == "bf16"
    bad = write(tmp_path / "bad.json", {**PATHS, key: "fp16", "steps": 1})
    assert f"{flag} must be one of ('fp32', 'bf16'), got 'fp16'" in one_line(capsys, "--config", bad)
    assert flag in one_line(capsys, *paths, flag, "int8")
