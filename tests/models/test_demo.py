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
