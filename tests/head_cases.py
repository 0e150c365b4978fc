"""The LM-head test cases shared by tests/passes/shard_head: small causal LMs, their traces, batches with
ignored labels, and the loss and gradients of a graph.

    >>> model, graph = traced("llama")                         # doctest: +SKIP
    >>> loss, grads = loss_and_grads(model, graph, example("llama"))  # doctest: +SKIP
"""
from __future__ import annotations

import functools

import models as M
from rpcompile.passes import trace

B, T = 4, 16  # 64 tokens: the shard weight gradient is no bigger than the shard logits
ZOO = {  # name -> (build, batch, loss_fn, ignore_index): untied (llama) and tied (gpt2, nanoGPT) heads
    "llama": (M.llama, lambda: M.lm_batch(batch=B, seq=T), None, -100),
    "gpt2": (M.gpt2, lambda: M.lm_batch(batch=B, seq=T), None, -100),
    "nanogpt": (M.nanogpt, lambda: M.token_batch(batch=B, seq=T), M.gpt_loss, -1),  # nanoGPT ignores -1
}
MORE = {"qwen3": (M.qwen3, lambda: M.lm_batch(batch=B, seq=T), None, -100)}  # untied, q/k norms


@functools.lru_cache(maxsize=None)
def traced(name: str):
    """(model, its LayerGraph) of a case, built once per process."""
    build, batch, loss_fn, _ = {**ZOO, **MORE}[name]
    model = build()
    return model, trace(model, batch(), loss_fn=loss_fn)


def example(name: str, ignored: bool = True):
    """The case's batch, optionally with ignored labels (a run of the first sequence and every 4th of the third)."""
    case = {**ZOO, **MORE}[name]
    ex = case[1]()
    if ignored:
        labels = ex["labels"] if isinstance(ex, dict) else ex[1]
        labels[0, :5] = case[3]
        labels[2, 3::4] = case[3]
    return ex


def loss_and_grads(model, graph, ex):
    """(loss, parameter name -> gradient) of `graph.run(ex)`, from fresh gradients."""
    model.zero_grad(set_to_none=True)
    loss = graph.run(ex)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
