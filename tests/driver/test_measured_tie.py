"""compile ranks costs measured on the CPU with the host tie (issue 31: one plan however loaded the machine is)."""
import pytest
import torch

import models  # noqa: E402 - tests/ is on sys.path (tests/conftest.py)
import rpcompile
from rpcompile import pipeline


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures on CUDA when there is one")
def test_compile_on_the_cpu_ranks_measured_costs_with_the_host_tie(monkeypatch):
    ties = []
    real = pipeline.passes.partition

    def recording(*args, **kwargs):
        ties.append(kwargs.get("tie"))
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline.passes, "partition", recording)
    x, y = models.regression_batch(batch=4)
    c = rpcompile.compile(models.sequential(), gpus=2, example=(x, y), microbatches=2, loss_fn=models.mse_loss,
                          backend="host")
    c.close()
    assert ties and set(ties) == {pipeline.HOST_MEASURED_TIE}, ties
