"""Long sequences (issue 13), measured on CPU: predicted vs measured peaks, compile at the predicted limit,
the refusal past it, and what max_seq_len counts on the host."""
from __future__ import annotations

import math
import os
import sys
import threading

import pytest
import torch


import models as M  # noqa: E402
import rpcompile  # noqa: E402
from rpcompile import CostTable, Hardware, StagePlan, max_seq_len  # noqa: E402
from rpcompile.passes import estimate_costs, trace  # noqa: E402
from rpcompile.passes.cost.stage_memory import memory_refusal
from rpcompile.passes.cost.host_bytes import host_bytes, round_saved_bytes  # noqa: E402
from rpcompile.passes.cost.seqlen import seq_len_costs  # noqa: E402

pytest.importorskip("transformers")

VOCAB = 512


def _llama(hidden: int, ffn: int, layers: int = 2):
    """A small SDPA Llama (4 heads, 2 KV heads)."""
    return M.llama(attn="sdpa", hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, vocab_size=VOCAB)


def test_predicted_peak_memory_is_within_15_percent_of_measured_and_linear_in_s() -> None:
    model, decoder = _llama(256, 688, layers=1), []
    for seq in (1024, 4096):
        batch = M.lm_batch(batch=1, seq=seq, vocab=VOCAB)
        graph = trace(model, batch)
        measured = estimate_costs(graph, batch, mode="measure", device="cpu", warmup=0, repeats=1, progress=False)
        predicted = estimate_costs(graph, batch, mode="predict", hardware=Hardware.preset("rtx4090"),
                                   progress=False)
        for layer, m, p in zip(graph.layers, measured.peak_bytes, predicted.peak_bytes):
            assert m > 0 and abs(p - m) <= 0.15 * m, (seq, layer.name, m, p)
        decoder.append(predicted.peak_bytes[1])
    assert decoder[1] / decoder[0] == pytest.approx(4, rel=0.02)  # SDPA: no (heads, S, S) tensor anywhere


def _limit(model, budget: int, layers=None):
    """max_seq_len of `model` on 2 host workers, one sequence per microbatch, 2 microbatches."""
    graph = trace(model, M.lm_batch(batch=1, seq=128, vocab=VOCAB), layers=layers)
    return max_seq_len(graph, Hardware.preset("cpu"), gpus=2, microbatches=2, memory_budget=budget)


def test_compile_at_the_predicted_limit_fits_and_past_it_is_refused_naming_the_layer() -> None:
    from rpcompile.passes.trace import sublayer_units
    torch.manual_seed(0)
    model, budget = _llama(128, 344), 5 * 2 ** 20
    blocks = _limit(model, budget)
    lim = _limit(model, budget, layers=sublayer_units(model))  # compile cuts blocks that do not fit
    assert lim.binding.startswith("device: backward stage of layer") and lim.capacity == budget
    assert lim.length > blocks.length  # longer than whole decoder blocks allow
    batch = M.lm_batch(batch=2, seq=lim.length, vocab=VOCAB)
    with rpcompile.compile(model, gpus=2, example=batch, microbatches=2, staleness=0, memory_budget=budget,
                           optimizer=rpcompile.SGD(lr=1e-3), backend="host") as c:
        loss = c.step(batch)
        peaks = c._runtime.peak_memory()
    assert math.isfinite(loss) and 0 < max(peaks) <= budget, (peaks, budget)
    longer = M.lm_batch(batch=2, seq=int(1.25 * lim.length), vocab=VOCAB)
    threads = threading.active_count()
    with pytest.raises(ValueError, match="memory budget") as refused:
        rpcompile.compile(model, gpus=2, example=longer, microbatches=2, staleness=0, memory_budget=budget,
                          backend="host")
    assert threading.active_count() == threads  # refused before any worker started
    msg = str(refused.value)  # compile names the layer, the term and the bytes too
    assert "'model.layers." in msg and "workspace (saved tensors + backward transients)" in msg and "bytes)" in msg
    graph = trace(model, longer)  # the pass-level refusal names the layer, every term and the bytes
    with pytest.raises(ValueError) as info:
        estimate_costs(graph, longer, mode="measure", microbatches=2, warmup=0, repeats=1, progress=False,
                       memory_budget=budget)
    msg = str(info.value)
    assert "'model.layers." in msg and "workspace (saved tensors + backward transients)" in msg
    assert f"> the memory budget {budget / 2**20:.1f} MiB" in msg and "bytes)" in msg


def test_memory_refusal_names_the_stage_that_binds_and_sums_its_terms() -> None:
    costs = CostTable.from_lists([1.0] * 3, [1.0] * 3, param_bytes=[4, 4, 4], grad_bytes=[4, 4, 4],
                                 peak_bytes=[1, 100, 1], saved_bytes=[2, 2, 2], act_bytes=[2, 2, 2],
                                 names=["a", "b", "c"])
    one = StagePlan.from_sizes([1, 1], 1, [1, 1])
    need = max(one.stage_memory(costs))
    assert memory_refusal(costs, need) is None
    msg = memory_refusal(costs, need - 1)
    assert msg.startswith(f"backward stage of layer 1 'b' needs {need} B ({need} bytes)")
    assert "workspace (saved tensors + backward transients) 100 B" in msg


