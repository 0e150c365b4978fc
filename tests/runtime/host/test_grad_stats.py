"""HostState's gradient statistics (runtime/host/grad_stats.py): clipping, loss scaling, the barrier, recovery.

Three parameters in three layers against eager torch: the global norm and clipping, static and dynamic
loss scales, the barrier between threads and its timeout, a missing gradient, and discarding a failed
iteration's gradients. The per-layer protocol against the staleness oracle is test_optimizer.py.
"""
from __future__ import annotations

import struct
import threading
from collections.abc import Mapping

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import eager_optimizer
from torch import nn

import rpcompile
from rpcompile.ir.optim import DynamicLossScale
from rpcompile.runtime.host.grad_stats import step_factor
from rpcompile.runtime.host.lean import to_float32
from rpcompile.runtime.host.optimizer import HostState


def fixed_grads(shapes: Mapping[str, torch.Size], n: int) -> list[dict[str, torch.Tensor]]:
    """n iterations of seeded random gradients."""
    return [{k: torch.randn(s, generator=torch.Generator().manual_seed(5 + 7 * t + i))
             for i, (k, s) in enumerate(shapes.items())} for t in range(n)]


def flat_state(cfg, **kw) -> tuple[HostState, dict[str, nn.Parameter]]:
    """Three params in three layers, plus eager copies of them."""
    torch.manual_seed(3)
    params = {f"p{i}": nn.Parameter(torch.randn(4 + i, 3)) for i in range(3)}
    state = HostState(params, {f"p{i}": (i,) for i in range(3)}, 3, optimizer=cfg, **kw)
    return state, {k: nn.Parameter(v.detach().clone()) for k, v in params.items()}


def test_clipping_matches_clip_grad_norm():
    cfg = rpcompile.AdamW(lr=0.1, max_grad_norm=1.0, impl="foreach")
    state, eager = flat_state(cfg)
    opt = eager_optimizer(cfg, eager.values())
    for grads in fixed_grads({k: v.shape for k, v in eager.items()}, 3):
        for k, p in eager.items():
            p.grad = grads[k].clone()
            state.accumulate_grad(k, grads[k])
        for l in (2, 1, 0):
            state.grads_complete(l)
        norm = state.global_norm()
        ref = torch.nn.utils.clip_grad_norm_(eager.values(), 1.0)
        assert torch.equal(norm, ref) and norm > 1.0
        opt.step()
        for l in (2, 1, 0):
            state.step(l)
        assert all(torch.equal(state.master[k], p) for k, p in eager.items())
        assert all(state.grad_of(k) is None for k in state.grad)


def step_all(state: HostState) -> None:
    """Sequential caller with global statistics: every group completes before the first step."""
    for l in (2, 1, 0):
        state.grads_complete(l)
    for l in (2, 1, 0):
        state.step(l)


def test_dynamic_loss_scale_skips_and_grows():
    cfg = rpcompile.SGD(lr=0.1, impl="single")
    state, eager = flat_state(cfg, loss_scale=DynamicLossScale(init_scale=1024.0, growth_interval=2))
    before = {k: v.clone() for k, v in state.master.items()}
    scale = state.begin_iteration()
    assert scale == 1024.0
    for k, p in eager.items():
        state.accumulate_grad(k, torch.full(p.shape, float("inf") if k == "p1" else 1.0))
    step_all(state)
    assert all(torch.equal(state.master[k], before[k]) for k in before)
    assert state.loss_scale == 512.0 and state.skipped == [0]
    assert all(state.grad_of(k) is None for k in state.grad)
    opt = eager_optimizer(cfg, eager.values())
    for grads in fixed_grads({k: v.shape for k, v in eager.items()}, 2):
        scale = state.begin_iteration()
        for k, p in eager.items():
            state.accumulate_grad(k, grads[k] * scale)  # power-of-two scale: exact unscale
            p.grad = grads[k]
        opt.step()
        step_all(state)
    assert all(torch.equal(state.master[k], p) for k, p in eager.items())
    assert state.loss_scale == 1024.0  # grew after 2 good iterations


def test_threads_and_barrier():
    """Workers write grads from threads; the optimizer thread's step waits for the global norm."""
    cfg = rpcompile.AdamW(lr=0.1, max_grad_norm=0.5)
    state, _ = flat_state(cfg)
    grads = fixed_grads({k: state.master[k].shape for k in state.master}, 1)[0]
    order: list[str] = []
    r3 = [threading.Event() for _ in range(3)]  # the executor's R3 events

    def optimizer_thread() -> None:
        for l in (2, 1, 0):
            r3[l].wait()
            state.step(l)  # step(2) blocks until groups 1 and 0 complete
            order.append(f"O{l}")

    (opt := threading.Thread(target=optimizer_thread)).start()

    def worker(l: int) -> None:
        state.accumulate_grad(f"p{l}", grads[f"p{l}"])
        order.append(f"G{l}")
        state.grads_complete(l)
        r3[l].set()

    for l in (2, 1, 0):
        (w := threading.Thread(target=worker, args=(l,))).start(), w.join()
    opt.join(timeout=10)
    assert order == ["G2", "G1", "G0", "O2", "O1", "O0"]
    with pytest.raises(RuntimeError, match="R4"):
        state.grads_complete(0)
        state.accumulate_grad("p0", grads["p0"])


