"""The lean host state trains (issue 48, acceptance 3): a small Llama on text for 150 steps at a learning rate
below half a bf16 ulp of most weights (3e-5 on weights around 0.02: half an ulp is about 6e-5).

There every update of a bf16 master rounded to nearest rounds away; stochastic rounding keeps it in
expectation. Each lean mode must drop the loss at least 0.9x as much as the fp32 state and end within 1% of
it; the bf16 master rounded to nearest must not.
"""
from __future__ import annotations

import os

import pytest
import torch

import models as M
import rpcompile
from paths import ROOT
from rpcompile.runtime.host import lean as lean_mod

pytest.importorskip("transformers")

BF16 = torch.bfloat16
STEPS = 150


def _batches(n: int, batch: int = 4, seq: int = 32) -> list[dict]:
    """n batches of this repository's README as byte tokens (mod the tiny vocabulary), in order."""
    with open(os.path.join(ROOT, "README.md"), "rb") as f:
        ids = torch.tensor(list(f.read()), dtype=torch.long) % M.VOCAB
    span = batch * seq
    out = []
    for k in range(n):
        at = (k * span) % (len(ids) - span)
        x = ids[at:at + span].view(batch, seq)
        out.append({"input_ids": x, "labels": x.clone()})
    return out


def _train(microbatches: int | None = None, **optimizer) -> tuple[float, float]:
    """(first loss, mean of the last 10) of STEPS steps of the tiny Llama, 2 workers, staleness 1 (batches of
    `microbatches` sequences in as many microbatches, else of 4 in the default microbatches)."""
    batches = _batches(STEPS, batch=microbatches or 4)
    with rpcompile.compile(M.llama(), gpus=2, example=batches[0], staleness=1, backend="host",
                           **({"microbatches": microbatches} if microbatches else {}),
                           optimizer=rpcompile.AdamW(lr=3e-5, weight_decay=0.0, **optimizer)) as c:
        losses = [float(c.step(b)) for b in batches]
    return losses[0], sum(losses[-10:]) / 10


@pytest.mark.slow
def test_each_lean_mode_learns_like_fp32_where_a_master_rounded_to_nearest_does_not(monkeypatch):
    f0, f1 = _train()
    drop = f0 - f1
    assert drop > 0.02 * f0  # the fp32 state learns
    for lean in (dict(state_dtype=BF16), dict(master_dtype=BF16), dict(state_dtype=BF16, master_dtype=BF16)):
        l0, l1 = _train(**lean)
        assert l0 - l1 >= 0.9 * drop and abs(l1 - f1) <= 0.01 * f1, (lean, l0 - l1, drop, l1, f1)
    # the bf16 master rounded to nearest (the torch fallback, its random bits fixed at one half): most updates
    # round away
    monkeypatch.setattr(lean_mod, "random_bits", lambda offset, n, key: torch.full((n,), 0x80008000))
    n0, n1 = _train(master_dtype=BF16, impl="foreach")
    assert n0 - n1 < 0.5 * drop, (n0 - n1, drop)


@pytest.mark.slow
def test_bf16_gradients_accumulated_over_rounds_learn_like_fp32(monkeypatch):
    # 4 microbatches on 2 workers: two rounds, so each parameter's gradient lands twice an iteration and the bf16
    # buffer holds a stochastically rounded sum (the first write, an fp32 gradient here, rounded too)
    writes = []
    land = rpcompile.runtime.host.optimizer.HostState.accumulate_grad
    monkeypatch.setattr(rpcompile.runtime.host.optimizer.HostState, "accumulate_grad",
                        lambda self, name, grad: writes.append(name) or land(self, name, grad))
    f0, f1 = _train(4)
    assert min(writes.count(n) for n in set(writes)) >= 2 * STEPS - 2  # two writes an iteration or more (the last
    # iteration's may still be in flight at staleness 1)
    drop = f0 - f1
    assert drop > 0.02 * f0
    l0, l1 = _train(4, state_dtype=BF16, master_dtype=BF16, grad_dtype=BF16)  # 10 B a parameter (bf16 gradients
    # alone: tests/runtime/host/test_lean_grad.py)
    assert l0 - l1 >= 0.9 * drop and abs(l1 - f1) <= 0.01 * f1, (l0 - l1, drop, l1, f1)
    # round-to-nearest accumulation is not measurably worse at a few rounds of comparable gradients (AdamW
    # normalises them); what it loses, small rounds on a large sum, is tests/runtime/host/test_lean_grad.py's
