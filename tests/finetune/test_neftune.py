"""NEFTune (`--neftune-alpha`): uniform noise of scale alpha / sqrt(L * d) on the input embeddings in training
steps, drawn from the runtime's seeded generators (the recompute sees the same noise, a resume is exact), and
none in evaluation."""
from __future__ import annotations

import copy
import math
import os

import pytest
import torch

pytest.importorskip("transformers")

import rpcompile  # noqa: E402
from rpcompile.finetune import FinetuneConfig, finetune  # noqa: E402
from rpcompile.finetune.metrics import read_metrics  # noqa: E402
from rpcompile.finetune.neftune import add_neftune  # noqa: E402
import hf_fixtures as fx  # noqa: E402
import models  # noqa: E402

ALPHA = 5.0


def test_training_adds_uniform_noise_of_the_documented_scale_and_evaluate_adds_none():
    model = models.llama()
    add_neftune(model, ALPHA)
    seen = []
    model.get_input_embeddings().register_forward_hook(
        lambda m, a, out: seen.append((m.training, a[0].clone(), out.detach().clone())))  # after NEFTune's hook
    batch = models.lm_batch(batch=4, seq=16)
    c = rpcompile.compile(model, gpus=2, example=batch, microbatches=2, staleness=0, backend="host",
                          optimizer=rpcompile.SGD(lr=0.0), memory_budget=2**19, lm_head_shards=1)
    weight = model.get_input_embeddings().weight.detach()
    bound = ALPHA / math.sqrt(16 * 32)  # L = 16 tokens, d = 32
    with c:
        assert len(c.plan.to_str().replace("|", ",").split(",")) > 2  # the embedding is recomputed in a B stage
        seen.clear()
        c.step(batch)
        c.evaluate(batch)  # it waits for the step's last backward stages (and their recompute) first
    train = [(ids, out) for training, ids, out in seen if training]
    evals = [(ids, out) for training, ids, out in seen if not training]
    noise = {}
    for ids, out in train:
        n = out - torch.nn.functional.embedding(ids, weight)
        assert noise.setdefault(tuple(ids.flatten().tolist()), n).equal(n)  # forward and recompute: the same
    assert len(noise) == 2 and len(train) == 4  # one noise per microbatch, each drawn twice
    u = torch.stack(list(noise.values())).flatten().double()
    assert u.abs().max() <= bound and u.abs().max() > 0.98 * bound
    assert abs(u.mean()) < 0.03 * bound and u.var().item() == pytest.approx(bound**2 / 3, rel=0.1)
    assert not torch.equal(*noise.values())
    assert len(evals) == 2  # and evaluate adds no noise:
    assert all(torch.equal(out, torch.nn.functional.embedding(ids, weight)) for ids, out in evals)


SMALL = dict(seq=32, micro_batch_size=2, microbatches=2, gpus=2, lr=3e-3, warmup=1, progress=False,
             memory_gib=2**19 / 2**30, lm_head_shards=1)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("neftune")
    rows = fx.text_rows()
    return dict(model=fx.model_folder(d / "tiny"), data=fx.write_jsonl(d / "train.jsonl", rows[:40]),
                eval=fx.write_jsonl(d / "eval.jsonl", rows[60:70]))


def tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.path.join(folder, "model.safetensors"))


def test_a_noisy_run_resumes_bit_for_bit_and_its_evals_see_no_noise(files, tmp_path):
    def cfg(out, **kw):
        return FinetuneConfig(model=files["model"], data=files["data"], out=str(tmp_path / out), steps=4,
                              save_every=2, eval=files["eval"], **{**SMALL, **kw})
    full = finetune(cfg("full", neftune_alpha=ALPHA))
    quiet = finetune(cfg("quiet"))

    class Crash(Exception):
        pass

    def crash_at_2(step, loss):
        if step == 2:
            raise Crash
    with pytest.raises(Crash):
        finetune(cfg("split", neftune_alpha=ALPHA), on_step=crash_at_2)
    rest = finetune(cfg("split", neftune_alpha=ALPHA, resume=True))
    assert rest.losses == full.losses[2:]  # the same noise after the resume: exact floats
    a, b = tensors(tmp_path / "full"), tensors(tmp_path / "split")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert full.losses[0] != quiet.losses[0]  # the noise is there in training ...
    assert full.evals[0] == quiet.evals[0]  # ... and not in the step-0 eval: the same model, the same loss
    lines = [r for r in read_metrics(os.path.join(tmp_path / "full", "metrics.jsonl")) if "eval_loss" in r]
    assert [r["step"] for r in lines] == [0, 4] and all(0 <= r["eval_token_accuracy"] <= 1 for r in lines)
