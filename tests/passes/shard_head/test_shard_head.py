"""Acceptance tests for rpcompile.passes.shard_lm_head (issue #4 item 5)."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


import models as M  # noqa: E402
from rpcompile import CostTable  # noqa: E402
from rpcompile.passes import shard_lm_head, trace  # noqa: E402

pytest.importorskip("transformers")

from head_cases import B, T, ZOO, example as _example, loss_and_grads as _loss_and_grads  # noqa: E402
from head_cases import traced as _traced  # noqa: E402


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("name", list(ZOO))
def test_sharded_loss_and_grads_match(name: str, k: int) -> None:
    model, graph = _traced(name)
    before = (graph.layers, dict(graph.values), graph.layers[-1].module.code)
    example = _example(name)
    ref, ref_grads = _loss_and_grads(model, graph, example)
    sharded = shard_lm_head(graph, shards=k)
    assert (graph.layers, graph.values, graph.layers[-1].module.code) == before  # input unchanged
    loss, grads = _loss_and_grads(model, sharded, example)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for pname, g in grads.items():
        torch.testing.assert_close(g, ref_grads[pname], atol=1e-5, rtol=0, msg=pname)
    # K shard layers + 1 loss layer replace the head layer
    assert len(sharded.layers) == len(graph.layers) + k
    head = graph.layers[-1]
    assert [lay.name for lay in sharded.layers[-k - 1:]] == [f"{head.name}.shard{i}" for i in range(k)] + [
        f"{head.name}.loss"]
    assert [lay.index for lay in sharded.layers] == list(range(len(sharded.layers)))
    assert sharded.layers[-1].outputs == (sharded.loss,) and sharded.layers[-1].params == ()
    # every shard reads one vocabulary slice of the canonical head weight, together all of it
    (wname,) = head.params
    vocab = graph.params[wname].shape[0]
    shards = sharded.layers[-k - 1:-1]
    slices = [lay.param_slices for lay in shards]
    assert all(len(s) == 1 and s[0][:2] == (wname, 0) for s in slices)
    assert [s[0][2] for s in slices] + [vocab] == [0] + [s[0][3] for s in slices]
    assert max(s[0][3] - s[0][2] for s in slices) == math.ceil(vocab / k)
    for lay in sharded.layers:
        assert set(dict(lay.module.named_parameters())) == set(lay.params) <= set(graph.params)
    owners = sharded.param_owners()[wname]
    first = sharded.layers[-k - 1].index
    assert owners == ((0,) if name != "llama" else ()) + tuple(range(first, first + k))


def test_tied_owners_embedding_and_every_shard() -> None:
    _, graph = _traced("gpt2")
    sharded = shard_lm_head(graph, shards=3)
    assert graph.tied == sharded.tied == {"lm_head.weight": "transformer.wte.weight"}
    n = len(sharded.layers)
    assert sharded.param_owners()["transformer.wte.weight"] == (0, n - 4, n - 3, n - 2)


class _CountNew(TorchDispatchMode):
    """Records the element count of every tensor an op allocates (views excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.biggest: list[tuple[int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and not t._is_view():
                self.biggest.append((t.numel(), str(func)))
        return out


def _run_layer_counting(layer, env, state):
    """Forward + backward of one layer as the runtime runs it (functional_call), counting allocations."""
    args = tuple(env[n].detach().requires_grad_(env[n].requires_grad) for n in layer.inputs)
    with _CountNew() as mode:
        outs = torch.func.functional_call(layer.module, state, args)
        pairs = [(o, torch.ones_like(o)) for o in outs if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return outs, max(mode.biggest)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_no_layer_materialises_more_than_a_vocab_shard(name: str) -> None:
    model, graph = _traced(name)
    example = _example(name)
    tokens = B * T
    k = 3
    sharded = shard_lm_head(graph, shards=k)
    env = dict(sharded.flatten_inputs(example))
    for lay in sharded.layers:  # the inputs each layer sees
        env.update(zip(lay.outputs, lay.module(*(env[n] for n in lay.inputs))))
    full = {n: p.detach() for n, p in sharded.parameters().items()}
    _, unsharded = _run_layer_counting(graph.layers[-1], env, {n: full[n].clone().requires_grad_() for n in
                                                               graph.layers[-1].params})
    vocab = graph.params[graph.layers[-1].params[0]].shape[0]
    assert unsharded[0] >= tokens * vocab  # sanity: the plain head creates full logits
    for lay in sharded.layers[-k - 1:]:
        state = {n: full[n].narrow(d, a, b - a).clone().requires_grad_() for n, d, a, b in lay.param_slices}
        outs, (numel, op) = _run_layer_counting(lay, env, state)
        assert numel <= tokens * math.ceil(vocab / k), (lay.name, op, numel)
        for got, want in zip(outs, (env[n] for n in lay.outputs)):  # the slice alone gives the same values
            torch.testing.assert_close(got, want, atol=0, rtol=0)


class _Tiny(nn.Module):
    """A small LM whose head variant is chosen by `mode` (vocabulary 37: not divisible by 2, 3 or 4)."""

    V, H = 37, 8

    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        self.emb = nn.Embedding(self.V, self.H)
        self.blocks = nn.ModuleList(nn.Linear(self.H, self.H) for _ in range(2))
        self.head = nn.Linear(self.H, self.V)
        self.proj = nn.Parameter(torch.randn(self.H, self.V))
        self.ce = nn.CrossEntropyLoss(reduction="sum", ignore_index=3)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = torch.tanh(block(x))
        v = self.V
        if self.mode == "bias+module":  # nn.Linear with bias, nn.CrossEntropyLoss(sum, ignore_index=3)
            return self.ce(self.head(x).reshape(-1, v), targets.reshape(-1))
        if self.mode == "tied_t*scale":  # constant * (x @ W.t()), reduction none then mean
            logits = 0.5 * (x @ self.emb.weight.t())
            return torch.nn.functional.cross_entropy(logits.view(-1, v), targets.view(-1), reduction="none").mean()
        if self.mode == "matmul/scale":  # x @ P with P (hidden, vocab): the vocabulary is dim 1
            return torch.nn.functional.cross_entropy((torch.matmul(x, self.proj) / 2.0).view(-1, v), targets.view(-1))
        logits = 30 * torch.tanh(self.head(x) / 30)  # soft-capping: unsupported
        return torch.nn.functional.cross_entropy(logits.view(-1, v), targets.view(-1))


def _tiny_batch():
    g = torch.Generator().manual_seed(1)
    idx, tgt = torch.randint(0, _Tiny.V, (3, 5), generator=g), torch.randint(0, _Tiny.V, (3, 5), generator=g)
    tgt[0, :2] = 3  # ignored by the nn.CrossEntropyLoss variant only
    return idx, tgt


@pytest.mark.parametrize("mode,dim", [("bias+module", 0), ("tied_t*scale", 0), ("matmul/scale", 1)])
def test_head_variants(mode: str, dim: int) -> None:
    model, example = _Tiny(mode), _tiny_batch()
    example[1][1, 1] = 3 if mode == "bias+module" else -100  # the variant's ignore_index
    graph = trace(model, example)
    ref, ref_grads = _loss_and_grads(model, graph, example)
    for k in (2, 4, _Tiny.V):
        sharded = shard_lm_head(graph, shards=k)
        loss, grads = _loss_and_grads(model, sharded, example)
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-6)
        for pname, g in grads.items():
            torch.testing.assert_close(g, ref_grads[pname], atol=1e-5, rtol=0, msg=f"{mode} {k} {pname}")
        assert {s[1] for lay in sharded.layers for s in lay.param_slices} == {dim}
        if mode == "bias+module" and k == 4:
            assert sharded.layers[-2].param_slices == (("head.weight", 0, 27, 37), ("head.bias", 0, 27, 37))


def test_unsupported_heads_say_what_they_found() -> None:
    model, example = _Tiny("softcap"), _tiny_batch()
    with pytest.raises(ValueError, match="tanh"):
        shard_lm_head(trace(model, example), shards=2)
    seq = trace(M.sequential(), M.regression_batch(), loss_fn=M.mse_loss)
    with pytest.raises(ValueError, match="cross_entropy once, found 0.*mse_loss"):
        shard_lm_head(seq, shards=2)


def test_shards_argument() -> None:
    _, graph = _traced("llama")
    assert shard_lm_head(graph, shards=1) is graph
    for bad in (0, -1, 129, 2.0, "two", True):
        with pytest.raises(ValueError, match="shards must be"):
            shard_lm_head(graph, shards=bad)
    assert len(shard_lm_head(graph, shards=128).layers) == len(graph.layers) + 128  # one token id per shard


def test_auto_from_flops_times_and_param_bytes() -> None:
    _, graph = _traced("llama")  # embed, 2 decoder layers, norm, head
    n = len(graph.layers)

    def table(head: float, flops: bool = False) -> CostTable:  # fwd+bwd: 2, 6, 6, 0.3 -> median 4
        fwd, bwd = [1, 2, 2, 0.1, head / 3], [1, 4, 4, 0.2, 2 * head / 3]
        extra = dict(fwd_flops=[0, *fwd[1:]], bwd_flops=[0, *bwd[1:]]) if flops else {}
        return CostTable.from_lists(fwd=fwd, bwd=bwd, **extra)

    for head, k in ((15.0, 4), (12.0, 3), (4.0, 1), (3.0, 1), (4000.0, 4)):  # 1000x a layer: one shard per layer
        got = shard_lm_head(graph, "auto", costs=table(head), balance="time")
        assert len(got.layers) == n + (k if k > 1 else 0), (head, k)
    # FLOPs (the default balance): the layers of no FLOPs (the embedding) are left out: median 6 of 6, 6, 0.3
    for head, k in ((15.0, 3), (12.0, 2), (4.0, 1)):
        got = shard_lm_head(graph, "auto", costs=table(head, flops=True))
        assert len(got.layers) == n + (k if k > 1 else 0), (head, k)
    # a measured time never decides: costs without FLOPs shard by parameter bytes, whatever their times say
    assert shard_lm_head(graph, "auto", costs=table(4000.0)) is graph
    with pytest.raises(ValueError, match="costs has 2 layers"):
        shard_lm_head(graph, "auto", costs=CostTable.from_lists([1, 1], [1, 1]))
    with pytest.raises(ValueError, match="balance"):
        shard_lm_head(graph, "auto", costs=table(4.0), balance="measured")
    # without costs: head bytes 16 KiB vs median of (16 KiB, 36.25 KiB, 36.25 KiB, 128 B) -> 1 shard
    assert shard_lm_head(graph, "auto") is graph
    model = M.llama(vocab_size=1024)  # head 128 KiB / median 36.25 KiB -> ceil(3.53) = 4
    big = trace(model, M.lm_batch(vocab=1024))
    assert len(shard_lm_head(big).layers) == len(big.layers) + 4


def test_values_of_the_new_cuts() -> None:
    _, graph = _traced("llama")
    sharded = shard_lm_head(graph, shards=2)
    tokens, hidden = B * T, 32
    vals = sharded.values
    assert (vals["lm_head_target"].shape, vals["lm_head_target"].dtype) == ((tokens,), torch.int64)
    assert vals["lm_head_x0"].shape == (B, T, hidden) and vals["lm_head_x0"].requires_grad
    for i in range(2):
        m, s, t = (vals[f"lm_head_{w}{i}"] for w in ("max", "sumexp", "tlogit"))
        assert m.shape == s.shape == t.shape == (tokens,) and m.dtype == torch.float32
        assert (m.requires_grad, s.requires_grad, t.requires_grad) == (False, True, True)
        assert s.bytes == tokens * 4 and s.batch_dim == 0
    cut = len(sharded.layers) - 3  # after shard 0: hidden pass-through, target, statistics
    assert {v.name for v in sharded.live_at(cut)} == {
        "lm_head_target", "lm_head_x0", "lm_head_max0", "lm_head_sumexp0", "lm_head_tlogit0"}
    grad_consumers = {}
    for lay in sharded.layers:
        for name in lay.inputs:
            if vals[name].requires_grad:
                grad_consumers[name] = grad_consumers.get(name, 0) + 1
    assert set(grad_consumers.values()) == {1}  # a gradient-carrying value has exactly one consumer


def test_hf_num_items_in_batch_follows_the_loss() -> None:
    model = M.llama()
    example = {**M.lm_batch(batch=2, seq=8), "num_items_in_batch": torch.tensor(11)}
    example["labels"][0, :3] = -100
    graph = trace(model, example)
    sharded = shard_lm_head(graph, shards=3)
    assert "num_items_in_batch" in sharded.layers[-1].inputs
    torch.testing.assert_close(sharded.run(example), model(**example).loss, atol=1e-5, rtol=0)
