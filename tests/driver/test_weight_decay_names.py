"""compile(optimizer=AdamW(decay=...)): names checked before tracing, a callable saved as names, resume."""
import pytest
import torch

import rpcompile
from rpcompile.models.zoo import LlamaConfig, TinyLlama

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=64, max_seq=32)


def batch(seed):
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def make(decay, model=None):
    return rpcompile.compile(model or TinyLlama(CFG), gpus=2, example=batch(0), microbatches=2, staleness=1,
                             optimizer=rpcompile.AdamW(lr=1e-2, weight_decay=0.3, decay=decay, impl="foreach"),
                             memory_budget=2**20, backend="host")


def test_a_callable_is_saved_as_names_and_resumes_bit_for_bit(tmp_path):
    not_norm = lambda n: "norm" not in n  # noqa: E731 - code cannot go into a checkpoint
    want = frozenset(n for n, p in TinyLlama(CFG).named_parameters() if "norm" not in n)
    path = str(tmp_path / "run.ckpt")
    with make(not_norm) as c:
        assert c.options.optimizer.decay == want and c.state.decay == want
        c.step(batch(1))
        c.save(path)
        c.step(batch(2))
        ref = {n: p.detach().clone() for n, p in c.model().named_parameters()}
    with rpcompile.load(path, TinyLlama(CFG, seed=5)) as r:
        assert r.options.optimizer.decay == want
        r.step(batch(2))
        got = dict(r.model().named_parameters())
        assert all(torch.equal(got[n], ref[n]) for n in ref)


def test_an_unknown_decay_name_is_refused_before_tracing(monkeypatch):
    monkeypatch.setattr(rpcompile.api.Compiled, "__init__", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(ValueError, match="'layers.9.q.weight' is not a trainable parameter"):
        make({"layers.9.q.weight"})
