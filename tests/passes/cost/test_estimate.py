"""estimate_costs (measure / predict), symbolic costs and max_seq_len."""
import time
import warnings

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import models as M  # noqa: E402
from rpcompile import CostTable, Hardware, StagePlan, max_seq_len
from rpcompile.passes import estimate_costs, shard_lm_head, trace
from rpcompile.passes.cost import count_layers, layer_times, split_microbatch
from rpcompile.passes.cost.seqlen import seq_len_costs
from rpcompile.passes.cost.symbolic import B, S, SymbolicCosts, symbolic_costs

MEMORY = ("param_bytes", "grad_bytes", "act_bytes", "saved_bytes", "peak_bytes")


def _mlp():
    model = M.sequential(width=16, depth=3)
    batch = M.regression_batch(batch=8, width=16)
    return trace(model, batch, loss_fn=M.mse_loss), batch


def test_predict_counts_flops_like_flop_counter_mode_and_backward_is_twice():
    g, batch = _mlp()
    t = estimate_costs(g, batch, mode="predict", hardware=Hardware.preset("cpu"), microbatches=2, progress=False)
    x = batch[0][:4]
    with FlopCounterMode(display=False) as fc:
        g.layers[0].module(x)
    assert t.fwd_flops[0] == fc.get_total_flops() == 2 * 4 * 16 * 16
    assert t.bwd_flops[0] == t.fwd_flops[0]  # a model input needs no gradient: grad weight only
    i = next(i for i, layer in enumerate(g.layers) if i > 0 and layer.params)
    assert t.bwd_flops[i] == 2 * t.fwd_flops[i] > 0  # grad input + grad weight
    assert t.param_bytes[0] == (16 * 16 + 16) * 4 and t.grad_bytes == t.param_bytes
    assert t.saved_bytes[0] == 4 * 16 * 4 and all(x > 0 for x in t.fwd + t.bwd)


def test_measure_matches_predict_memory_and_times_are_positive():
    g, batch = _mlp()
    meas = estimate_costs(g, batch, mode="measure", device="cpu", repeats=2, progress=False)
    pred = estimate_costs(g, batch, mode="predict", hardware=Hardware.preset("cpu"), progress=False)
    assert isinstance(meas, CostTable) and meas.names == pred.names
    assert all(x > 0 for x in meas.fwd + meas.bwd)
    for f in MEMORY + ("fwd_flops", "bwd_flops"):
        assert getattr(meas, f) == getattr(pred, f), f


def test_bad_input_is_reported():
    g, batch = _mlp()
    with pytest.raises(ValueError, match="not divisible into 3 microbatches"):
        split_microbatch(g, batch, 3)
    with pytest.raises(ValueError, match="needs hardware"):
        estimate_costs(g, batch, mode="predict")
    with pytest.raises(ValueError, match="mode"):
        estimate_costs(g, batch, mode="guess")