def test_host_state_counts_frozen_parameters_at_their_own_dtype_only() -> None:
    lora = M.llama(attn="sdpa")
    for p in lora.parameters():
        p.requires_grad_(p.dim() == 1)
    lora.model.embed_tokens.to(torch.bfloat16)  # a frozen bf16 part: its compute copy only, 2 bytes each
    graph = trace(lora, M.lm_batch(batch=2, seq=16))
    sc = estimate_costs(graph, M.lm_batch(batch=2, seq=16), mode="predict", hardware=Hardware.preset("cpu"),
                        symbolic=True)
    state = dict(sc.host_state)
    emb = lora.model.embed_tokens.weight.numel()
    frozen = sum(p.numel() for p in lora.parameters() if not p.requires_grad) - emb
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert state["compute copies"] == 2 * emb + 4 * (frozen + trainable)
    assert state["fp32 masters"] == state["fp32 gradients"] == 4 * trainable
    assert state["optimizer state"] == 8 * trainable  # AdamW: two fp32 moments, trainable parameters only
    tight = max_seq_len(sc, Hardware.preset("cpu"), gpus=2, host_memory=sum(state.values()) - 1)
    assert tight.length == 0 and tight.binding == "host: compute copies"  # the state alone does not fit


def _small_workers() -> Hardware:
    """The cpu preset with 16 MiB workers: the tiny Llama's whole model no longer fits one fused stage (which
    leaves no saved inputs on the host) at the lengths where the host binds, so the state's bytes decide."""
    return Hardware.preset("cpu").replace(device_memory=16 * 2**20)


def test_the_longest_sequence_counts_the_parameter_state_of_the_runs_optimizer() -> None:
    """bf16 AdamW moments (`state_dtype`) take 4 of the 8 bytes per trainable parameter: the host state
    max_seq_len counts is what `host_bytes` counts for that optimizer, so with the host binding a longer
    sequence fits than with fp32 moments; optimizer= with an already fitted SymbolicCosts is refused."""
    model = M.llama(attn="sdpa")
    graph = trace(model, M.lm_batch(batch=2, seq=16))
    hw = _small_workers()
    lean = rpcompile.AdamW(state_dtype=torch.bfloat16)
    state = dict(seq_len_costs(graph, hw, optimizer=lean).host_state)
    trainable = sum(p.numel() for p in model.parameters())
    assert state["optimizer state"] == 4 * trainable
    leaner = dict(seq_len_costs(graph, hw, optimizer=rpcompile.AdamW(master_dtype=torch.bfloat16,
                                                                     grad_dtype=torch.bfloat16)).host_state)
    assert leaner["bf16 masters"] == leaner["bf16 gradients"] == 2 * trainable  # named and counted as they are
    assert sum(state.values()) == host_bytes(graph, microbatches=1, optimizer=lean).total
    full = dict(seq_len_costs(graph, hw).host_state)
    cap = sum(full.values()) + 2**20  # the fp32 state and one MiB: the host binds
    long, short = (max_seq_len(graph, hw, gpus=2, host_memory=cap, optimizer=o) for o in (lean, None))
    assert long.length > short.length > 0 and short.binding.startswith("host")
    with pytest.raises(ValueError, match="optimizer= is for a LayerGraph"):
        max_seq_len(seq_len_costs(graph, hw), hw, gpus=2, optimizer=lean)


def test_the_longest_sequence_counts_one_servers_share_of_state_sharded_over_servers() -> None:
    """With the masters and moments sharded over W servers (shard=(rank, W)) the host state max_seq_len counts
    is that server's, as `host_bytes(shard=)` counts it, so with the host binding a longer sequence fits;
    shard= with an already fitted SymbolicCosts is refused."""
    model = M.llama(attn="sdpa")
    graph = trace(model, M.lm_batch(batch=2, seq=16))
    hw = _small_workers()
    state = dict(seq_len_costs(graph, hw, shard=(0, 2)).host_state)
    assert sum(state.values()) == host_bytes(graph, microbatches=1, shard=(0, 2)).total
    whole = host_bytes(graph, microbatches=1)
    assert state["fp32 masters (1 of 2 shares)"] < whole.masters and state["fp32 gradients"] == whole.grads
    cap = whole.total + 2**20  # the whole state and one MiB: the host binds
    long, short = (max_seq_len(graph, hw, gpus=2, host_memory=cap, shard=s) for s in ((0, 2), None))
    assert long.length > short.length > 0 and short.binding.startswith("host")
    with pytest.raises(ValueError, match="shard= is for a LayerGraph"):
        max_seq_len(seq_len_costs(graph, hw), hw, gpus=2, shard=(0, 2))


def test_saved_inputs_on_the_host_are_a_round_plus_the_last_rounds_tail() -> None:
    plan = StagePlan.from_str("1,1,1|1|1,1,1")  # backward stages hold layers 2, 1, 0 in execution order
    saved = [1, 10, 100, 0]
    assert round_saved_bytes(saved, plan, gpus=1, microbatches=4) == (111, 1)
    assert round_saved_bytes(saved, plan, gpus=2, microbatches=4) == (2 * (111 + 1), 2)  # layer 0's tail
    assert round_saved_bytes(saved, plan, gpus=4, microbatches=8) == (4 * (111 + 111), 4)
