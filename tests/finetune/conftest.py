"""The fixtures test_finetune_run.py and test_finetune_stop.py share: the tiny model and training data, and one
uninterrupted 6-step run (its metrics, TensorBoard and losses) that a stopped and resumed run must repeat bit for
bit. Session-scoped, so the 6-step run trains once for both files; a test file with its own `files` fixture (most
in this folder) uses its own."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import hf_fixtures as fx
import rpcompile


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("finetune_run")
    rows = fx.text_rows()
    return SimpleNamespace(model=fx.model_folder(d / "tiny"), train=fx.write_jsonl(d / "train.jsonl", rows[:40]))


@pytest.fixture(scope="session")
def six(files, tmp_path_factory):
    """A 6-step run with a metrics line per step and TensorBoard, its losses captured from the handle."""
    from test_finetune_run import run  # the command line the tests run
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
