"""MoE routing replay: a B stage's recompute routes tokens to the experts its forward chose.

Qwen3-MoE (tiny, 4 experts, top-2) whose routers score every expert the same (tied rows), so the
forward's top-2 is decided by a tie. In the recompute a hook raises the router's scores of experts 0
and 1 by one ulp: recomputing the routing would pick other experts. The runtime replays the forward's.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import models
from rpcompile import SGD, StagePlan
from rpcompile.passes import emit, trace
from rpcompile.passes.meta.moe import routers
from rpcompile.runtime.executor import Runtime
from rpcompile.runtime.host.optimizer import HostState

pytest.importorskip("transformers")

PLAN = "2,2|1|2,2"  # embed+layer0 | layer1+norm forward; head fused; both MoE layers recomputed in B stages


class OneUlp(TorchFunctionMode):
    """Raises the router's softmax scores of experts 0 and 1 by one ulp (the tie picks 2 and 3)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.softmax:
            out = out.clone()
            out[..., :2] = torch.nextafter(out[..., :2], torch.tensor(float("inf")))
        return out


def _tied_model():
    model = models.qwen3_moe()
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.gate.weight
            w.copy_(w[0].expand_as(w))  # every expert scores the same: the top-2 is a tie
    return model


def _nudge_in_recompute(router: torch.nn.Module) -> None:
    """One ulp on the router's scores whenever it runs with autograd (the recompute; F stages run without)."""
    mode = OneUlp()

    def enter(module, args) -> None:
        if torch.is_grad_enabled():
            mode.__enter__()

    def leave(module, args, out) -> None:
        if torch.is_grad_enabled():
            mode.__exit__(None, None, None)
    router.register_forward_pre_hook(enter)
    router.register_forward_hook(leave)


def _experts_seen(module: torch.nn.Module, log: list) -> None:
    for m in module.modules():
        if type(m).__name__.endswith("Experts"):
            m.register_forward_pre_hook(lambda mod, a: log.append((torch.is_grad_enabled(), a[1].clone())))


def test_the_nudge_changes_the_routing_of_a_plain_forward():
    model = _tied_model()
    batch = models.lm_batch(batch=4, seq=16)
    picked = {}
    for nudged in (False, True):
        log = []
        probe = copy.deepcopy(model)
        _experts_seen(probe, log)
        if nudged:
            _nudge_in_recompute(routers(probe)[0])
        with torch.enable_grad():
            probe(**batch)
        picked[nudged] = log[0][1]
    assert not torch.equal(picked[False], picked[True])  # a one-ulp change moves tokens to other experts


def test_recompute_replays_the_forward_routing_and_gradients_equal_eager():
    model = _tied_model()
    batch = models.lm_batch(batch=4, seq=16)
    ref = copy.deepcopy(model)
    loss = sum(ref(**{k: v[i:i + 1] for k, v in batch.items()}).loss for i in range(4)) / 4
    loss.backward()
    graph = trace(model, batch)
    state = HostState.from_graph(graph, optimizer=SGD(lr=1.0))
    prog = emit(StagePlan.from_str(PLAN), gpus=2, microbatches=4, staleness=0)
    seen: list = []
    with Runtime(graph, prog, state, backend="host", timeout=30) as rt:
        for runner in rt.runners:
            assert runner.routed == {1, 2}
            for i in runner.routed:
                for r in routers(runner.modules[i]):
                    _nudge_in_recompute(r)
                _experts_seen(runner.modules[i], seen)
        got = rt.step(batch)
        rt.flush()
    forward = [idx for grad, idx in seen if not grad]
    recompute = [idx for grad, idx in seen if grad]
    assert len(forward) == len(recompute) == 2 * 4  # two MoE layers, four microbatches
    assert sorted(map(tuple, (f.flatten().tolist() for f in forward))) == \
        sorted(map(tuple, (r.flatten().tolist() for r in recompute)))
    assert abs(got - loss.item()) < 1e-5
    new = state.parameters_fp32()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            torch.testing.assert_close(new[name], p - p.grad, atol=1e-5, rtol=0, msg=name)


def test_a_failed_iteration_leaves_no_routing_behind_and_the_next_step_trains():
    """A recompute fails after the forwards recorded their routing: recovery drops the abandoned
    iteration's records (no recompute will take them), and the retried step routes afresh."""
    model = _tied_model()
    batch = models.lm_batch(batch=4, seq=16)
    graph = trace(model, batch)
    state = HostState.from_graph(graph, optimizer=SGD(lr=0.1))
    prog = emit(StagePlan.from_str(PLAN), gpus=2, microbatches=4, staleness=0)
    armed = {"on": True}
    with Runtime(graph, prog, state, backend="host", timeout=30) as rt:
        for runner in rt.runners:
            real = runner.forward

            def failing(*args, _real=real, **kw):
                if kw.get("routing") == "replay" and armed["on"]:
                    raise RuntimeError("injected recompute fault")
                return _real(*args, **kw)
            runner.forward = failing
        with pytest.raises(Exception, match="injected recompute fault"):
            rt.step(batch)
            rt.flush()
        assert not rt.routes._log, sorted(rt.routes._log)  # nothing of the abandoned iteration is kept
        armed["on"] = False
        assert torch.isfinite(torch.tensor(rt.step(batch)))
        rt.flush()
        assert not rt.routes._log  # every record the retried step made was taken by its recompute
