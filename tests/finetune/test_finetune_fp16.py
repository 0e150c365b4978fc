"""`finetune --dtype fp16 [--fp16-accumulation]`: fp16 trains with dynamic loss scaling; the flag is recorded
and priced (host workers accept it, where it changes nothing)."""
from __future__ import annotations

import json
import math
import os
import re
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from rpcompile import DynamicLossScale, Hardware, checkpoint  # noqa: E402
from rpcompile.cli.main import main  # noqa: E402
from rpcompile.finetune.metrics import read_metrics  # noqa: E402
from rpcompile.finetune.run import CHECKPOINT, RUN_FILE  # noqa: E402
import hf_fixtures as fx  # noqa: E402

FLAGS = ["--seq", "32", "--micro-batch-size", "2", "--microbatches", "2", "--gpus", "2", "--lr", "3e-3",
         "--lm-head-shards", "1", "--no-progress"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("finetune_fp16")
    return SimpleNamespace(model=fx.model_folder(d / "tiny"), train=fx.write_jsonl(d / "train.jsonl", fx.text_rows(40)))


def run(files, out, *extra) -> int:
    return main(["finetune", "--model", files.model, "--data", files.train, "--out", str(out), *FLAGS,
                 *map(str, extra)])


def test_fp16_with_fp16_accumulation_trains_and_is_recorded(files, tmp_path):
    out = tmp_path / "o"
    assert run(files, out, "--dtype", "fp16", "--fp16-accumulation", "--steps", 3, "--memory-gib", 0.5,
               "--save-every", 3) == 0
    settings = json.load(open(os.path.join(out, RUN_FILE)))["settings"]
    assert (settings["dtype"], settings["fp16_accumulation"]) == ("fp16", True)
    options = checkpoint.load(os.path.join(out, CHECKPOINT))["options"]  # what the run was compiled with
    assert options["fp16_accumulation"] is True and options["dtype"] == torch.float16
    assert isinstance(options["loss_scale"], DynamicLossScale)
    losses = [r["loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_fp16_accumulation_needs_fp16(files, tmp_path, capsys):
    assert run(files, tmp_path / "o", "--dtype", "bf16", "--fp16-accumulation", "--dry-run") != 0
    assert "--fp16-accumulation needs --dtype fp16" in capsys.readouterr().err


def _iteration(text: str) -> tuple[float, str]:
    m = re.search(r"predicted iteration: ([0-9.e+-]+) s, GEMMs priced at (\S+)", text)
    assert m, text
    return float(m.group(1)), m.group(2)


def test_dry_run_prices_the_fp16_accumulate_rate(files, tmp_path, monkeypatch, capsys):
    # the dry run prices this machine's devices; pretend they are 4090s whose tiny-model GEMMs are compute-bound
    slow = Hardware.preset("rtx4090").replace(peak_flops={"float32": 1e9, "float16": 1e9, "float16/float16": 2e9})
    monkeypatch.setattr("rpcompile.finetune.preflight.local_hardware",
                        lambda gpus, budget: slow.replace(gpus=gpus, host_memory=2**36))
    got = {}
    for extra in ((), ("--fp16-accumulation",)):
        assert run(files, tmp_path / "o", "--dtype", "fp16", "--dry-run", *extra) == 0
        got[bool(extra)] = _iteration(capsys.readouterr().out)
    assert got[False][1] == "float16" and got[True][1] == "float16/float16"
    assert got[True][0] < 0.8 * got[False][0]
