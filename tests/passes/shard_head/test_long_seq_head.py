"""The LM head + loss chunked along the sequence as well as sharded over the vocabulary (issue 13)."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


import models as M  # noqa: E402
from rpcompile import Hardware  # noqa: E402
from rpcompile.passes import estimate_costs, shard_lm_head  # noqa: E402
from rpcompile.passes.shard_head.chunked import chunk_bounds, chunked_lse  # noqa: E402
from rpcompile.passes.shard_head.auto import LOGIT_BYTES  # noqa: E402
from rpcompile.passes.cost.recorder import Recorder, Tracker, storage_id  # noqa: E402
from rpcompile.passes.cost.symbolic import chunk_unit, symbolic_costs  # noqa: E402

pytest.importorskip("transformers")

from head_cases import B, T, ZOO, example as _example, loss_and_grads as _loss_and_grads  # noqa: E402
from head_cases import traced as _traced  # noqa: E402


@pytest.mark.parametrize("k,chunk,ignored", [(1, 7, True), (3, 5, False), (2, 3, True)])  # none divides 64 tokens
@pytest.mark.parametrize("name", list(ZOO))
def test_chunked_loss_and_grads_equal_the_unsharded_head(name: str, k: int, chunk: int, ignored: bool) -> None:
    model, graph = _traced(name)
    example = _example(name, ignored)
    ref, ref_grads = _loss_and_grads(model, graph, example)
    chunked = shard_lm_head(graph, shards=k, chunk=chunk)
    assert chunk_unit(chunked) == chunk and len(chunked.layers) == len(graph.layers) + k
    loss, grads = _loss_and_grads(model, chunked, example)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for pname, g in grads.items():
        torch.testing.assert_close(g, ref_grads[pname], atol=1e-5, rtol=0, msg=pname)


class _Allocations(TorchDispatchMode):
    """Shapes of every tensor an op creates (views excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and not t._is_view():
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_largest_logits_alive_are_chunk_by_shard_vocab(name: str) -> None:
    model, graph = _traced(name)
    example = _example(name, True)
    k, chunk = 3, 6
    chunked = shard_lm_head(graph, shards=k, chunk=chunk)
    env = dict(chunked.flatten_inputs(example))
    for lay in chunked.layers:
        env.update(zip(lay.outputs, lay.module(*(env[n] for n in lay.inputs))))
    full = {n: p.detach() for n, p in chunked.parameters().items()}
    vocab = graph.params[graph.layers[-1].params[0]].shape[0]
    tokens, hidden = B * T, graph.values[chunked.layers[-k - 1].inputs[0]].shape[-1]
    for lay in chunked.layers[-k - 1:-1]:
        (pname, _, lo, hi), = lay.param_slices
        state = {pname: full[pname].narrow(0, lo, hi - lo).clone().requires_grad_()}
        args = tuple(env[n].detach().requires_grad_(env[n].requires_grad) for n in lay.inputs)
        saved: list[tuple[int, ...]] = []
        with _Allocations() as mode, torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            outs = torch.func.functional_call(lay.module, state, args)
            torch.autograd.backward([o for o in outs if o.requires_grad],
                                    [torch.ones_like(o) for o in outs if o.requires_grad])
        weight = {(hi - lo, hidden), (hidden, hi - lo)}  # the weight slice's gradient, either way round
        logits = [s for s in mode.shapes if len(s) == 2 and hi - lo in s and s not in weight]
        assert logits and max(math.prod(s) for s in logits) <= chunk * math.ceil(vocab / k), (lay.name, logits)
        assert max(min(s) for s in logits) == chunk  # the chunked kernel really ran chunk by chunk
        assert all(math.prod(s) < tokens * (hi - lo) for s in saved)  # nothing vocabulary-sized is kept


def test_chunks_are_balanced_and_cover_the_tokens() -> None:
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 10)]
    assert chunk_bounds(8, 4) == [(0, 4), (4, 8)] and chunk_bounds(3, 100) == [(0, 3)]


