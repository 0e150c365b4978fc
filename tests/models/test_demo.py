"""The demo's data (rpcompile/models/demo.py) and the fine-tuning package's front door."""
from __future__ import annotations

import os

import torch

import rpcompile
from paths import ROOT
from rpcompile.models.demo import DemoConfig, batches, corpus


def _read(*parts: str) -> bytes:
    with open(os.path.join(ROOT, *parts), "rb") as f:
        return f.read()


def test_the_corpus_reads_every_sub_folder_once_in_a_fixed_order():
    data = corpus()
    nested = [_read("passes", "partition", "timing.py"), _read("rpcompile", "finetune", "data", "packing.py"),
              _read("runtime", "streams", "pool.py"), _read("docs", "DESIGN.md")]
    for text in nested:  # files two folders down are read too, not only the top of each folder
        assert data.count(text) == 1
    assert data.find(_read("rpcompile", "api.py")) < data.find(_read("passes", "partition", "timing.py"))
    assert corpus() == data


def test_batches_are_seeded_windows_of_the_corpus():
    data = corpus()
    cfg = DemoConfig(batch=3, seq=16, seed=5)
    a, b = next(batches(data, cfg)), next(batches(data, cfg))
    assert torch.equal(a["input_ids"], b["input_ids"]) and a["input_ids"].shape == (3, 16)
    for row in a["input_ids"].tolist():
        assert bytes(row) in data


def test_the_fine_tuning_package_is_callable_as_its_finetune_function(monkeypatch):
    seen = []
    monkeypatch.setattr(rpcompile.finetune, "finetune", lambda cfg, **kw: seen.append((cfg, kw)) or "result")
    assert rpcompile.finetune("config", on_step=print) == "result"
    assert seen == [("config", {"on_step": print})]


def test_the_demos_loss_summary_averages_only_the_steps_it_ran_in_windows_that_do_not_overlap():
    from rpcompile.cli.demo import loss_summary
    assert loss_summary([2.216, 2.0]) == "loss 2.216 -> 2.000 (the first and the last step)"
    assert loss_summary([2.5]) == "loss 2.500 after 1 step"
    assert loss_summary([6.0, 5.0, 4.0, 3.0, 2.0, 1.0]) == "loss 5.000 -> 2.000 (mean of the first and last 3 steps)"
    twelve = [float(i) for i in range(12, 0, -1)]  # 12 .. 1: the first 5 average 10, the last 5 average 3
    assert loss_summary(twelve) == "loss 10.000 -> 3.000 (mean of the first and last 5 steps)"
