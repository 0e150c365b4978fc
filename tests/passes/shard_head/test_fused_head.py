"""The fused LM head (`shard_lm_head(fused=True)`): gradients taken in the forward, chunk by chunk.

References are plain eager PyTorch: the traced graph before the rewrite (`graph.run`, i.e. the
model's own `cross_entropy`), and for the driver test `token_mean_loss` on the whole batch.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import models as M
import rpcompile
from rpcompile import Hardware
from rpcompile.passes import shard_lm_head, trace
from head_cases import B, T, ZOO, example as _example, loss_and_grads as _loss_and_grads, traced as _traced
from rpcompile.passes.cost import count_layers, estimate_costs, layer_times, split_microbatch
from rpcompile.passes.shard_head.fused import fused_ce, fused_loss
from tests.oracle import token_mean_loss

pytest.importorskip("transformers")

GEMMS = ("mm", "addmm", "bmm", "matmul")


@pytest.mark.parametrize("k,chunk", [(1, 64), (1, 7), (3, 5), (4, 64)])
@pytest.mark.parametrize("name", [*ZOO, "qwen3"])
def test_fused_loss_and_grads_match_eager(name: str, k: int, chunk: int) -> None:
    model, graph = _traced(name)
    example = _example(name)
    ref, ref_grads = _loss_and_grads(model, graph, example)
    fused = shard_lm_head(graph, shards=k, chunk=chunk, fused=True)
    loss, grads = _loss_and_grads(model, fused, example)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for pname, g in grads.items():
        torch.testing.assert_close(g, ref_grads[pname], atol=1e-5, rtol=0, msg=pname)
    head = graph.layers[-1]
    assert [lay.name for lay in fused.layers[-k - 1:]] == [f"{head.name}.shard{i}" for i in range(k)] + [
        f"{head.name}.loss"]
    shards = fused.layers[-k - 1:-1]
    assert all(lay.param_slices == () for lay in shards)  # token shards: each reads the whole weight
    calls = [n for lay in shards for n in lay.module.graph.nodes if n.target is fused_ce]
    assert [n.args[5] for n in calls] == [(i, k) for i in range(k)]


def _scaled_head_model(kind: str):
    """A tiny transformers LM whose head scales its logits before the loss: Granite divides them by
    `logits_scaling`, Cohere multiplies them by `logit_scale`."""
    import transformers
    extra = {"granite": dict(logits_scaling=4.0), "cohere": dict(logit_scale=0.25, bos_token_id=1, eos_token_id=2)}
    cls = {"granite": "Granite", "cohere": "Cohere"}[kind]
    cfg = getattr(transformers, f"{cls}Config")(**M._tiny(**extra[kind]), attn_implementation="eager")
    return M._build(f"{cls}ForCausalLM", cfg, 0)


@pytest.mark.parametrize("kind,step", [("granite", ("div", 4.0)), ("cohere", ("mul", 0.25))])
def test_a_head_that_scales_its_logits_gets_the_gradients_of_eager(kind: str, step: tuple) -> None:
    """The scale is part of d(loss)/d(logits): without it the loss is right and every gradient is off by it."""
    model = _scaled_head_model(kind)
    example = M.lm_batch(batch=B, seq=T)
    model.zero_grad(set_to_none=True)
    ref = model(**example).loss  # eager PyTorch: the model's own forward and loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    fused = shard_lm_head(trace(model, example), shards=2, chunk=7, fused=True)
    calls = [n for lay in fused.layers for n in lay.module.graph.nodes if n.target is fused_ce]
    assert calls and all(step in n.args[7] for n in calls)  # the scale is in the fused head's chain
    loss, grads = _loss_and_grads(model, fused, example)
    torch.testing.assert_close(loss, ref.detach(), atol=1e-5, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for pname, g in grads.items():
        torch.testing.assert_close(g, ref_grads[pname], atol=1e-5, rtol=1e-4, msg=pname)


class _Ops(TorchDispatchMode):
    """Names of the aten ops that run."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def _head_inputs(graph, layer, example):
    env = dict(graph.flatten_inputs(example))
    with torch.no_grad():
        for lay in graph.layers[:layer.index]:
            env.update(zip(lay.outputs, lay.module(*(env[n] for n in lay.inputs))))
    return [env[n].detach().requires_grad_(graph.values[n].requires_grad and env[n].is_floating_point())
            for n in layer.inputs]


def test_backward_recomputes_nothing_and_a_forward_without_autograd_runs_one_gemm_per_chunk() -> None:
    _, graph = _traced("llama")
    fused = shard_lm_head(graph, shards=1, chunk=16, fused=True)  # 64 tokens: 4 chunks
    shard = fused.layers[-2]
    args = _head_inputs(fused, shard, _example("llama"))
    with _Ops() as fwd:
        outs = shard.module(*args)
    with _Ops() as bwd:
        torch.autograd.backward([o for o in outs if o.requires_grad], [torch.ones_like(o) for o in outs
                                                                       if o.requires_grad])
    assert sum(n in GEMMS for n in fwd.names) == 3 * 4  # logits, dX, dW per chunk
    assert not any(n in GEMMS for n in bwd.names)  # the backward only scales what the forward kept
    with torch.no_grad(), _Ops() as nograd:
        shard.module(*args)
    assert sum(n in GEMMS for n in nograd.names) == 4  # an F stage: the logits only