class _DataDependent(nn.Module):
    """A layer whose forward needs real values (.item()): it cannot run on meta or fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * (int((x > 0).sum().item()) % 3 + 1)


def test_layer_that_cannot_run_on_meta_falls_back_with_a_warning_or_raises_if_big():
    model = nn.Sequential(nn.Linear(8, 8), _DataDependent(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    g = trace(model, (x,), loss_fn=lambda out, ex: out.sum())
    with pytest.warns(UserWarning, match=r"layer 1 \(1\) cannot run on the meta device"):
        t = estimate_costs(g, (x,), mode="predict", hardware=Hardware.preset("cpu"), progress=False)
    assert t.fwd_flops[1] == 2 * 4 * 8 * 8
    with warnings.catch_warnings(), pytest.raises(ValueError, match=r"layer 1 \(1\).*fallback_param_bytes"):
        warnings.simplefilter("ignore")
        count_layers(g, g.flatten_inputs((x,)), fallback_param_bytes=16, progress=False)


def test_llama_predict_on_meta_equals_predict_on_real_weights():
    pytest.importorskip("transformers")
    batch = M.lm_batch(batch=2, seq=16)
    real = M.llama()
    with torch.device("meta"):
        meta = M.llama()
    hw = Hardware.preset("rtx4090")
    a = estimate_costs(trace(real, batch), batch, mode="predict", hardware=hw, progress=False)
    b = estimate_costs(trace(meta, batch), batch, mode="predict", hardware=hw, progress=False)
    assert a == b and sum(a.fwd_flops) > 0


def test_symbolic_costs_at_an_unseen_shape_equal_the_predicted_costs():
    pytest.importorskip("transformers")
    g = trace(M.llama(), M.lm_batch(batch=2, seq=16))
    hw = Hardware.preset("rtx4090")
    sc = estimate_costs(g, M.lm_batch(batch=2, seq=16), mode="predict", hardware=hw, symbolic=True, progress=False)
    assert isinstance(sc, SymbolicCosts) and sc.fwd_flops[1].free_symbols <= {B, S}
    assert sc.fwd_flops[1].as_poly(B, S).degree(S) == 2 and sc.fwd_flops[1].as_poly(B, S).degree(B) == 1
    for b, s in ((3, 40), (5, 7)):  # not fitting points (B in {2, 3} x S in {8, 12, 16}, check (4, 10))
        batch = M.lm_batch(batch=b, seq=s)
        pred = estimate_costs(g, batch, mode="predict", hardware=hw, progress=False)
        at = sc.at(b, s)
        assert at.fwd_flops == pred.fwd_flops and at.bwd_flops == pred.bwd_flops
        for f in MEMORY:
            assert getattr(at, f) == getattr(pred, f), f
        for x, y in zip(at.fwd + at.bwd, pred.fwd + pred.bwd):
            assert x == pytest.approx(y, rel=1e-9)
    assert "B*S**2" in str(sc)


def test_symbolic_costs_at_one_microbatch_size_are_exact_there_b_1_included():
    # max_seq_len fits at the run's B alone (4 counts instead of 7): at B = 1, where size-1 copies vanish and
    # the fit in B and S (from B = 2, 3) is not the count, the expressions in S equal predict mode
    pytest.importorskip("transformers")
    g = trace(M.llama(), M.lm_batch(batch=2, seq=16))
    hw = Hardware.preset("rtx4090")
    for b in (1, 2):
        sc = symbolic_costs(g, g.flatten_inputs(M.lm_batch(batch=b, seq=16)), hw, batch=b)
        assert sc.batch == b and all(B not in e.free_symbols for e in sc.fwd_flops + sc.peak_bytes)
        for s in (5, 40):  # not fitting points (S in {8, 12, 16}, check 10)
            pred = estimate_costs(g, M.lm_batch(batch=b, seq=s), mode="predict", hardware=hw, progress=False)
            at = sc.at(b, s)
            assert at.fwd_flops == pred.fwd_flops and at.bwd_flops == pred.bwd_flops
            for f in MEMORY:
                assert getattr(at, f) == getattr(pred, f), (b, s, f)
            for x, y in zip(at.fwd + at.bwd, pred.fwd + pred.bwd):
                assert x == pytest.approx(y, rel=1e-9)
        with pytest.raises(ValueError, match=f"fitted at B = {b} only"):
            sc.at(b + 1, 16)
        with pytest.raises(ValueError, match=f"fitted at microbatch size {b} only"):
            max_seq_len(sc, hw, gpus=2, microbatch_size=b + 1)
    with pytest.raises(ValueError, match="batch must be a positive integer"):
        symbolic_costs(g, g.flatten_inputs(M.lm_batch(batch=2, seq=16)), hw, batch=0)
    with pytest.raises(ValueError, match="microbatch_size and gpus must be >= 1"):  # before any fit at B = 0
        max_seq_len(g, hw, gpus=2, microbatch_size=0)


def test_max_seq_len_of_a_graph_is_that_of_its_costs_fitted_in_b_and_s():
    # the graph's limit is fitted at its microbatch size alone: the same length and reason as the fit in B, S
    pytest.importorskip("transformers")
    g = trace(M.llama(attn="sdpa"), M.lm_batch(batch=2, seq=16))
    for device, host, binds in ((2, 1024, "device"), (64, 1, "host")):
        small = Hardware.preset("rtx4090", device_memory=device * 2 ** 20, host_memory=host * 2 ** 20, blas_workspace=0)
        both = seq_len_costs(g, small)
        for b in (1, 2, 3):
            one = max_seq_len(g, small, gpus=2, microbatch_size=b)
            assert str(one) == str(max_seq_len(both, small, gpus=2, microbatch_size=b)), (b, host)
            assert one.binding.startswith(binds) and one.length > 100, one


def test_max_seq_len_is_the_largest_length_whose_one_layer_stages_fit():
    pytest.importorskip("transformers")
    g = trace(M.llama(attn="sdpa"), M.lm_batch(batch=2, seq=16))
    small = Hardware.preset("rtx4090", device_memory=2 * 2 ** 20, blas_workspace=0)
    sc = estimate_costs(g, M.lm_batch(batch=2, seq=16), mode="predict", hardware=small, symbolic=True)
    lim = max_seq_len(sc, small, gpus=2)
    assert 16 < lim.length < 10 ** 5
    n, cap = len(sc.names), int(0.9 * small.device_memory)
    # as compile's stages, they fit the budget less the BLAS workspace every worker holds (`stage_budget`)
    blas = max_seq_len(sc, small.replace(blas_workspace=2 ** 17), gpus=2)
    assert blas.capacity == cap - 2 ** 17 and blas.length < lim.length, (blas, lim)
    one = StagePlan.from_sizes([1] * (n - 1), 1, [1] * (n - 1))  # the planner's windows at the limit

    def device_bytes(s):
        return max(one.stage_memory(sc.at(1, s)))
    assert device_bytes(lim.length) <= cap < device_bytes(lim.length + 1) == lim.bytes
    assert lim.capacity == cap and lim.binding.startswith("device: backward stage of layer")
    assert lim.terms[0][0].startswith("workspace") and sum(b for _, b in lim.terms) == lim.bytes
    assert f"{lim.length:,} tokens" in str(lim) and "workspace" in str(lim)
    for gpus in (1, 8):  # the host does not bind: the GPU count does not matter
        assert max_seq_len(sc, small, gpus=gpus).length == lim.length
    assert max_seq_len(sc, small.replace(device_memory=8 * 2 ** 20), gpus=2).length > lim.length
    assert max_seq_len(sc, small.replace(device_memory=1000), gpus=2).length == 0
    host = max_seq_len(sc, small, gpus=2, host_memory=6 * 2 ** 17)
    assert host.length < lim.length and host.binding.startswith("host: ") and host.bytes > host.capacity
    sharded = max_seq_len(g, small, gpus=2)  # a graph: its LM head is sharded and chunked first
    assert sharded.length >= lim.length and sharded.binding.startswith("device: ")
    # into the fewest shards no bigger than the largest other layer: one, the embedding being as large as the head
    # (and unchunked: a chunk would cover every token of the trace here, so the head stays as traced)
    fitted = seq_len_costs(g, small, batch=1)
    assert [n for n in fitted.names if n.startswith("lm_head")] == ["lm_head"], fitted.names
    # the lengths above `above` only: `above` itself when the next does not fit, a longer one else
    assert max_seq_len(sc, small, gpus=2, above=lim.length).length == lim.length
    assert max_seq_len(sc, small, gpus=2, above=lim.length // 2).length == lim.length
    for bad in (-1, 1 << 24):
        with pytest.raises(ValueError, match="above must be in"):
            max_seq_len(sc, small, gpus=2, above=bad)


def test_llama_8b_on_meta_flops_match_6nt_plus_attention_quickly():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                   attn_implementation="eager")
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 2048))
    batch = {"input_ids": ids, "labels": ids}
    t = estimate_costs(trace(model, batch), batch, mode="predict", hardware=Hardware.preset("rtx4090"),
                       progress=False)
    assert time.perf_counter() - t0 < 10
    n = sum(p.numel() for p in model.model.layers[0].parameters())
    tokens, s, h = 2048, 2048, 4096
    expected = 6 * n * tokens + 3 * 4 * s * s * h  # matmuls fwd+bwd; QK^T and PV: 2 * 2*S*S*h fwd, x3
    got = t.fwd_flops[1] + t.bwd_flops[1]
    assert abs(got / expected - 1) < 0.05
    assert t.param_bytes[1] == n * 4 and len(t) == 35 and 0 < t.fwd[1] < t.bwd[1]


def test_symbolic_max_keeps_distinct_arguments_and_returns_a_lone_one():
    """`symbolic._max`: sympy's Max without its proof search; one (or repeated) argument is itself."""
    from rpcompile.passes.cost.symbolic import B, S, _max
    p, q = 3 * B * S + 7, B * S ** 2
    assert _max(p) is p and _max(p, p) is p
    m = _max(p, q, p)
    assert m.args == (p, q) or set(m.args) == {p, q}
    assert m.subs({B: 1, S: 2}) == 13 and m.subs({B: 2, S: 10}) == 200


