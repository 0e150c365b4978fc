"""A layer of balanced MoE experts is counted from its first 3 to 5 experts (`passes.cost.experts`): the
counts equal those of running every expert, frozen or trainable; sequences that do not follow the model
are counted in full."""
from __future__ import annotations

import pytest
import torch

from rpcompile.passes import trace
from rpcompile.passes.cost import count
from rpcompile.passes.cost.count import count_layers
from rpcompile.passes.cost.experts import RUNS, series_at
from rpcompile.passes.cost.recorder import OpCount
from rpcompile.passes.cost.symbolic import resize_inputs
from rpcompile.passes.trace import sublayer_units

transformers = pytest.importorskip("transformers")


def _moe_graph(experts: int, frozen: bool):
    """A tiny Qwen3-MoE on meta (eager experts loop under `balanced_experts`), traced into sub-blocks."""
    from rpcompile.models.presets import example_batch
    cfg = transformers.Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=8, vocab_size=128, num_experts=experts, num_experts_per_tok=2,
                                      decoder_sparse_step=1)
    with torch.device("meta"):
        net = transformers.AutoModelForCausalLM.from_config(cfg)
    if frozen:
        for p in net.parameters():
            p.requires_grad_(p.dim() == 1)
    batch = example_batch(128, 1, 16)
    return trace(net, batch, layers=sublayer_units(net)), batch


@pytest.mark.parametrize("frozen", [True, False])
def test_experts_counted_from_a_few_equal_every_expert_counted(frozen, monkeypatch):
    graph, batch = _moe_graph(12, frozen)
    taken = []
    extrapolate = count.extrapolate

    def spy(run, n):
        got = extrapolate(run, n)
        taken.append((n, got is not None))
        return got
    for b, s in ((2, 24), (3, 40)):  # other token counts per expert: 8 and 20 of 48 and 120 tokens x 2
        inputs = resize_inputs(graph, graph.flatten_inputs(batch), b, s)
        monkeypatch.setattr(count, "extrapolate", spy)
        few = count_layers(graph, inputs, progress=False)
        monkeypatch.setattr(count, "extrapolate", lambda run, n: None)
        full = count_layers(graph, inputs, progress=False)
        assert few == full
    assert taken and taken == [(12, True)] * len(taken)
    moe = [c for layer, c in zip(graph.layers, full) if layer.name.endswith(".mlp")]
    assert moe and all(len(c.bwd_ops) > 12 * 10 for c in moe)  # every expert's backward is in the count


def _model_counts(k: int) -> list:
    """A count of the module Note's form: head affine in k, blocks of experts k - 1 ... 2 before the tail's."""
    head = [OpCount("mm", 10 * k, 4 * k, "float32", k), 100 + 7 * k]
    blocks = []
    for j in range(k - 1, 1, -1):
        blocks += [OpCount("mul", 3, 5 + j, "float32"), 50 + 2 * j, OpCount("sum", 2, 2, "float32")]
    return head + blocks + [OpCount("add", 1, 1, "float32"), 9]


def test_a_count_of_the_model_form_is_extrapolated_exactly():
    seqs = {r: _model_counts(r) for r in RUNS}
    assert series_at(seqs, 40) == _model_counts(40)
    assert series_at(seqs, RUNS[-1] + 1) == _model_counts(RUNS[-1] + 1)


@pytest.mark.parametrize("broken", ["quadratic head", "op renamed", "value off at 5", "length off at 5",
                                    "block not affine in the expert", "head off at 5", "block of expert 2 off at 4",
                                    "op of a block off at 5"])
def test_counts_that_leave_the_model_are_not_extrapolated(broken):
    seqs = {r: _model_counts(r) for r in RUNS}
    if broken == "quadratic head":  # 3, 4 fix a line that 5 misses
        seqs = {r: [r * r] for r in RUNS}
    elif broken == "op renamed":  # the head's op is another one with more experts
        seqs[3][0] = OpCount("bmm", 30, 12, "float32", 3)
    elif broken == "value off at 5":
        seqs[5][-1] += 1
    elif broken == "block not affine in the expert":  # the first block of 5 experts is expert 4's
        seqs[5][3] += 1
    elif broken == "head off at 5":
        seqs[5][1] += 1
    elif broken == "block of expert 2 off at 4":  # 4 experts: head, block 3, block 2, tail
        seqs[4][6] += 1
    elif broken == "op of a block off at 5":  # the same op in every block but expert 4's
        seqs[5][4] = OpCount("sum", 2, 3, "float32")
    else:
        seqs[5] = seqs[5][:-1]
    assert series_at(seqs, 40) is None
