"""loss_mean="tokens" (issue 24, item 3): a step's loss is sum(NLL over trained tokens) / their number.

Microbatch m of a step (with dist, of every rank) counts with weight n_m / N, N its trained tokens
(shifted labels != -100, as transformers counts them); references are plain eager PyTorch on the
whole batch: `cross_entropy(reduction="sum")` on the shifted logits / the count (tests/oracle.py).
"""
from __future__ import annotations

import copy
import math
import os
import socket
import subprocess
import sys

import pytest
import torch

import rpcompile
from tests import models
from tests.oracle import reference_train, token_mean_loss
from paths import ROOT  # noqa: E402 - tests/ is on sys.path (tests/conftest.py)

ROOT = ROOT
SEQ, ROWS, M = 16, 4, 2  # 4 sequences in 2 microbatches of 2


def skewed(seed: int, trained: tuple[int, ...] = (30, 1), rows: int = ROWS) -> dict:
    """A batch whose microbatches (rows // len(trained) sequences each) train `trained` shifted targets each."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, models.VOCAB, (rows, SEQ), generator=g)
    labels = torch.full_like(ids, -100)
    per = rows // len(trained)
    for m, n in enumerate(trained):
        block = labels[m * per:(m + 1) * per]
        pos = [(r, j) for r in range(per) for j in range(1, SEQ)]  # position 0 is never a target
        for r, j in pos[:n]:
            block[r, j] = ids[m * per + r, j]
    batch = {"input_ids": ids, "labels": labels}
    assert _counts(batch, len(trained)) == list(trained)
    return batch


def _counts(batch: dict, microbatches: int) -> list[int]:
    return [int((l[:, 1:] != -100).sum()) for l in batch["labels"].tensor_split(microbatches)]


def _compile(model, example, staleness: int = 0, lr: float = 1.0, **kw) -> rpcompile.Compiled:
    kw.setdefault("loss_mean", "tokens")
    return rpcompile.compile(model, gpus=2, example=example, microbatches=M, staleness=staleness,
                             optimizer=rpcompile.SGD(lr=lr), dtype=torch.float32, backend="host", **kw)


def _eager_step(model, batch: dict, lr: float = 1.0, loss=token_mean_loss) -> tuple[float, dict]:
    """One eager SGD step of a copy of `model` on `loss`; (loss, updated parameters)."""
    ref = copy.deepcopy(model).float()
    value = loss(ref, batch)
    value.backward()
    with torch.no_grad():
        for p in ref.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return float(value.detach()), {n: p.detach().clone() for n, p in ref.named_parameters()}


def _microbatch_mean(model, batch: dict) -> torch.Tensor:
    """The old rule: the mean of each microbatch's own token mean."""
    parts = [{k: v.tensor_split(M)[m] for k, v in batch.items()} for m in range(M)]
    return sum(token_mean_loss(model, p) for p in parts) / M


def _max_diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[n] - want[n].float()).abs().max().item() for n in got)


def _params(c: rpcompile.Compiled) -> dict:
    return {n: p.detach().clone() for n, p in c.model().named_parameters()}


def test_tokens_update_and_loss_equal_eager_token_mean():
    model, batch = models.llama(seed=0), skewed(1, (30, 1))
    want_loss, want = _eager_step(model, batch)
    _, old = _eager_step(model, batch, loss=_microbatch_mean)
    assert _max_diff(old, want) > 1e-3  # the two rules really differ on this batch: the test can fail
    with _compile(copy.deepcopy(model), batch) as c:
        loss = c.step(batch)
        got = _params(c)
    assert abs(loss - want_loss) < 1e-6, (loss, want_loss)
    assert _max_diff(got, want) < 1e-6


def test_evaluate_uses_the_same_weighting():
    model, batch = models.llama(seed=0), skewed(2, (29, 3))
    with torch.no_grad():
        want = float(token_mean_loss(copy.deepcopy(model), batch))
    with _compile(copy.deepcopy(model), batch) as c:
        assert c.evaluate(batch) == pytest.approx(want, abs=1e-6)


def test_zero_trained_microbatch_counts_for_nothing_and_gives_no_nan():
    model, batch = models.llama(seed=0), skewed(3, (30, 0))
    want_loss, want = _eager_step(model, batch)
    with _compile(copy.deepcopy(model), batch) as c:  # on_nonfinite="raise": the 0/0 of microbatch 1 must not fire
        loss = c.step(batch)
        ev = c.evaluate(batch)
        got = _params(c)
        assert c.skipped_steps == []
    assert math.isfinite(loss) and math.isfinite(ev)
    assert abs(loss - want_loss) < 1e-6
    assert all(torch.isfinite(p).all() for p in got.values())
    assert _max_diff(got, want) < 1e-6