def test_barrier_timeout_names_missing_groups():
    state, _ = flat_state(rpcompile.SGD(lr=0.1, max_grad_norm=1.0), timeout_s=0.2)
    state.grads_complete(2)
    with pytest.raises(RuntimeError, match=r"groups \[0, 1\]"):
        state.step(2)


def test_missing_grad_is_skipped_like_set_to_none_and_static_scale():
    cfg = rpcompile.AdamW(lr=0.1, max_grad_norm=2.0, impl="single")
    state, eager = flat_state(cfg, loss_scale=4.0)
    opt = eager_optimizer(cfg, eager.values())
    for t, grads in enumerate(fixed_grads({k: v.shape for k, v in eager.items()}, 3)):
        scale = state.begin_iteration()
        assert scale == 4.0
        for k in [k for k in eager if not (t == 1 and k == "p2")]:  # p2 gets no gradient in iteration 1
            state.accumulate_grad(k, grads[k] * scale)
            eager[k].grad = grads[k]
        step_all(state)
        torch.nn.utils.clip_grad_norm_(eager.values(), 2.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert all(torch.equal(state.master[k], p) for k, p in eager.items()), t
    assert state.grad_of("p0") is None
    state.accumulate_grad("p0", torch.ones(4, 3))
    assert torch.equal(state.grad_of("p0"), torch.ones(4, 3))  # the first write overwrites


def test_complete_all_and_discard_for_recovery():
    cfg = rpcompile.AdamW(lr=0.1, max_grad_norm=1.0, impl="foreach")
    runs = []
    for fail in (False, True):
        state, _ = flat_state(cfg, loss_scale=DynamicLossScale(init_scale=8.0))
        for grads in fixed_grads({k: state.master[k].shape for k in state.master}, 3):
            scale = state.begin_iteration()
            if fail:  # a failed attempt: partial gradients, one group completed, then recovery
                state.accumulate_grad("p2", grads["p2"] * 100), state.accumulate_grad("p1", grads["p1"])
                state.grads_complete(2)
                state.discard_grads()
                fail = False
            for k in ("p2", "p1", "p0"):
                state.accumulate_grad(k, grads[k] * scale)
            for l in (2, 1, 0):
                state.grads_complete_all()  # before every STEP: only the first one completes groups
                state.step(l)
        runs.append(state.state_dict())
    assert all(torch.equal(runs[0]["master"][n], runs[1]["master"][n]) for n in runs[0]["master"])
    assert runs[0]["steps"] == runs[1]["steps"] == [3, 3, 3]


# -- clipping with a global norm below the limit ------------------------------------------------------------
def _flat(cfg):
    torch.manual_seed(3)
    params = {f"p{i}": nn.Parameter(torch.randn(4 + i, 3)) for i in range(3)}
    state = HostState(params, {f"p{i}": (i,) for i in range(3)}, 3, optimizer=cfg)
    return state, {k: nn.Parameter(v.detach().clone()) for k, v in params.items()}


def _grads(scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    raw = {f"p{i}": torch.randn(4 + i, 3, generator=g) for i in range(3)}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in raw.values()]))
    return {k: v * (scale / norm) for k, v in raw.items()}  # global norm ~= scale


@pytest.mark.parametrize("norm,limit", [(0.5, 1.0), (0.999, 1.0), (1e-3, 10.0), (3.0, 1.0)])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_clipping_leaves_gradients_below_the_limit_unchanged(norm, limit, opt):
    cfg = (rpcompile.SGD(lr=0.1, max_grad_norm=limit, impl="foreach") if opt == "sgd"
           else rpcompile.AdamW(lr=0.1, weight_decay=0.0, max_grad_norm=limit, impl="foreach"))
    state, eager = _flat(cfg)
    before = {k: v.detach().clone() for k, v in eager.items()}
    grads = _grads(norm)
    ref_opt = eager_optimizer(cfg, eager.values())
    for k, p in eager.items():
        p.grad = grads[k].clone()
        state.accumulate_grad(k, grads[k])
    for l in (2, 1, 0):
        state.grads_complete(l)
    total = torch.nn.utils.clip_grad_norm_(eager.values(), limit)
    assert torch.equal(state.global_norm(), total)
    if total < limit:  # torch leaves them as they are (its coefficient is clamped to 1)
        assert all(torch.equal(p.grad, grads[k]) for k, p in eager.items())
    ref_opt.step()
    for l in (2, 1, 0):
        state.step(l)
    assert all(torch.equal(state.master[k], p) for k, p in eager.items())
    if opt == "sgd" and total < limit:  # the update is -lr * g with g unchanged (up to the kernel's rounding)
        for k in eager:
            torch.testing.assert_close(state.master[k], before[k] - 0.1 * grads[k], rtol=1e-6, atol=1e-7)


