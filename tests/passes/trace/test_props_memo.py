"""Shape propagation runs a repeated layer unit once (`props.unit_signature`): the traced graph is the one
every unit run gives, on the tiny transformers models, the nanoGPT and the paper presets on meta."""
from __future__ import annotations

import sys

import pytest
import torch

import models as M  # noqa: E402
from rpcompile.passes import trace
from rpcompile.passes.trace import props, sublayer_units

pytest.importorskip("transformers")

CASES = {
    "nanogpt": (M.nanogpt, lambda: M.token_batch(batch=2, seq=8), M.gpt_loss),
    "llama": (M.llama, lambda: M.lm_batch(batch=2, seq=8), None),
    "llama_sdpa": (lambda: M.llama(attn="sdpa"), lambda: M.lm_batch(batch=2, seq=8), None),
    "qwen3": (M.qwen3, lambda: M.lm_batch(batch=2, seq=8), None),
    "qwen3_moe": (M.qwen3_moe, lambda: M.lm_batch(batch=2, seq=8), None),
    "gpt2": (M.gpt2, lambda: M.lm_batch(batch=2, seq=8), None),
}


def _traced(model, example, loss_fn, memo: bool, monkeypatch, **kwargs):
    """`trace`, with propagation's memo on or off; also how many module calls ran."""
    calls = []
    run = props._Prop._run_fresh

    def counted(self, n, args, kw):
        calls.append(n.target)
        return run(self, n, args, kw)

    with monkeypatch.context() as mp:
        mp.setattr(props._Prop, "_run_fresh", counted)
        mp.setattr(sys.modules["rpcompile.passes.trace"], "propagate",
                   lambda *a, **k: props.propagate(*a, **{**k, "memo": memo}))
        graph = trace(model, example, loss_fn=loss_fn, **kwargs)
    return graph, calls


def _same(a, b) -> None:
    assert a == b  # values, layers' names and io, params, tied (the modules compare by code below)
    assert [lay.module.code for lay in a.layers] == [lay.module.code for lay in b.layers]


@pytest.mark.parametrize("name", list(CASES))
def test_memoized_propagation_traces_the_same_graph(name, monkeypatch):
    build, batch, loss_fn = CASES[name]
    model = build()
    fresh, all_calls = _traced(model, batch(), loss_fn, False, monkeypatch)
    memo, calls = _traced(model, batch(), loss_fn, True, monkeypatch)
    _same(memo, fresh)
    if name != "nanogpt":  # its blocks are called as one Sequential unit each: a repeat is skipped only there
        assert len(calls) < len(all_calls)


@pytest.mark.parametrize("preset", ["qwen3-1.7b", "gpt-oss-20b"])  # gpt-oss: sliding and full attention alternate
@pytest.mark.parametrize("sub", [False, True])
def test_memoized_propagation_of_paper_presets_on_meta(preset, sub, monkeypatch):
    from rpcompile.models.presets import build_meta, example_batch
    net = build_meta(preset)
    net.model.layers = net.model.layers[:4]  # four blocks are enough to repeat, and quick
    net.config.num_hidden_layers = 4
    if hasattr(net.config, "layer_types"):
        net.config.layer_types = net.config.layer_types[:4]
    ex = example_batch(net.config.vocab_size, 1, 64)
    layers = sublayer_units(net) if sub else None
    fresh, all_calls = _traced(net, ex, None, False, monkeypatch, layers=layers)
    memo, calls = _traced(net, ex, None, True, monkeypatch, layers=layers)
    _same(memo, fresh)
    assert len(calls) < len(all_calls)


class Reshaping(torch.nn.Module):
    """Two equal blocks, the second on a reshaped input: the same signature, other input metadata."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x).unsqueeze(1).expand(-1, 3, -1))


def test_equal_units_on_inputs_of_other_shapes_run_again(monkeypatch):
    model, x = Reshaping(), torch.randn(2, 4)
    fresh, all_calls = _traced(model, x, lambda out, ex: out.sum(), False, monkeypatch)
    memo, calls = _traced(model, x, lambda out, ex: out.sum(), True, monkeypatch)
    _same(memo, fresh)
    assert calls == all_calls and memo.layers[-1].name == "blocks.1"


def test_a_unit_with_other_attributes_or_shapes_runs_again():
    """Signatures tell blocks apart by what changes their output: attributes (but not the block number),
    parameter shapes and dtypes, forward hooks."""
    class Block(torch.nn.Module):
        def __init__(self, width: int, layer_idx: int, scale: float = 1.0):
            super().__init__()
            self.proj, self.layer_idx, self.scale = torch.nn.Linear(width, width), layer_idx, scale

    sig = props.unit_signature
    assert sig(Block(4, 0)) == sig(Block(4, 7))
    assert sig(Block(4, 0)) != sig(Block(4, 0, scale=2.0))
    assert sig(Block(4, 0)) != sig(Block(8, 0))
    assert sig(Block(4, 0)) != sig(Block(4, 0).to(torch.bfloat16))
    frozen = Block(4, 0)
    frozen.proj.weight.requires_grad_(False)
    assert sig(Block(4, 0)) != sig(frozen)
    hooked = Block(4, 0)
    hooked.proj.register_forward_hook(lambda *a: None)
    assert sig(hooked) is None


def test_experts_patched_for_meta_keep_the_signature_of_their_peers():
    """`balanced_experts` binds its forward to every experts module: equal blocks still run once (an
    eager-experts MoE on meta ran its experts loop in every block), a forward of another function does not."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    from rpcompile.passes.meta.moe import _balanced_forward, balanced_experts
    cfg = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128, num_experts=4,
                         num_experts_per_tok=2, decoder_sparse_step=1)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(cfg)
    first, second = (layer.mlp for layer in net.model.layers)
    with balanced_experts(net) as patched:
        assert patched == 2 and first.experts.forward.__func__ is _balanced_forward
        assert props.unit_signature(first) == props.unit_signature(second)
        second.experts.forward = (lambda self, *a: None).__get__(second.experts)
        assert props.unit_signature(first) != props.unit_signature(second)


def test_residual_adds_between_sub_block_units_on_meta_run_once_per_distinct_metadata(monkeypatch):
    """Cut into sub-blocks, a decoder's residual adds are glue between units: on meta each distinct one
    (inputs' shapes, dtypes, requires_grad) runs once, and the traced graph is the one every add run gives."""
    import operator
    from rpcompile.models.presets import build_meta, example_batch
    net = build_meta("qwen3-1.7b")
    net.model.layers = net.model.layers[:4]
    net.config.num_hidden_layers = 4
    ex = example_batch(net.config.vocab_size, 1, 64)
    fresh, all_calls = _traced(net, ex, None, False, monkeypatch, layers=sublayer_units(net))
    memo, calls = _traced(net, ex, None, True, monkeypatch, layers=sublayer_units(net))
    _same(memo, fresh)
    assert all_calls.count(operator.add) == 9 and calls.count(operator.add) <= 3  # 8 residuals, 1 on positions
