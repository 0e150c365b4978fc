"""Packed documents do not attend to each other (issue 24, item 4): `rpcompile.finetune.packed_attention`.

The attention runs one causal SDPA call per document (memory linear in S); these tests check it
against a block-diagonal mask, through `rpcompile.compile` on the host backend (the runtime's path),
and that the cost model sees what runs: per-document flash ops on real tensors, the whole-row worst
case on meta. Each correctness test has a control that shows it can fail.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F


import models as M  # noqa: E402
import rpcompile  # noqa: E402
from rpcompile import Hardware  # noqa: E402
from rpcompile.finetune import packed_attention as PA  # noqa: E402
from rpcompile.passes import estimate_costs, trace  # noqa: E402
from rpcompile.passes.meta.attention import attention_flops  # noqa: E402
from rpcompile.passes.cost.count import _leaf, count_layers, run_once  # noqa: E402

transformers = pytest.importorskip("transformers")

FLASH = "_scaled_dot_product_flash_attention_for_cpu"


def _block_reference(q, k, v, position_ids, pad=None):
    """softmax attention with an explicit block-diagonal causal (and padding) mask: the quadratic reference."""
    b, h, s, _ = q.shape
    doc = PA.document_starts(position_ids.expand(b, s)).cumsum(-1)
    mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    if pad is not None:
        mask = mask & pad[:, None, :].bool()
    k, v = k.repeat_interleave(h // k.shape[1], 1), v.repeat_interleave(h // v.shape[1], 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None]).transpose(1, 2)


def _qkv(b=2, h=4, hkv=2, s=11, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, d, generator=g, requires_grad=True) for n in (h, hkv, hkv)]


@pytest.mark.parametrize("case", ["rows differ", "shared positions", "padding mask"])
def test_packed_sdpa_equals_block_diagonal_mask(case) -> None:
    q, k, v = _qkv()
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4, 5, 6, 0, 0]])
    pad = mask4 = None
    if case == "shared positions":
        pos = pos[:1]
    if case == "padding mask":  # left padding in row 0: transformers' sdpa mask, sliced per document
        pad = torch.ones(2, 11, dtype=torch.long)
        pad[0, :2] = 0
        pos = torch.tensor([[0, 0, 0, 1, 0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8]])
        mask4 = (torch.ones(11, 11, dtype=torch.bool).tril() & pad[:, None, :].bool())[:, None]
    got = PA.packed_sdpa(q, k, v, pos, mask4, groups=2)
    want = _block_reference(q, k, v, pos, pad)
    rows = slice(None) if pad is None else (slice(None), slice(2, None))  # fully padded queries: undefined
    torch.testing.assert_close(got[rows], want[rows], atol=1e-6, rtol=0)
    got[rows].square().sum().backward()
    g1 = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want[rows].square().sum().backward()
    for a, b in zip(g1, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    whole = PA.packed_sdpa(q, k, v, None, mask4, groups=2)  # control: no document starts, one causal call
    assert (whole[rows] - want[rows]).abs().max() > 1e-2


def test_meta_runs_one_whole_row_call() -> None:
    q = torch.empty(2, 4, 16, 8, device="meta")
    pos = torch.empty(2, 16, dtype=torch.long, device="meta")
    assert PA.packed_sdpa(q, q[:, :2], q[:, :2], pos, groups=2).shape == (2, 16, 4, 8)
    assert PA.packed_mask(batch_size=1, q_length=4, kv_length=4, attention_mask=None, allow_is_causal_skip=False) \
        is None


def _docs(seed=0, la=6, lb=9, vocab=M.VOCAB):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (la,), generator=g), torch.randint(0, vocab, (lb,), generator=g)


def _packed(*docs, target=-1):
    """One row of `docs` back to back, positions restarting at each, labels only on docs[target]'s targets."""
    ids = torch.cat(docs)
    pos = torch.cat([torch.arange(len(d)) for d in docs])
    labels = torch.full_like(ids, -100)
    start = sum(len(d) for d in docs[:target % len(docs)])
    labels[start + 1:start + len(docs[target])] = docs[target][1:]  # -100 at its first token
    return ids, pos, labels


def _alone(b) -> float:
    model = M.llama(attn="sdpa").float()
    with torch.no_grad():
        return model(input_ids=b[None], labels=b[None].clone(), use_cache=False).loss.item()


def _compiled_loss(batch, packed=True) -> float:
    model = M.llama(attn="sdpa").float()
    if packed:
        PA.use_packed_attention(model)
    c = rpcompile.compile(model, gpus=2, example=batch, microbatches=1, backend="host")
    try:
        return c.evaluate(batch)
    finally:
        c.close()


def test_packed_document_loss_equals_the_document_alone_through_compile(monkeypatch) -> None:
    a, b = _docs()
    ids, pos, labels = _packed(a, b)
    batch = {"input_ids": ids[None], "labels": labels[None], "position_ids": pos[None]}
    alone = _alone(b)
    assert model_attn(PA.use_packed_attention(M.llama(attn="sdpa"))) == PA.NAME
    assert abs(_compiled_loss(batch) - alone) < 1e-5
    # two rows packed differently (a, b, c and c, a, b): each row is b's loss, so is their mean
    c_doc = torch.randint(0, M.VOCAB, (3,), generator=torch.Generator().manual_seed(5))
    rows = [_packed(a, b, c_doc, target=1), _packed(c_doc, a, b)]
    two = {k: torch.stack([r[i] for r in rows]) for i, k in enumerate(("input_ids", "position_ids", "labels"))}
    assert abs(_compiled_loss(two) - alone) < 1e-5
    # controls: documents that see each other give another loss
    monkeypatch.setattr(PA, "_segments", lambda position_ids, batch: [[(0, position_ids.shape[1])]])
    assert abs(_compiled_loss(batch) - alone) > 1e-3  # our attention over the whole row
    monkeypatch.undo()
    cont = dict(batch, position_ids=torch.arange(len(ids))[None])
    assert abs(_compiled_loss(cont, packed=False) - alone) > 1e-3  # plain sdpa, positions not restarted