def _lagged_run(n: int, resume_at: int | None = None) -> tuple[list[float], HostState]:
    """n sequential iterations at lag 1 (staleness 1), gradients inf in iterations 0 and 3; at `resume_at` the state
    goes through a state_dict into a new HostState."""
    cfg, scaler = rpcompile.SGD(lr=0.1, impl="single"), DynamicLossScale(init_scale=1024.0, growth_interval=1)
    state, _ = flat_state(cfg, loss_scale=scaler)
    scales = []
    for t, grads in enumerate(fixed_grads({k: v.shape for k, v in state.master.items()}, n)):
        if t == resume_at:
            sd = state.state_dict()
            state, _ = flat_state(cfg, loss_scale=scaler)
            state.load_state_dict(sd)
        scales.append(state.begin_iteration(lag=1))
        for k, g in grads.items():
            state.accumulate_grad(k, torch.full_like(g, float("inf")) if t in (0, 3) else g * scales[-1])
        step_all(state)
    return scales, state


def test_at_lag_1_the_loss_scale_is_what_the_checks_two_iterations_back_leave_and_a_resume_keeps_it():
    scales, state = _lagged_run(6)  # each check is in before the next begin: t still ignores t - 1's
    assert scales == [1024.0, 1024.0, 512.0, 1024.0, 2048.0, 512.0] and state.skipped == [0, 3]
    assert [(u, v.used, v.skipped, v.after) for u, v in sorted(state.verdicts.items())][2:4] == \
        [(2, 512.0, False, 2048.0), (3, 1024.0, True, 512.0)]
    for at in (2, 4):  # the checkpoint holds the two checks the next two iterations take their scales from
        again, resumed = _lagged_run(6, resume_at=at)
        assert again == scales and resumed.skipped == [0, 3]
        assert all(torch.equal(resumed.master[k], m) for k, m in state.master.items())


def torch_factor(unscale: float | None, coef: float | None) -> float:
    """The step's factor as torch's float32 tensors form it (what eager's unscale and clip multiply by)."""
    factor = torch.ones((), dtype=torch.float32)
    if unscale is not None and unscale != 1.0:
        factor = factor * (1.0 / unscale)
    if coef is not None:
        factor = factor * torch.tensor(coef, dtype=torch.float32)
    return float(factor)


float32s = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=0.0, exclude_min=True)


@settings(max_examples=400, deadline=None)
@given(unscale=st.one_of(st.none(), float32s, st.sampled_from([1.0, 2.0 ** -130, 3.0, 65536.0 * 3])),
       coef=st.one_of(st.none(), float32s.filter(lambda c: c <= 1.0)))
def test_the_step_factor_in_python_floats_has_torch_float32_bits(unscale, coef):
    want = torch_factor(unscale, coef)
    got = step_factor(unscale, coef)
    assert struct.pack("d", got) == struct.pack("d", want), (unscale, coef, got, want)


@pytest.mark.parametrize("x", [0.1, 1 / 3, 1 + 2 ** -24, 1 + 3 * 2 ** -24, 3.4028235677973366e38,
                               3.4028235e38 * 1.0000001, -1e39, 1e-46, 2.0 ** -149 * 0.5, 2.0 ** -149 * 0.75])
def test_to_float32_rounds_as_torch(x):
    want = float(torch.tensor(x, dtype=torch.float64).to(torch.float32))
    assert struct.pack("d", to_float32(x)) == struct.pack("d", want)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_a_non_contiguous_gradient_lands_as_its_values(grad_dtype):
    params = {"w": nn.Parameter(torch.randn(4, 6))}
    states = [HostState(params, {"w": (0,)}, 1, optimizer=rpcompile.AdamW(lr=0.1, grad_dtype=grad_dtype))
              for _ in range(2)]
    g = torch.randn(6, 4).t()
    assert not g.is_contiguous()
    states[0].accumulate_grad("w", g)
    states[1].accumulate_grad("w", g.contiguous())
    assert torch.equal(states[0].grad_of("w"), states[1].grad_of("w"))
    if grad_dtype == torch.float32:
        assert torch.equal(states[0].grad_of("w"), g)
