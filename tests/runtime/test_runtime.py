"""Runtime on host workers: equality with eager PyTorch, staleness oracle, RNG, determinism, memory."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import models
import rpcompile
from oracle import reference_train
from rpcompile import AdamW, SGD, StagePlan
from rpcompile.passes import emit, trace
from rpcompile.runtime.executor import Runtime
from rpcompile.runtime.host.optimizer import HostState
from rpcompile.runtime.stage.batch import split_batch
from rpcompile.runtime.stage.rng import layer_seed

# eager torch.optim.AdamW bits; eps 1e-4: some gradients are pure rounding noise (nanoGPT's key bias is
# softmax-invariant, its true gradient is 0) and Adam with a tiny eps turns noise into lr-sized steps.
OPT = AdamW(lr=1e-2, eps=1e-4, impl="foreach")
PLANS = {5: {1: "2,2|1|2,2", 2: "2,2|1|1,3", 3: "1,2|2|2,1", 4: "1,1,1,1|1|1,1,1,1"},   # llama: 5 layers
         6: {1: "2,3|1|3,2", 2: "3,2|1|2,3", 3: "2,2,1|1|1,2,2", 4: "1,1,1,1,1|1|1,1,1,1,1"}}  # nanoGPT: 6


def _setup(kind: str, *, seed: int = 0, **overrides):
    """(model, graph, make_batch(seed, size), per-model loss on a batch)."""
    if kind == "llama":
        model = models.llama(seed, **overrides)
        make = lambda s, n: models.lm_batch(batch=n, seq=8, seed=s)  # noqa: E731
        loss = lambda mdl, b: mdl(**b).loss  # noqa: E731
        graph = trace(model, make(0, 4))
    else:
        model = models.nanogpt(seed, **overrides)
        make = lambda s, n: models.token_batch(batch=n, seq=8, seed=s)  # noqa: E731
        loss = lambda mdl, b: mdl(*b)[1]  # noqa: E731
        graph = trace(model, make(0, 4), loss_fn=models.gpt_loss)
    return model, graph, make, loss


def _mean_loss(graph, loss, microbatches: int):
    """loss_fn(model, batch) = mean of the microbatch losses, as the runtime defines it."""
    def fn(model, batch):
        parts = split_batch(graph, batch, microbatches)
        if graph.input_kind == "dict":
            return sum(loss(model, p) for p in parts) / microbatches
        return sum(loss(model, tuple(p[n] for n in graph.inputs)) for p in parts) / microbatches
    return fn


def _train(graph, plan: str, gpus: int, mbs: int, batches, *, staleness=0, opt=OPT, **kw):
    """Run the runtime over `batches`; returns (losses, fp32 weights, state)."""
    state = HostState.from_graph(graph, optimizer=opt)
    prog = emit(StagePlan.from_str(plan), gpus=gpus, microbatches=mbs, staleness=staleness)
    with Runtime(graph, prog, state, backend="host", timeout=30, **kw) as rt:
        losses = [rt.step(b) for b in batches]
        rt.flush()
    return losses, state.parameters_fp32(), state


def _close(a: dict, b: dict, rel: float = 1e-5) -> None:
    for n, v in a.items():
        ref = b[n].float()
        assert torch.allclose(v, ref, rtol=rel, atol=rel * ref.abs().max().item()), \
            f"{n}: max diff {(v - ref).abs().max().item():.3g}"


@pytest.mark.parametrize("kind", ["llama", "nanogpt"])
@pytest.mark.parametrize("gpus,mbs", [(1, 4), (2, 4), (3, 6), (4, 8), (4, 16)])
def test_staleness0_equals_eager(kind, gpus, mbs):
    """5 steps, staleness 0: losses and every parameter equal an eager AdamW loop within 1e-5."""
    model, graph, make, loss = _setup(kind)
    batches = [make(s, mbs) for s in range(5)]
    ref, sd = reference_train(model, batches, optimizer=OPT, staleness=0, loss_fn=_mean_loss(graph, loss, mbs))
    plan = PLANS[len(graph.layers)][gpus]
    losses, params, _ = _train(graph, plan, gpus, mbs, batches, staleness=0)
    assert losses == pytest.approx(ref, rel=1e-5)
    _close(params, sd)


@pytest.mark.parametrize("kind,gpus,mbs", [("llama", 2, 4), ("nanogpt", 3, 6), ("llama", 4, 8)])
def test_staleness1_equals_oracle(kind, gpus, mbs):
    """staleness 1 equals the DESIGN idea-7 reference loop (tests/oracle.py) within 1e-5."""
    model, graph, make, loss = _setup(kind)
    batches = [make(s, mbs) for s in range(5)]
    ref, sd = reference_train(model, batches, optimizer=OPT, staleness=1, loss_fn=_mean_loss(graph, loss, mbs))
    losses, params, _ = _train(graph, PLANS[len(graph.layers)][gpus], gpus, mbs, batches, staleness=1)
    assert losses == pytest.approx(ref, rel=1e-5)
    _close(params, sd)


def _eager_seeded_step(graph, model, batch, mbs: int, seed: int, lr: float):
    """One SGD step of the layers run once (no recompute), each layer seeded as the runtime seeds it."""
    params = dict(model.named_parameters())
    loss_total = 0.0
    for j, inputs in enumerate(split_batch(graph, batch, mbs)):
        env = dict(inputs)
        for lay in graph.layers:
            torch.manual_seed(layer_seed(seed, 0, j, lay.index))
            outs = torch.func.functional_call(lay.module, {p: params[p] for p in lay.params},
                                              tuple(env[n] for n in lay.inputs))
            env.update(zip(lay.outputs, outs))
        (env[graph.loss] / mbs).backward()
        loss_total += float(env[graph.loss]) / mbs
    with torch.no_grad():
        return loss_total, {n: (p - lr * p.grad).detach() for n, p in params.items()}


def test_dropout_recompute_reproduces_masks():
    """Dropout on: the B stages' recompute uses the forward's masks (equal to a run without recompute),
    the masks are really active, and two runs with the same seed are bit-identical."""
    model, graph, make, _ = _setup("llama", attention_dropout=0.3)
    batch, mbs, opt = make(7, 4), 4, SGD(lr=0.5)
    ref_loss, ref = _eager_seeded_step(graph, copy.deepcopy(model), batch, mbs, seed=11, lr=0.5)
    graph = trace(model, make(0, 4))  # fresh graph: the eager run above touched the model's grads only
    (l1,), p1, _ = _train(graph, "1,2|2|2,1", 3, mbs, [batch], opt=opt, seed=11)
    (l2,), p2, _ = _train(graph, "1,2|2|2,1", 3, mbs, [batch], opt=opt, seed=11)
    (l3,), p3, _ = _train(graph, "1,2|2|2,1", 3, mbs, [batch], opt=opt, seed=12)
    assert l1 == pytest.approx(ref_loss, rel=1e-5)
    _close(p1, ref)
    assert l1 == l2 and all(torch.equal(p1[n], p2[n]) for n in p1)
    assert l3 != l1  # a different seed draws different masks


@pytest.mark.parametrize("staleness", [0, 1])
def test_lane_delays_bit_identical(staleness):
    """20 runs with different random lane delays give bit-identical parameters (fixed accumulation order)."""
    _, graph, make, _ = _setup("nanogpt")  # tied embedding / LM head: two stages write one gradient
    batches = [make(s, 8) for s in range(2)]
    first = None
    for k in range(20 if staleness else 6):
        _, params, _ = _train(graph, "2,3|1|2,3", 3, 8, batches, staleness=staleness, lane_delay=k,
                              opt=AdamW(lr=1e-2))
        if first is None:
            first = params
        assert all(torch.equal(first[n], params[n]) for n in first), f"run {k} differs"


def test_worker_peak_memory_within_plan_estimate():
    """Each host worker's peak accounted bytes <= the plan's per-stage estimate (max over its stages) + 10%."""
    from rpcompile.passes.cost import estimate_costs
    _, graph, make, _ = _setup("llama")
    gpus, mbs, plan = 2, 4, StagePlan.from_str("2,2|1|1,3")
    costs = estimate_costs(graph, make(0, 4), mode="measure", device="cpu", microbatches=mbs,
                           warmup=0, repeats=1, progress=False)
    predicted = plan.stage_memory(costs, gpus=gpus)
    state = HostState.from_graph(graph, optimizer=OPT)
    prog = emit(plan, gpus=gpus, microbatches=mbs, staleness=1)
    with Runtime(graph, prog, state, backend="host", lane_delay=3) as rt:
        for s in range(3):
            rt.step(make(s, 4))
        rt.flush()
        peaks = rt.peak_memory()
    ran = {w: set() for w in range(gpus)}
    for t in range(3):
        for i in prog.shifted(t).instrs:
            if i.worker >= 0:
                ran[i.worker].add(i.stage)
    for w, peak in enumerate(peaks):
        bound = max(predicted[s] for s in ran[w])
        assert 0 < peak <= 1.1 * bound, f"w{w}: peak {peak} B > 1.1 * {bound} B"


def test_evaluate_and_timeline():
    """evaluate() matches the eager mean loss and changes nothing; last_timeline has every instruction."""
    model, graph, make, loss = _setup("llama")
    batch = make(3, 4)
    state = HostState.from_graph(graph, optimizer=OPT)
    prog = emit(StagePlan.from_str("2,2|1|1,3"), gpus=2, microbatches=4, staleness=1)
    with Runtime(graph, prog, state, backend="host") as rt:
        before = state.parameters_fp32()
        with torch.no_grad():
            assert rt.evaluate(batch) == pytest.approx(float(_mean_loss(graph, loss, 4)(model, batch)), rel=1e-6)
        assert all(torch.equal(before[n], v) for n, v in state.parameters_fp32().items())
        rt.step(batch)
        names = {r[0] for r in rt.last_timeline}
        assert len(rt.last_timeline) >= sum(1 for i in prog.instrs if not i.is_host)
        assert {i.name for i in prog.shifted(0).instrs if not i.is_host} <= names
        assert all(0 <= r[3] <= r[4] for r in rt.last_timeline)


def test_indivisible_batch_names_input():
    _, graph, make, _ = _setup("llama")
    state = HostState.from_graph(graph, optimizer=OPT)
    prog = emit(StagePlan.from_str("2,2|1|1,3"), gpus=2, microbatches=4, staleness=0)
    with Runtime(graph, prog, state, backend="host") as rt:
        with pytest.raises(ValueError, match="input_ids"):
            rt.step(make(0, 6))
        rt.step(make(0, 4))  # still usable


@pytest.mark.parametrize("staleness", [0, 1])
def test_gradient_clipping_keeps_its_meaning(staleness):
    """max_grad_norm clips by the global norm over every layer's gradient, as clip_grad_norm_ does."""
    opt = AdamW(lr=1e-2, eps=1e-4, impl="foreach", max_grad_norm=0.05)
    model, graph, make, loss = _setup("nanogpt")
    batches = [make(s, 4) for s in range(4)]
    ref, sd = reference_train(model, batches, optimizer=opt, staleness=staleness,
                              loss_fn=_mean_loss(graph, loss, 4))
    losses, params, _ = _train(graph, PLANS[6][2], 2, 4, batches, staleness=staleness, opt=opt)
    assert losses == pytest.approx(ref, rel=1e-5)
    _close(params, sd)