def test_logit_bytes_is_the_measured_working_set_per_logit() -> None:
    def peak(tokens: int, chunk: int) -> int:  # one shard, bf16 weights, measured by the cost recorder
        x = torch.randn(tokens, 64, dtype=torch.bfloat16).requires_grad_()
        w = torch.randn(300, 64, dtype=torch.bfloat16).requires_grad_()
        s, t = torch.ones(tokens).requires_grad_(), torch.zeros(tokens).requires_grad_()
        m, target = torch.zeros(tokens), torch.randint(0, 300, (tokens,))
        tracker = Tracker({storage_id(v) for v in (x, w, s, t, m, target)})
        with Recorder(tracker):
            out = chunked_lse(x, w, None, target, 0, chunk, (("cast", torch.float32),), 0, m, s, t)
            grads = torch.autograd.grad(out[1:], [x, w, s, t], [torch.ones_like(o) for o in out[1:]])
        return max(tracker.live(exclude={storage_id(grads[1])}))
    per_logit = (peak(1024, 256) - peak(1024, 128)) / (128 * 300)
    assert per_logit == pytest.approx(LOGIT_BYTES, rel=0.1)


def test_auto_chunk_follows_the_memory_budget() -> None:
    _, graph = _traced("llama")
    for budget, chunk in ((8 * LOGIT_BYTES * 64 * 64, 64), (8 * LOGIT_BYTES * 64 * 10, 10), (2 ** 40, B * T)):
        got = shard_lm_head(graph, shards=2, chunk="auto", memory_budget=budget)
        assert chunk_unit(got) == chunk, (budget, chunk)  # vocabulary 128 / 2 shards = 64 logits per token
    assert shard_lm_head(graph, shards=1, chunk="auto", memory_budget=2 ** 40) is graph  # nothing to cut
    for bad in (0, -3, 2.5, "many"):
        with pytest.raises(ValueError, match="chunk must be"):
            shard_lm_head(graph, shards=2, chunk=bad)


def test_symbolic_costs_of_a_chunked_head_at_one_microbatch_of_one_are_exact() -> None:
    # at B = 1 the fitting lengths are 2, 3, 4 chunks (check 5): one chunk runs no loop, and its ops differ
    model, graph = _traced("llama")
    chunked = shard_lm_head(graph, shards=2, chunk=8)
    hw = Hardware.preset("rtx4090")
    sc = symbolic_costs(chunked, chunked.flatten_inputs(M.lm_batch(batch=B, seq=T)), hw, batch=1)
    for s in (48, 72):  # whole chunks, more of them than at any fitting point
        pred, at = estimate_costs(chunked, M.lm_batch(batch=1, seq=s), mode="predict", hardware=hw,
                                  progress=False), sc.at(1, s)
        assert at.fwd_flops == pred.fwd_flops and at.bwd_flops == pred.bwd_flops
        assert at.peak_bytes == pred.peak_bytes and at.saved_bytes == pred.saved_bytes
        for x, y in zip(at.fwd + at.bwd, pred.fwd + pred.bwd):
            assert x == pytest.approx(y, rel=1e-9)


def test_symbolic_costs_of_a_chunked_head_are_exact_at_whole_chunks() -> None:
    model, graph = _traced("llama")
    chunked = shard_lm_head(graph, shards=2, chunk=8)
    hw = Hardware.preset("rtx4090")
    sc = symbolic_costs(chunked, chunked.flatten_inputs(M.lm_batch(batch=B, seq=T)), hw)
    for b, s in ((3, 24), (5, 16)):  # 72 and 80 tokens: whole chunks, more of them than at any fitting point
        batch = M.lm_batch(batch=b, seq=s)
        pred, at = estimate_costs(chunked, batch, mode="predict", hardware=hw, progress=False), sc.at(b, s)
        assert at.fwd_flops == pred.fwd_flops and at.bwd_flops == pred.bwd_flops
        assert at.peak_bytes == pred.peak_bytes and at.saved_bytes == pred.saved_bytes
        for x, y in zip(at.fwd + at.bwd, pred.fwd + pred.bwd):
            assert x == pytest.approx(y, rel=1e-9)
