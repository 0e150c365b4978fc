"""HostState: groups, the per-layer protocol vs the staleness oracle, the update, state.

Clipping, loss scaling and the global barrier (runtime/host/grad_stats.py) are test_grad_stats.py.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st
from oracle import eager_optimizer, reference_train
from torch import nn
from torch.func import functional_call

import rpcompile
from rpcompile.runtime.host.optimizer import HostState

V, D, R = 11, 8, 2
GradsFn = Callable[[int, Mapping[str, torch.Tensor]], Mapping[int, Mapping[str, torch.Tensor]]]


class Tiny(nn.Module):
    """Embedding -> LoRA on a frozen Linear -> head tied to the embedding -> loss (4 layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)  # layer 0
        self.fc = nn.Linear(D, D).requires_grad_(False)  # layer 1 (frozen base)
        self.lora_a = nn.Parameter(torch.randn(R, D) * 0.3)  # layer 1
        self.lora_b = nn.Parameter(torch.randn(D, R) * 0.3)  # layer 1
        self.head = nn.Linear(D, V, bias=False)  # layer 2
        self.head.weight = self.emb.weight
        self.head_bias = nn.Parameter(torch.zeros(V))  # layer 2; layer 3 = the loss, no params

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = torch.tanh(h + self.fc(h) + h @ self.lora_a.T @ self.lora_b.T)
        return nn.functional.cross_entropy((self.head(h) + self.head_bias).flatten(0, 1), y.flatten())


LAYER_PARAMS = (("emb.weight",), ("fc.weight", "fc.bias", "lora_a", "lora_b"), ("head.weight", "head_bias"), ())
TIED = {"head.weight": "emb.weight"}


def owners() -> dict[str, tuple[int, ...]]:
    """Canonical name -> layers using it."""
    out: dict[str, list[int]] = {}
    for l, names in enumerate(LAYER_PARAMS):
        for n in names:
            out.setdefault(TIED.get(n, n), []).append(l)
    return {n: tuple(ls) for n, ls in out.items()}


def make(seed: int = 0) -> Tiny:
    """A seeded Tiny model."""
    torch.manual_seed(seed)
    return Tiny()


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n seeded (x, y) batches."""
    g = torch.Generator().manual_seed(123)
    return [(torch.randint(0, V, (4, 5), generator=g), torch.randint(0, V, (4, 5), generator=g)) for _ in range(n)]


def host(model: nn.Module, opt: rpcompile.AdamW | rpcompile.SGD, **kw) -> HostState:
    """A HostState over model's canonical parameters."""
    return HostState(dict(model.named_parameters()), owners(), len(LAYER_PARAMS), optimizer=opt, tied=TIED, **kw)