def test_a_counted_dict_shared_across_graphs_and_batches_gives_each_its_own_costs():
    pytest.importorskip("transformers")
    hw = Hardware.preset("rtx4090")
    batch, other = M.lm_batch(batch=2, seq=16), M.lm_batch(batch=2, seq=24)
    g = trace(M.llama(), batch)
    runs = ((g, batch), (shard_lm_head(g, shards=2), batch), (g, other))  # the same layers, then other shapes
    counted: dict = {}
    got = [estimate_costs(graph, b, mode="predict", hardware=hw, progress=False, counted=counted)
           for graph, b in runs]
    alone = [{} for _ in runs]
    fresh = [estimate_costs(graph, b, mode="predict", hardware=hw, progress=False, counted=d)
             for (graph, b), d in zip(runs, alone)]
    assert got == fresh and got[0] != got[2]
    assert 0 < len(counted) < sum(map(len, alone))  # the sharded graph's decoder layers were not run again


def test_the_layers_code_kept_between_counts_at_other_shapes_gives_the_same_counts():
    pytest.importorskip("transformers")
    batch, other = M.lm_batch(batch=2, seq=16), M.lm_batch(batch=3, seq=24)
    g = trace(M.llama(), batch)
    codes: dict = {}
    kept = [count_layers(g, g.flatten_inputs(b), progress=False, codes=codes) for b in (batch, other)]
    assert kept == [count_layers(g, g.flatten_inputs(b), progress=False) for b in (batch, other)]
    assert sorted(codes) == [layer.index for layer in g.layers]


def test_each_layers_predicted_time_is_its_own_ops_priced():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 4))
    batch = M.regression_batch(batch=8, width=16)
    g = trace(model, batch, loss_fn=M.mse_loss)
    hw = Hardware.preset("rtx4090")
    t = estimate_costs(g, batch, mode="predict", hardware=hw, progress=False)
    counts = count_layers(g, split_microbatch(g, batch, 1), progress=False)
    assert list(t.fwd) == [layer_times(c.fwd_ops, hw) for c in counts]
    assert list(t.bwd) == [layer_times(c.bwd_ops, hw) for c in counts] and len(set(t.fwd)) == len(counts) > 1
