"""Per-parameter weight decay (`AdamW(decay=...)`, `SGD(decay=...)`): eager torch with two param groups."""
from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

import rpcompile
from rpcompile.ir.optim import decay_names
from rpcompile.runtime.host.optimizer import HostState

SHAPES = {"w0": (4, 3), "b0": (4,), "w1": (5, 3), "norm": (3,)}


def state_and_eager(cfg, frozen=()):
    """A HostState over four parameters in two layers, and fp32 eager copies of them."""
    g = torch.Generator().manual_seed(1)
    params = {n: nn.Parameter(torch.randn(s, generator=g), requires_grad=n not in frozen) for n, s in SHAPES.items()}
    owners = {"w0": (0,), "b0": (0,), "w1": (1,), "norm": (1,)}
    state = HostState(params, owners, 2, optimizer=cfg, tied={"head.w": "w1"})
    return state, {n: nn.Parameter(p.detach().clone()) for n, p in params.items()}


def eager_two_groups(cfg, eager, decayed):
    """torch.optim.AdamW / SGD (foreach) with a weight-decay group and a weight_decay=0 group."""
    groups = [{"params": [p for n, p in eager.items() if n in decayed]},
              {"params": [p for n, p in eager.items() if n not in decayed], "weight_decay": 0.0}]
    if isinstance(cfg, rpcompile.AdamW):
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                 foreach=True)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, foreach=True)


def train(state, eager, opt, iterations=3):
    """Apply the same seeded gradients to both; returns nothing (they are compared by the caller)."""
    for t in range(iterations):
        for i, (n, p) in enumerate(eager.items()):
            grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * t + i))
            state.accumulate_grad(n, grad)
            p.grad = grad.clone()
        for l in (1, 0):
            state.step(l)
        opt.step()


@pytest.mark.parametrize("cfg, decayed", [
    (rpcompile.AdamW(lr=0.1, weight_decay=0.5, decay={"w0", "w1"}, impl="foreach"), {"w0", "w1"}),
    (rpcompile.AdamW(lr=0.1, weight_decay=0.5, decay=lambda n: n.startswith("w"), impl="single"), {"w0", "w1"}),
    (rpcompile.AdamW(lr=0.1, weight_decay=0.5, decay=["head.w"], impl="foreach"), {"w1"}),  # a tied alias
    (rpcompile.SGD(lr=0.1, momentum=0.9, weight_decay=0.5, decay=("b0", "norm"), impl="foreach"), {"b0", "norm"}),
], ids=["adamw-set", "adamw-callable", "adamw-alias", "sgd-tuple"])
def test_decay_equals_eager_with_two_param_groups(cfg, decayed):
    state, eager = state_and_eager(cfg)
    assert state.decay == decayed and state.config.decay == frozenset(decayed)
    train(state, eager, eager_two_groups(cfg, eager, decayed))
    for n, p in eager.items():
        assert torch.equal(state.master[n], p.detach()), n


def test_decay_none_decays_everything_and_fused_is_close():
    cfg = rpcompile.AdamW(lr=0.1, weight_decay=0.5, decay={"w0"})
    state, eager = state_and_eager(cfg)
    train(state, eager, eager_two_groups(cfg, eager, {"w0"}))
    for n, p in eager.items():
        torch.testing.assert_close(state.master[n], p.detach(), rtol=1e-6, atol=1e-6)
    every, eager = state_and_eager(rpcompile.AdamW(lr=0.1, weight_decay=0.5, impl="foreach"))
    assert every.decay == set(SHAPES) and every.config.decay is None
    train(every, eager, eager_two_groups(every.config, eager, set(SHAPES)))
    assert all(torch.equal(every.master[n], p.detach()) for n, p in eager.items())


def test_bad_decay_names_are_named():
    with pytest.raises(ValueError, match=r"'nope' is not a trainable parameter"):
        state_and_eager(rpcompile.AdamW(decay={"w0", "nope"}))
    with pytest.raises(ValueError, match=r"'b0' is not a trainable parameter"):  # frozen
        state_and_eager(rpcompile.AdamW(decay={"w0", "b0"}), frozen=("b0",))
    with pytest.raises(ValueError, match="got the string 'w0'"):
        rpcompile.AdamW(decay="w0")
    with pytest.raises(ValueError, match="must be strings, got 3"):
        rpcompile.SGD(lr=0.1, decay={"w0", 3})
    with pytest.raises(ValueError, match="got int"):
        rpcompile.SGD(lr=0.1, decay=5)


def test_decay_config_is_frozen_hashable_and_unpickles_old_configs():
    cfg = rpcompile.AdamW(decay=["a", "b", "a"])
    assert cfg.decay == frozenset({"a", "b"}) and hash(cfg) == hash(rpcompile.AdamW(decay={"b", "a"}))
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    old = rpcompile.SGD.__new__(rpcompile.SGD)
    old.__setstate__([0.1, 0.9, 0.0, False, None, "foreach"])  # a checkpoint's SGD from before `decay`
    assert old == rpcompile.SGD(lr=0.1, momentum=0.9, impl="foreach")
    assert decay_names(rpcompile.SGD(lr=0.1, decay=lambda n: "norm" in n), ["w", "norm"]) == {"norm"}