def model_grads(data: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> GradsFn:
    """grads_fn: per-layer gradient contributions of Tiny at the given reads (tied uses kept apart)."""
    template = Tiny()

    def fn(t: int, reads: Mapping[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
        leaves = {n: reads[n].detach().clone().requires_grad_(n not in ("fc.weight", "fc.bias"))
                  for l in LAYER_PARAMS for n in l}
        functional_call(template, leaves, data[t], tie_weights=False).backward()
        return {l: {n: leaves[n].grad for n in names if leaves[n].grad is not None}
                for l, names in enumerate(LAYER_PARAMS)}
    return fn


def drive(state: HostState, grads_fn: GradsFn, iterations: int, staleness: int) -> list[dict[str, torch.Tensor]]:
    """Run the per-layer protocol sequentially; returns what each iteration's uploads read.

    Iteration t: forward reads (ascending layers); per layer descending: backward
    re-reads (same version), gradient writes, then staleness 0: step(l), copy(l);
    staleness 1: copy(l) (after the iteration's last read of the group), step(l).
    With clipping/dynamic scaling all groups complete before the first step.
    """
    layers = [tuple(n for n, ls in state.owners.items() if l in ls) for l in range(len(state.groups))]
    seen: list[dict[str, torch.Tensor]] = []

    def ops(l: int) -> None:
        _ = (state.step(l), state.copy(l)) if staleness == 0 else (state.copy(l), state.step(l))

    for t in range(iterations):
        state.begin_iteration()
        reads = {n: state.read(n).clone() for names in layers for n in names}
        seen.append(reads)
        grads = grads_fn(t, {**reads, **{a: reads[c] for a, c in state.tied.items()}})
        for l in reversed(range(len(layers))):
            for n in layers[l]:
                assert torch.equal(state.read(n), reads[n]), f"iteration {t}: {n} changed within the iteration"
            for name, g in grads.get(l, {}).items():
                state.accumulate_grad(name, g)
            state.grads_complete(l)
            if not state.needs_global:
                ops(l)
        if state.needs_global:
            for l in reversed(range(len(layers))):
                ops(l)
    return seen


CONFIGS = [rpcompile.AdamW(lr=0.05, impl="foreach"), rpcompile.AdamW(lr=0.05, impl="single"),
           rpcompile.SGD(lr=0.3, momentum=0.9, weight_decay=0.01, nesterov=True, impl="foreach"),
           rpcompile.AdamW(lr=0.05, max_grad_norm=0.05, impl="foreach")]


@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["adamw-foreach", "adamw-single", "sgd-nesterov", "adamw-clip"])
def test_drive_matches_oracle_exactly(cfg, staleness):
    data = batches(5)
    oracle_reads: list[dict[str, torch.Tensor]] = []
    _, final = reference_train(make(), data, optimizer=cfg, staleness=staleness, loss_fn=lambda m, b: m(*b),
                               on_read=lambda t, m: oracle_reads.append(
                                   {n: p.detach().clone() for n, p in m.named_parameters()}))
    state = host(make(), cfg)
    seen = drive(state, model_grads(data), len(data), staleness)
    for t, (ours, ref) in enumerate(zip(seen, oracle_reads)):
        for n in ref:
            assert torch.equal(ours[n], ref[n]), f"iteration {t}: read of {n} differs"
    fp32 = state.parameters_fp32()
    for n in fp32:
        assert torch.equal(fp32[n], final[n]), n
    if staleness == 1:  # the first two iterations read the initial weights
        assert all(torch.equal(seen[1][n], seen[0][n]) for n in seen[0])
        assert not torch.equal(seen[2]["lora_a"], seen[0]["lora_a"])


@pytest.mark.parametrize("cfg", [rpcompile.AdamW(lr=0.05),
                                 rpcompile.SGD(lr=0.3, momentum=0.9, weight_decay=0.01, nesterov=True)],
                         ids=["adamw", "sgd-nesterov"])
def test_fused_close_to_eager(cfg):
    """The fused CPU kernels vectorise differently per CPU (FMA in the tail): close, not bit-equal."""
    data = batches(5)
    _, final = reference_train(make(), data, optimizer=cfg, staleness=1, loss_fn=lambda m, b: m(*b))
    state = host(make(), cfg)
    drive(state, model_grads(data), len(data), 1)
    for n, p in state.parameters_fp32().items():
        torch.testing.assert_close(p, final[n], rtol=1e-6, atol=1e-6)


def test_groups_tied_and_frozen():
    state = host(make(), rpcompile.AdamW())
    assert state.groups == (("emb.weight",), ("lora_a", "lora_b"), ("head_bias",), ())
    assert state.owners["emb.weight"] == (0, 2) and state.group_readers(0) == (0, 2)
    assert set(state.master) == set(state.grad) == {"emb.weight", "lora_a", "lora_b", "head_bias"}
    assert set(state.compute) == set(state.master) | {"fc.weight", "fc.bias"}
    assert state.read("head.weight") is state.read("emb.weight")
    with pytest.raises(KeyError, match="fc.weight"):
        state.accumulate_grad("fc.weight", torch.zeros(D, D))
    drive(state, model_grads(batches(2)), 2, 1)
    sd = state.state_dict()
    assert set(sd["optim"]) == set(state.master) and "fc.weight" not in sd["master"]
    assert sd["steps"] == [2, 2, 2, 2]
    state.step(3), state.copy(3)  # empty group: no-ops


def test_bf16_compute_copy():
    state = host(make(), rpcompile.AdamW(lr=0.05), dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in state.compute.values())
    assert all(t.dtype == torch.float32 for t in state.master.values())
    drive(state, lambda t, r: model_grads(batches(3))(t, {n: v.float() for n, v in r.items()}), 3, 0)
    for n, m in state.master.items():
        assert torch.equal(state.read(n), m.to(torch.bfloat16)), n
    assert torch.equal(state.parameters_fp32()["fc.weight"], state.read("fc.weight").float())


def test_state_dict_round_trip():
    data, cfg = batches(6), rpcompile.AdamW(lr=0.05, max_grad_norm=0.1)
    a = host(make(), cfg)
    grads = model_grads(data)
    drive(a, grads, 3, 1)
    sd = a.state_dict()
    rest = drive(a, lambda t, r: grads(t + 3, r), 3, 1)
    b = host(make(seed=7), cfg)
    b.load_state_dict(sd)
    assert b.state_dict()["steps"] == sd["steps"]
    rest_b = drive(b, lambda t, r: grads(t + 3, r), 3, 1)
    for x, y in zip(rest, rest_b):
        assert all(torch.equal(x[n], y[n]) for n in x)
    sa, sb = a.state_dict(), b.state_dict()
    for key in ("compute", "master"):
        assert all(torch.equal(sa[key][n], sb[key][n]) for n in sa[key])
    for n, st in sa["optim"].items():
        assert all(torch.equal(v, sb["optim"][n][k]) for k, v in st.items())
    with pytest.raises(ValueError, match="shape"):
        b.load_state_dict({**sd, "master": {**sd["master"], "lora_a": torch.zeros(3)}})


def test_from_graph_and_config_errors():
    m = make()
    graph = SimpleNamespace(layers=LAYER_PARAMS, tied=TIED, parameters=lambda: dict(m.named_parameters()),
                            param_owners=owners)
    state = HostState.from_graph(graph, optimizer=rpcompile.SGD(lr=0.1), dtype=torch.float16)
    assert state.groups[0] == ("emb.weight",) and state.read("fc.weight").dtype == torch.float16
    with pytest.raises(ValueError, match="betas"):
        rpcompile.AdamW(betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="impl"):
        rpcompile.SGD(lr=0.1, impl="cuda")
    with pytest.raises(ValueError, match="nesterov"):
        rpcompile.SGD(lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="owner layers"):
        HostState({"w": nn.Parameter(torch.zeros(2))}, {"w": (5,)}, 2, optimizer=rpcompile.SGD(lr=0.1))


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_property_random_layouts_match_eager(data):
    """Random layer/owner layouts (ties, frozen, empty layers): drive == eager optimizer + staleness oracle."""
    layers = data.draw(st.integers(1, 5), "layers")
    n = data.draw(st.integers(1, 5), "params")
    own = {f"w{i}": tuple(sorted(data.draw(st.sets(st.integers(0, layers - 1), min_size=1, max_size=3))))
           for i in range(n)}
    frozen = data.draw(st.sets(st.sampled_from(sorted(own))), "frozen")
    staleness = data.draw(st.sampled_from([0, 1]), "staleness")
    cfg = data.draw(st.sampled_from([rpcompile.AdamW(lr=0.1, impl="foreach"),
                                     rpcompile.SGD(lr=0.1, momentum=0.9, impl="single"),
                                     rpcompile.AdamW(lr=0.1, max_grad_norm=0.5, impl="single")]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), "seed"))
    params = {k: nn.Parameter(torch.randn(3, generator=g), requires_grad=k not in frozen) for k in own}
    contrib = [{l: {k: torch.randn(3, generator=g) for k in own if l in own[k] and k not in frozen}
                for l in range(layers)} for _ in range(4)]
    state = HostState(params, own, layers, optimizer=cfg)
    seen = drive(state, lambda t, reads: contrib[t], 4, staleness)
    eager = {k: p.detach().clone().requires_grad_(p.requires_grad) for k, p in params.items()}
    trainable = [p for p in eager.values() if p.requires_grad]
    opt = eager_optimizer(cfg, trainable) if trainable else None
    versions = [{k: p.detach().clone() for k, p in eager.items()}]
    for t in range(4):
        read = versions[max(0, len(versions) - 1 - staleness)]
        assert all(torch.equal(seen[t][k], read[k]) for k in own), t
        for k, p in eager.items():  # contributions summed in backward (descending layer) order
            parts = [contrib[t][l][k] for l in reversed(range(layers)) if k in contrib[t][l]]
            p.grad = None if not parts else parts[0].clone()
            for part in parts[1:]:
                p.grad.add_(part)
        if cfg.max_grad_norm is not None and any(p.grad is not None for p in eager.values()):
            torch.nn.utils.clip_grad_norm_([p for p in eager.values() if p.grad is not None], cfg.max_grad_norm)
        if opt is not None:
            opt.step()
        versions.append({k: p.detach().clone() for k, p in eager.items()})
    assert all(torch.equal(state.parameters_fp32()[k], p.detach()) for k, p in eager.items())