def test_cost_counts_the_gradient_work_with_the_backward_and_prices_the_fused_kernel_on_cuda() -> None:
    _, graph = _traced("llama")
    example = _example("llama")
    fused = shard_lm_head(graph, shards=1, chunk=16, fused=True)
    count = count_layers(fused, split_microbatch(fused, example, 1), progress=False)[-2]
    gemm = lambda ops: sum(o.launches for o in ops if o.name in GEMMS)  # noqa: E731
    assert gemm(count.fwd_ops) == 4 and gemm(count.bwd_ops) == 8  # forward: logits; backward: dX, dW
    fused_ops = [o for o in count.fwd_ops if o.form == "fused"]
    eager = [o for o in count.fwd_ops if o.form == "eager"]
    assert len(fused_ops) == 1 and fused_ops[0].launches == 4 and len(eager) > 3
    vocab, tokens = graph.params["lm_head.weight"].shape[0], B * T
    # one read of the fp32 logits and the targets, one write of d(logits) and of the four NLL sums
    assert fused_ops[0].bytes == tokens * vocab * 4 * 2 + tokens * 8 + 4 * 4
    gpu, cpu = Hardware.preset("rtx4090"), Hardware.preset("cpu")
    assert layer_times(count.fwd_ops, cpu) > layer_times([o for o in count.fwd_ops if o.form != "fused"], gpu)
    assert layer_times(count.fwd_ops, gpu) == pytest.approx(
        layer_times([o for o in count.fwd_ops if o.form != "eager"], gpu))


def test_reduction_none_cannot_be_fused() -> None:
    x, t = torch.randn(4, 3), torch.tensor([0, 1, 2, 3])

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = torch.nn.Linear(3, 5, bias=False)

        def forward(self, x, t):
            return torch.nn.functional.cross_entropy(self.lm(x), t, reduction="none").sum()

    g = trace(Head(), (x, t), layers=["lm"])
    with pytest.raises(ValueError, match="reduction 'none'"):
        shard_lm_head(g, shards=1, fused=True)
    assert shard_lm_head(g, shards=2) is not g  # vocabulary shards take it
    assert fused_loss(torch.tensor(6.0), t, -100, "mean", torch.float32) == 1.5


@pytest.mark.parametrize("shards", [1, 3])
def test_compiled_fused_head_trains_as_eager_with_token_weighted_loss(shards: int) -> None:
    model = M.llama()
    batch = _example("llama")
    ref = copy.deepcopy(model)  # before training writes the weights back
    value = token_mean_loss(ref, batch)
    value.backward()
    c = rpcompile.compile(model, gpus=2, example=batch, microbatches=2, staleness=0, optimizer=rpcompile.SGD(lr=1.0),
                          dtype=torch.float32, backend="host", loss_mean="tokens", fused_head=True,
                          lm_head_shards=shards)
    try:
        assert any(n.target is fused_ce for lay in c.graph.layers for n in lay.module.graph.nodes)
        loss = c.step(batch)
        got = {n: p.detach().clone() for n, p in c.model().named_parameters()}
    finally:
        c.close()
    assert abs(loss - value.item()) < 1e-5
    with torch.no_grad():
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n], p - p.grad, atol=1e-5, rtol=0, msg=n)


def test_measured_costs_split_the_fused_head_as_predicted_ones_do():
    """Measure mode counts the forward an F stage runs (logits) as the forward, the gradient GEMMs with the backward."""
    _, graph = _traced("llama")
    example = _example("llama")
    fused = shard_lm_head(graph, shards=1, chunk=16, fused=True)
    measured = estimate_costs(fused, example, mode="measure", device="cpu", repeats=1, warmup=0, progress=False)
    predicted = estimate_costs(fused, example, mode="predict", hardware=Hardware.preset("cpu"), progress=False)
    assert measured.fwd_flops == predicted.fwd_flops and measured.bwd_flops == predicted.bwd_flops
    assert measured.bwd_flops[-2] == 2 * measured.fwd_flops[-2] > 0  # dX and dW: two GEMMs to the logits' one


def test_the_head_chain_steps_apply_as_the_model_did() -> None:
    # the casts and scalings between the head's matmul and the loss (a cast to fp32, a logit scale), in order
    from rpcompile.passes.shard_head.fused import _chained
    z = torch.randn(3, 5, dtype=torch.bfloat16)
    steps = (("cast", torch.float32), ("mul", 0.5), ("rmul", 3.0), ("div", 4.0))
    got = _chained(z, steps)
    assert got.dtype == torch.float32 and torch.equal(got, 3.0 * (z.float() * 0.5) / 4.0)


def test_the_symbolic_fit_takes_whole_chunks_of_every_token_shard() -> None:
    # K token shards of `chunk` tokens each: the fitting lengths are multiples of K x chunk
    from rpcompile.passes.cost.symbolic import chunk_unit
    _, graph = _traced("qwen3")
    assert chunk_unit(shard_lm_head(graph, shards=3, chunk=5, fused=True)) == 15
    assert chunk_unit(shard_lm_head(graph, shards=1, chunk=7, fused=True)) == 7