def test_staleness_1_matches_the_oracle_on_the_token_mean():
    model = models.llama(seed=0)
    batches = [skewed(10 + i, tr) for i, tr in enumerate([(30, 1), (2, 25), (17, 0)])]
    want_losses, want_sd = reference_train(model, batches, optimizer=rpcompile.SGD(lr=0.5), staleness=1,
                                           loss_fn=token_mean_loss)
    with _compile(copy.deepcopy(model), batches[0], staleness=1, lr=0.5) as c:
        losses = [c.step(b) for b in batches]
        got = _params(c)
    assert losses == pytest.approx(want_losses, abs=1e-6)
    assert _max_diff(got, {n: want_sd[n] for n in got}) < 1e-6


def test_loss_scale_composes_with_the_weights():
    model, batch = models.llama(seed=0), skewed(4, (30, 2))
    _, want = _eager_step(model, batch)
    with _compile(copy.deepcopy(model), batch, loss_scale=64.0) as c:
        c.step(batch)
        got = _params(c)
    assert _max_diff(got, want) < 1e-6


def test_bad_loss_mean_and_missing_labels_raise_naming_them():
    model, batch = models.llama(seed=0), skewed(5)
    with pytest.raises(ValueError, match="loss_mean"):
        _compile(model, batch, loss_mean="sum")
    seq, example = models.sequential(), models.regression_batch()
    with pytest.raises(ValueError, match="labels"):
        rpcompile.compile(seq, gpus=2, example=example, microbatches=2, loss_fn=models.mse_loss,
                          backend="host", loss_mean="tokens")
    none = {"input_ids": batch["input_ids"], "labels": torch.full_like(batch["labels"], -100)}
    with _compile(model, batch) as c:
        with pytest.raises(ValueError, match="no trained token"):
            c.step(none)
        assert c.steps == 0


# ---------------------------------------------------------------- 2 gloo ranks with different counts

RANK_COUNTS = [(30, 1), (3, 12)]  # rank r's two microbatches


def dist_worker(out: str) -> None:
    """One rank (the env says which): one token-weighted step on its own shard; saves (loss, params)."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    local = skewed(20 + rank, RANK_COUNTS[rank])
    with _compile(models.llama(seed=0), local, dist=True) as c:
        loss = c.step(local)
        torch.save({"loss": loss, "params": _params(c)}, f"{out}.{rank}")


def test_two_ranks_with_different_counts_equal_eager_on_the_global_batch(tmp_path):
    out, world = str(tmp_path / "r"), len(RANK_COUNTS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"from tests.driver.test_token_weighted import dist_worker; dist_worker({out!r})"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), LOCAL_RANK=str(r), OMP_NUM_THREADS="1",
                                       PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])))
             for r in range(world)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    got = [torch.load(f"{out}.{r}") for r in range(world)]
    shards = [skewed(20 + r, RANK_COUNTS[r]) for r in range(world)]
    whole = {k: torch.cat([s[k] for s in shards]) for k in shards[0]}
    want_loss, want = _eager_step(models.llama(seed=0), whole)
    for r in range(world):
        assert abs(got[r]["loss"] - want_loss) < 1e-6, (r, got[r]["loss"], want_loss)
        assert _max_diff(got[r]["params"], want) < 1e-6


def test_a_trained_first_label_is_not_counted_as_in_the_eager_transformers_mean():
    """labels = input_ids (the first label trained, as in split packing mid-document) in microbatch 0, and only
    the first two labels trained in microbatch 1: the counts are of shifted labels (30 and 2), so the loss and
    the update equal the eager token mean."""
    model = models.llama(seed=0)
    ids = torch.randint(0, models.VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[2:, 2:] = -100
    batch = {"input_ids": ids, "labels": labels}
    assert _counts(batch, M) == [30, 2] and bool((labels[:, 0] != -100).all())
    want_loss, want = _eager_step(model, batch)
    with _compile(copy.deepcopy(model), batch) as c:
        loss = c.step(batch)
        got = _params(c)
    assert abs(loss - want_loss) < 1e-6, (loss, want_loss)
    assert _max_diff(got, want) < 1e-6