# -- a microbatch's loss buffer goes back to the pool when its loss is read, not at the commit ------------
def _llama_runtime_parts():
    import models
    from rpcompile.ir.costs import CostTable
    from rpcompile.ir.plan import StagePlan
    from rpcompile.passes import emit, trace
    graph = trace(models.llama(), models.lm_batch(batch=4, seq=8, seed=0))
    n = len(graph.layers)
    prog = emit(StagePlan.from_sizes([n - 1], 1, [n - 1]), gpus=1, microbatches=2, round_size=2, staleness=1,
                costs=CostTable.from_lists(fwd=[1e-3] * n, bwd=[2e-3] * n))
    return graph, prog


def test_the_next_steps_loss_does_not_wait_for_this_steps_commit():
    import threading

    import models
    from rpcompile.runtime.executor import Runtime
    from rpcompile.runtime.host.optimizer import HostState
    graph, prog = _llama_runtime_parts()

    def run(gated: bool) -> tuple[list[float], dict]:
        state = HostState.from_graph(graph, optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach"))
        gate, armed = threading.Event(), threading.Event()
        add, last = state.accumulate_grad, set()

        def held(name, part):  # once armed, the iteration's last gradients reach the host only when the test
            if armed.is_set() and name in last:  # lets them (the staging ring's earlier units go on)
                assert gate.wait(30)
            return add(name, part)  # whether the gradient is finite (the host lanes' check reads it)

        state.accumulate_grad = held
        batch = lambda s: models.lm_batch(batch=4, seq=8, seed=s)  # noqa: E731
        with Runtime(graph, prog, state, backend="host", timeout=8) as rt:
            last.update(rt.host.plan.units[-1].grads)
            losses = [rt.step(batch(0))]  # warm-up: its loss buffers are not yet the persistent ones
            rt.flush()
            if gated:
                armed.set()  # iteration 1 cannot commit until the gate opens
            losses.append(rt.step(batch(1)))
            # staleness 1: step 2 reads the weights of update 0 and needs nothing of iteration 1's commit;
            # its loss downloads reuse iteration 1's loss buffers
            losses.append(rt.step(batch(2)))
            armed.clear(), gate.set()
            losses.append(rt.step(batch(3)))
            rt.flush()
        return losses, state.parameters_fp32()

    gated, free = run(True), run(False)
    assert gated[0] == free[0]
    assert all(torch.equal(gated[1][n], free[1][n]) for n in free[1])

# -- step() copies its batch: changing it in place after step returns does not change what trains ---
def test_a_batch_changed_in_place_after_step_returns_trains_as_given():
    from rpcompile.ir.costs import CostTable
    from rpcompile.ir.plan import StagePlan
    from rpcompile.passes import emit, trace
    from rpcompile.runtime.executor import Runtime
    from rpcompile.runtime.host.optimizer import HostState
    graph = trace(models.LossMLP(), models.xy(0))
    n = len(graph.layers)
    prog = emit(StagePlan.from_sizes([n - 1], 1, [n - 1]), gpus=2, microbatches=2, staleness=1,
                costs=CostTable.from_lists(fwd=[1e-3] * n, bwd=[2e-3] * n))
    slow = lambda w, lane, label: 0.05 if lane == "act_up" else 0.0  # noqa: E731 - uploads run late

    def run(scribble: bool) -> dict:
        state = HostState.from_graph(graph, optimizer=rpcompile.SGD(lr=0.1, impl="foreach"))
        with Runtime(graph, prog, state, backend="host", lane_delay=slow, timeout=20) as rt:
            for s in range(3):
                x, y = models.xy(s)
                rt.step((x, y))
                if scribble:  # the caller reuses its batch tensors at once (a data loader's buffer)
                    x.fill_(100.0), y.fill_(-100.0)
            rt.flush()
        return state.parameters_fp32()

    got, want = run(True), run(False)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_cuda_workers_refuse_a_pageable_host_state():
    from rpcompile.passes import trace
    from rpcompile.runtime.executor import check_pinned
    from rpcompile.runtime.host.optimizer import HostState
    state = HostState.from_graph(trace(models.LossMLP(), models.xy(0)), optimizer=rpcompile.SGD(lr=0.1))  # pin_memory=False
    check_pinned(state, "host")  # host workers read it in place
    with pytest.raises(ValueError, match=r"not pinned .*pin_memory=True"):
        check_pinned(state, "cuda")


# -- buffers updated in the forward change once per microbatch, as in eager ---------------------------------
class _BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()),
                                    nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU()),
                                    nn.Linear(16, 3))

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.blocks(x), y)


@pytest.mark.parametrize("gpus", [1, 2])
def test_batchnorm_running_statistics_match_eager(gpus):
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(2)]
    model = _BNNet()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in data:  # eager: 2 microbatches per step, the loss their mean, one update per step
        opt.zero_grad()
        sum(ref(xm, ym) for xm, ym in zip(x.chunk(2), y.chunk(2))).div(2).backward()
        opt.step()
    with rpcompile.compile(model, gpus=gpus, example=data[0], microbatches=2, staleness=0, backend="host",
                           optimizer=rpcompile.SGD(lr=0.1, impl="foreach")) as c:
        for b in data:
            c.step(b)
        got = c.model()
    want = dict(ref.named_buffers())
    for n, b in got.named_buffers():
        assert torch.allclose(b.float(), want[n].float(), rtol=1e-5, atol=1e-6), n
    assert int(got.blocks[0][1].num_batches_tracked) == 4 == int(ref.blocks[0][1].num_batches_tracked)
    for n, p in got.named_parameters():
        assert torch.allclose(p, dict(ref.named_parameters())[n], rtol=1e-5, atol=1e-6), n
