"""Memory-efficient attention by default (issue 13): what rpcompile builds, how SDPA is priced, the runtime."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys

import pytest
import torch


import models as M  # noqa: E402
import rpcompile  # noqa: E402
from rpcompile import Hardware  # noqa: E402
from rpcompile.passes import trace  # noqa: E402
from rpcompile.passes.meta.attention import attention_flops  # noqa: E402
from rpcompile.passes.cost import count_layers  # noqa: E402
from rpcompile.passes.cost.symbolic import B, S, symbolic_costs  # noqa: E402
from rpcompile.models.zoo import LlamaConfig, TinyLlama  # noqa: E402

transformers = pytest.importorskip("transformers")


def test_presets_use_memory_efficient_attention_unless_told_otherwise(tmp_path) -> None:
    from rpcompile.models.attention import NAME
    from rpcompile.models.presets import MODELS, build_meta
    for name in MODELS:
        want = NAME if name == "gpt-oss-20b" else "sdpa"  # GPT-OSS has no transformers SDPA path (sinks)
        assert build_meta(name).config._attn_implementation == want, name
    assert build_meta("qwen3-1.7b", attn_implementation="eager").config._attn_implementation == "eager"
    cfg = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=4, vocab_size=64)
    for extra, want in (({}, "sdpa"), ({"attn_implementation": "eager"}, "eager")):
        path = tmp_path / f"cfg{len(extra)}.json"
        path.write_text(json.dumps({**cfg, **extra}))
        assert build_meta(str(path)).config._attn_implementation == want


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_zoo_sdpa_equals_its_eager_attention() -> None:
    cfg = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=64, max_seq=32)
    assert cfg.attention == "sdpa"
    fast, slow = TinyLlama(cfg), TinyLlama(dataclasses.replace(cfg, attention="eager"))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    a, b = fast(ids, ids), slow(ids, ids)
    a.backward()
    b.backward()
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for (n, g), (_, h) in zip(_grads(fast).items(), _grads(slow).items()):
        torch.testing.assert_close(g, h, atol=1e-6, rtol=0, msg=n)
    with pytest.raises(ValueError, match="attention must be"):
        TinyLlama(dataclasses.replace(cfg, attention="flash"))(ids, ids)


def _gpt_oss(attn: str) -> torch.nn.Module:
    cfg = transformers.GptOssConfig(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=3, attn_implementation=attn,
                                    layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    return transformers.GptOssForCausalLM(cfg).train()


def test_attention_sinks_through_one_sdpa_call_equal_eager() -> None:
    from rpcompile.models.attention import register
    eager, fused = _gpt_oss("eager"), _gpt_oss(register())
    with torch.no_grad():
        for m in eager.modules():
            if hasattr(m, "sinks"):
                m.sinks.normal_()
    fused.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    for mask in (None, torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9])):  # causal; padding + window
        extra = {} if mask is None else {"attention_mask": mask}
        losses = []
        for model in (eager, fused):
            model.zero_grad(set_to_none=True)
            losses.append(model(input_ids=ids, labels=ids, **extra).loss)
            losses[-1].backward()
        torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=0)
        for (n, g), (_, h) in zip(_grads(eager).items(), _grads(fused).items()):
            torch.testing.assert_close(h, g, atol=1e-5, rtol=0, msg=n)


def _attention_ops(graph, batch):
    layer = count_layers(graph, graph.flatten_inputs(batch), progress=False)[1]
    return [o for o in layer.fwd_ops + layer.bwd_ops if "attention" in o.name]


def test_sdpa_is_priced_as_one_flash_op_each_way_with_linear_bytes() -> None:
    model = M.llama(attn="sdpa")
    graph = trace(model, M.lm_batch(batch=2, seq=16))
    heads, d = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    kv = model.config.num_key_value_heads
    by_seq = {}
    for seq in (16, 32):
        ops = _attention_ops(graph, M.lm_batch(batch=2, seq=seq))
        assert [o.name for o in ops] == ["_scaled_dot_product_flash_attention_for_cpu",
                                         "_scaled_dot_product_flash_attention_for_cpu_backward"]
        q, k = (2, heads, seq, d), (2, kv, seq, d)
        assert ops[0].flops == attention_flops(q, k, k, causal=True) == 2 * 2 * heads * seq * (seq + 1) // 2 * 2 * d
        assert ops[1].flops == attention_flops(q, k, k, causal=True, backward=True) == 5 * ops[0].flops // 2
        by_seq[seq] = ops
    assert all(b.bytes == 2 * a.bytes for a, b in zip(by_seq[16], by_seq[32]))  # q, k, v, out, lse: linear in S
    assert attention_flops(q, k, k, causal=False) == 2 * 2 * heads * 32 * 32 * 2 * d  # every pair without causal


def test_symbolic_attention_flops_are_half_the_score_matrix() -> None:
    batch = M.lm_batch(batch=2, seq=16)
    hw = Hardware.preset("rtx4090")
    s2 = {}
    for attn in ("sdpa", "eager"):
        graph = trace(M.llama(attn=attn), batch)
        sc = symbolic_costs(graph, graph.flatten_inputs(batch), hw)
        s2[attn] = sc.fwd_flops[1].as_poly(B, S).coeff_monomial(B * S ** 2)
    heads, d = 4, 8
    assert s2["sdpa"] == 2 * heads * d  # 2 matmuls x 2 FLOPs x S^2 / 2 pairs x heads x d
    assert s2["eager"] == 2 * s2["sdpa"]  # the math path scores every pair


def _padded(seed: int, rows: int, seq: int, pad: int) -> dict[str, torch.Tensor]:
    batch = M.lm_batch(batch=rows, seq=seq, seed=seed)
    batch["attention_mask"] = torch.ones(rows, seq, dtype=torch.long)
    batch["attention_mask"][seed % rows, :pad] = 0
    return batch


@pytest.mark.parametrize("build", [M.llama, M.qwen3])
def test_staleness0_runtime_equals_eager_with_sdpa_and_varying_padding(build) -> None:
    torch.manual_seed(0)
    model = build(attn="sdpa")
    ref = copy.deepcopy(model)
    batches = [_padded(s, 4, 8, pad) for s, pad in enumerate((0, 3, 5))]  # the example has no padding
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    want = []
    for b in batches:  # the runtime's loss: the mean of the two microbatches' losses
        opt.zero_grad(set_to_none=True)
        loss = sum(ref(**{k: v[h:h + 2] for k, v in b.items()}).loss for h in (0, 2)) / 2
        loss.backward()
        opt.step()
        want.append(loss.item())
    with rpcompile.compile(model, gpus=2, example=batches[0], microbatches=2, staleness=0,
                           optimizer=rpcompile.SGD(lr=0.5), backend="host") as c:
        got = [c.step(b) for b in batches]
        trained = c.model()
    assert got == pytest.approx(want, rel=1e-5)
    for (n, p), (_, q) in zip(trained.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=n)