def model_attn(model) -> str:
    return model.config._attn_implementation


def test_no_sequence_squared_mask_is_built() -> None:
    """Plain "sdpa" keeps packed documents apart only with a (B, 1, S, S) block-diagonal mask; ours builds none."""
    from transformers.masking_utils import create_causal_mask
    a, b = _docs()
    _, pos, _ = _packed(a, b)
    s = len(pos)
    for attn, want in (("sdpa", (1, 1, s, s)), (PA.NAME, None)):
        model = M.llama(attn="sdpa")
        if attn == PA.NAME:
            PA.use_packed_attention(model)
        mask = create_causal_mask(config=model.config, inputs_embeds=torch.zeros(1, s, 32), attention_mask=None,
                                  cache=None, position_ids=pos[None])
        assert (None if mask is None else tuple(mask.shape)) == want, attn


def test_cost_model_prices_documents_when_real_and_the_whole_row_on_meta() -> None:
    a, b = _docs()
    ids, pos, labels = _packed(a, b)
    batch = {"input_ids": ids[None], "labels": labels[None], "position_ids": pos[None]}
    model = PA.use_packed_attention(M.llama(attn="sdpa").float())
    graph = trace(model, batch)
    cfg = model.config
    h, kv, d, s = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, len(ids)
    # predict mode (meta): one flash call over the whole row, the single-document worst case
    layer = count_layers(graph, graph.flatten_inputs(batch), progress=False)[1]
    ops = [o for o in layer.fwd_ops + layer.bwd_ops if "attention" in o.name]
    assert [o.name for o in ops] == [FLASH, FLASH + "_backward"]
    assert ops[0].flops == attention_flops((1, h, s, d), (1, kv, s, d), (1, kv, s, d), causal=True)
    # real tensors (measure mode): one flash call per document, each priced for its own length
    env = dict(graph.flatten_inputs(batch))
    first = graph.layers[0]
    env.update(zip(first.outputs, first.module(*[env[n] for n in first.inputs])))
    dec = graph.layers[1]
    state = {k: t.detach().requires_grad_(t.requires_grad) for k, t in dec.module.state_dict(keep_vars=True).items()}
    grads = [graph.values[n].requires_grad if n in graph.values else False for n in dec.inputs]
    _, rf, rb, _ = run_once(dec, state, [_leaf(env[n], g) for n, g in zip(dec.inputs, grads)])
    fwd = [o for o in rf.ops if "attention" in o.name]
    assert [o.name for o in fwd] == [FLASH, FLASH]
    assert [o.flops for o in fwd] == [attention_flops((1, h, n, d), (1, kv, n, d), (1, kv, n, d), causal=True)
                                      for n in (len(a), len(b))]
    assert len([o for o in rb.ops if o.name == FLASH + "_backward"]) == 2
    for mode, kw in (("measure", {"warmup": 0, "repeats": 1}), ("predict", {"hardware": Hardware.preset("rtx4090")})):
        table = estimate_costs(graph, batch, mode=mode, progress=False, **kw)
        assert len(table.fwd) == len(graph.layers)


def test_traced_attention_is_one_leaf_call() -> None:
    """Traced with fx (a unit traced through), the per-document loop is one call_function node, run with data."""
    class Attn(torch.nn.Module):
        def forward(self, q, k, v, pos):
            return PA.packed_sdpa(q, k, v, pos, groups=2) * 2

    gm = torch.fx.symbolic_trace(Attn())
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert PA._packed_sdpa in calls
    q, k, v = _qkv()
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2]] * 2)
    torch.testing.assert_close(gm(q, k, v, pos), 2 * _block_reference(q, k, v, pos), atol=1e-6, rtol=0)


def test_use_packed_attention_refuses_models_it_cannot_follow() -> None:
    with pytest.raises(ValueError, match="attention interface"):
        PA.use_packed_attention(torch.nn.Linear(2, 2))
    model = M.llama(attn="sdpa")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="flex_attention"):
        PA.use_packed_attention(model)


def test_attention_sinks_are_kept_per_document() -> None:
    """GPT-OSS (sink attention, a sliding-window layer): packed through `use_packed_attention`, equal to alone."""
    from rpcompile.models.attention import register
    cfg = transformers.GptOssConfig(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=3, attn_implementation=register(),
                                    layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks.normal_()
    a, b = _docs(vocab=128)
    ids, pos, labels = _packed(a, b)
    with torch.no_grad():
        alone = model(input_ids=b[None], labels=b[None].clone(), use_cache=False).loss
        PA.use_packed_attention(model)
        packed = model(input_ids=ids[None], labels=labels[None], position_ids=pos[None], use_cache=False).loss
        whole = model(input_ids=ids[None], labels=labels[None], use_cache=False).loss  # control: no restarts
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    assert (whole - alone).abs() > 1e-3


def test_three_rows_laid_out_a_a_b_each_equal_the_row_alone() -> None:
    """Rows 0 and 1 share their document starts, row 2 does not: every row must keep its own documents."""
    q, k, v = _qkv(b=3, seed=3)
    a, b = [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4, 5, 6, 0, 1]
    pos = torch.tensor([a, a, b])
    got = PA.packed_sdpa(q, k, v, pos, groups=2)
    for r in range(3):
        alone = _block_reference(q[r:r + 1], k[r:r + 1], v[r:r + 1], pos[r:r + 1])
        torch.testing.assert_close(got[r:r + 1], alone, atol=1e-6, rtol=0)
