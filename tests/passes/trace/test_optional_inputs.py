"""Optional inputs (issue 14, item 4): an input absent or None in the example but present later, or the
other way round, is never silently dropped.

A batch whose inputs differ from the compiled program's (a key added or removed, a value that is None
counts as absent) gets a program of its own: re-planned once, then kept, so a key that comes and goes
switches between the two programs. What no program can honour raises ValueError naming the key.
Everything is compared with eager PyTorch at staleness 0 in fp32 (within 1e-5): losses and final weights.
"""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch


import models as M  # noqa: E402
import rpcompile  # noqa: E402
from oracle import reference_train  # noqa: E402

transformers = pytest.importorskip("transformers")

OPT = rpcompile.SGD(lr=0.1)


def _llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _batch(seed: int, mask: str = "absent", b: int = 4, t: int = 8) -> dict:
    """ids and labels, with an attention mask: "absent" (no key), "none" (the key is None), "ones" (no
    padding), "pad" (padding in both microbatches) or "pad0" (padding in the first microbatch only)."""
    ids = torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(seed))
    out: dict = {"input_ids": ids, "labels": ids.clone()}
    if mask == "none":
        out["attention_mask"] = None
    elif mask != "absent":
        m = torch.ones(b, t, dtype=torch.long)
        if mask in ("pad", "pad0"):
            m[0, :3] = 0
        if mask == "pad":
            m[b - 1, :2] = 0
        out["attention_mask"] = m
    return out


def _train(model, example, batches, **kw) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final weights of rpcompile (2 host workers, 2 microbatches, staleness 0 unless told)."""
    opts = dict(gpus=2, example=example, microbatches=2, staleness=0, optimizer=OPT, backend="host")
    with rpcompile.compile(copy.deepcopy(model), **{**opts, **kw}) as c:
        losses = [c.step(b) for b in batches]
        return losses, {n: p.detach().clone() for n, p in c.model().named_parameters()}


def _hf_loss(m: torch.nn.Module, b: dict) -> torch.Tensor:
    return m(**b, use_cache=False).loss


def _assert_eager(model, got: tuple, batches, loss_fn=_hf_loss, staleness: int = 0) -> None:
    want, sd = reference_train(model, batches, optimizer=OPT, staleness=staleness, loss_fn=loss_fn)
    torch.testing.assert_close(torch.tensor(got[0], dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               atol=1e-5, rtol=0)
    for name, p in got[1].items():
        torch.testing.assert_close(p, sd[name], atol=1e-5, rtol=0, msg=name)


def _replans(capsys) -> int:
    return capsys.readouterr().err.count("re-planned")


@pytest.mark.parametrize("example", ["absent", "none", "ones"])
def test_a_mask_is_read_when_the_example_had_none_or_no_padding(example):
    model = _llama()
    batches = [_batch(0, example), _batch(1, "pad"), _batch(2, "pad")]
    with torch.no_grad():  # the padding changes the loss: a program that drops the mask cannot pass
        assert abs(_hf_loss(model, batches[1]) - _hf_loss(model, _batch(1))) > 1e-3
    _assert_eager(model, _train(model, _batch(0, example), batches), batches)


def test_a_padded_example_trains_a_microbatch_without_padding():
    model = _llama()
    batches = [_batch(0, "pad"), _batch(1, "pad0"), _batch(2, "ones"), _batch(3, "pad")]
    _assert_eager(model, _train(model, _batch(0, "pad"), batches), batches)


def test_a_padded_example_trains_and_evaluates_batches_without_a_mask(capsys):
    model = _llama()
    batches = [_batch(0, "pad"), _batch(1, "absent"), _batch(2, "none"), _batch(3, "pad")]
    _assert_eager(model, _train(model, _batch(0, "pad"), batches), batches)
    assert _replans(capsys) == 1  # "none" is "absent": one program for both; back to the first for "pad"
    with rpcompile.compile(copy.deepcopy(model), gpus=2, example=_batch(0, "pad"), microbatches=2,
                           staleness=0, optimizer=OPT, backend="host") as c:
        with torch.no_grad():
            want = _hf_loss(model, _batch(4))
        assert abs(c.evaluate(_batch(4)) - float(want)) < 1e-5


@pytest.mark.parametrize("staleness", [0, 1])
def test_adding_a_key_then_removing_it_switches_back_without_replanning(capsys, staleness):
    model = _llama()
    batches = [_batch(0), _batch(1, "pad"), _batch(2), _batch(3, "none"), _batch(4, "pad")]
    got = _train(model, _batch(0), batches, staleness=staleness)
    _assert_eager(model, got, batches, staleness=staleness)
    assert _replans(capsys) == 1  # only the first batch with a mask plans; the others reuse a program


def _weighted_mse(output: torch.Tensor, example: tuple) -> torch.Tensor:
    """loss_fn for tests/models.sequential with optional per-row weights (example[2]) and a scale (example[3])."""
    w = example[2] if len(example) > 2 and example[2] is not None else None
    scale = example[3] if len(example) > 3 else 1.0
    err = (output - example[1]).pow(2).mean(-1)
    return scale * ((err * w).mean() if w is not None else err.mean())


def test_tuple_inputs_and_constants_that_come_and_go():
    model = M.sequential()
    x, y = M.regression_batch(batch=4)
    w = torch.rand(4, generator=torch.Generator().manual_seed(5))
    batches = [(x, y), (x, y, w), (x, y), (x, y, None), (x, y, None, 3.0), (x, y, w)]
    got = _train(model, (x, y), batches, loss_fn=_weighted_mse)
    _assert_eager(model, got, batches, loss_fn=lambda m, b: _weighted_mse(m(b[0]), b))
    assert got[0][4] > 2 * got[0][3]  # the scale that only a later batch had was applied


def test_an_input_the_model_cannot_do_without_is_named():
    with rpcompile.compile(_llama(), gpus=2, example=_batch(0), microbatches=2, staleness=0, optimizer=OPT,
                           backend="host") as c:
        with pytest.raises(ValueError, match="missing 'labels'"):
            c.step({"input_ids": _batch(1)["input_ids"]})
        with pytest.raises(ValueError, match="missing 'labels'"):
            c.step({**_batch(1), "labels": None})
        assert c.steps == 0
        c.step(_batch(1))  # the handle works as before
        assert c.steps == 1
    x, y = M.regression_batch(batch=4)
    with rpcompile.compile(M.sequential(), gpus=2, example=(x, y), microbatches=2, staleness=0, optimizer=OPT,
                           loss_fn=_weighted_mse, backend="host") as c:
        with pytest.raises(ValueError, match="missing 'arg1'"):
            c.step((x,))
        with pytest.raises(ValueError, match=r"inputs changed \(\+arg2\)"):  # weights of the wrong shape
            c.step((x, y, torch.ones(4, 3)))
        c.step((x, y))
