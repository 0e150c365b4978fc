"""`Compiled.evaluate`: eval mode (no dropout) and the next-token accuracy of the loss's cross-entropy.

The accuracy counts are checked against the eager model's own argmax, for an unsharded LM head
(HF's `cross_entropy` in the last layer) and a sharded one (`lse_loss`: the logits never exist whole).
"""
from __future__ import annotations

import copy

import pytest
import torch

import models  # noqa: E402
import rpcompile  # noqa: E402

pytest.importorskip("transformers")


def predicted_batch(model, seed: int = 3) -> tuple[dict[str, torch.Tensor], int, int]:
    """A batch whose labels are the eager model's own next-token argmax at about half the trained positions
    (random ids elsewhere, some positions -100); with the (right, counted) targets eager counts for it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, models.VOCAB, (4, 12), generator=g)
    with torch.no_grad():
        pred = copy.deepcopy(model).eval()(input_ids=ids).logits.argmax(-1)  # pred[:, i] predicts token i + 1
    labels = torch.randint(0, models.VOCAB, ids.shape, generator=g)
    take = torch.rand(ids.shape, generator=g) < 0.5
    labels[:, 1:] = torch.where(take[:, 1:], pred[:, :-1], labels[:, 1:])
    labels[torch.rand(ids.shape, generator=g) < 0.2] = -100
    target = labels[:, 1:]
    right = int(((pred[:, :-1] == target) & (target != -100)).sum())
    return {"input_ids": ids, "labels": labels}, right, int((target != -100).sum())


@pytest.mark.parametrize("shards", [1, 3])
def test_evaluate_counts_the_argmax_hits_of_the_eager_model(shards):
    model = models.llama()
    batch, right, counted = predicted_batch(model)
    assert 0 < right < counted
    c = rpcompile.compile(copy.deepcopy(model), gpus=2, example=batch, microbatches=2, staleness=0,
                          lm_head_shards=shards, backend="host", memory_budget=2**19, loss_mean="tokens")
    with c:
        assert c.graph.layers[-1].name == ("lm_head.loss" if shards > 1 else "lm_head")  # lse_loss / cross_entropy
        loss, hits = c.evaluate(batch, accuracy=True)
        assert hits == (right, counted)
        assert loss == c.evaluate(batch)  # the counting changes no bit of the loss
        with torch.no_grad():
            assert loss == pytest.approx(model.eval()(**batch).loss.item(), rel=1e-5)


def test_evaluate_runs_in_eval_mode_and_training_keeps_its_dropout():
    model = models.llama(attention_dropout=0.5)
    batch = models.lm_batch(batch=4, seq=8)
    c = rpcompile.compile(copy.deepcopy(model), gpus=2, example=batch, microbatches=2, staleness=0,
                          optimizer=rpcompile.SGD(lr=0.0), backend="host", memory_budget=2**19)
    with c:
        first = c.evaluate(batch)
        with torch.no_grad():
            assert first == pytest.approx(copy.deepcopy(model).eval()(**batch).loss.item(), rel=1e-5)
        train = [c.step(batch) for _ in range(2)]  # lr 0: the weights stay; dropout draws new masks
        assert train[0] != train[1] and all(abs(t - first) > 1e-4 for t in train)
        assert c.evaluate(batch) == first


def test_a_model_compiled_in_eval_mode_trains_in_eval_mode():
    model = models.llama(attention_dropout=0.5).eval()  # the user's choice: no dropout in training either
    batch = models.lm_batch(batch=4, seq=8)
    c = rpcompile.compile(copy.deepcopy(model), gpus=2, example=batch, microbatches=2, staleness=0,
                          optimizer=rpcompile.SGD(lr=0.0), backend="host", memory_budget=2**19)
    with c:
        first = c.evaluate(batch)
        assert [c.step(batch) for _ in range(2)] == pytest.approx([first] * 2, rel=1e-6)
