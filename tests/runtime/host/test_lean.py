"""bf16 AdamW moments (`AdamW(state_dtype=torch.bfloat16)`): the kernel and the torch fallback against a plain
reference (float32 math, then stochastic rounding with the documented hash), the rounding's statistics,
checkpoints (bf16 as it is, bit for bit on resume, a mismatch refused) and the config check."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import rpcompile
from rpcompile.runtime.host import kernels as kmod
from rpcompile.runtime.host.lean import TorchLean
from rpcompile.runtime.host.optimizer import HostState

K = kmod.load_kernels()
BF16 = torch.bfloat16
SHAPES = {"a": (33, 7), "b": (7,), "c": (5, 9)}  # odd sizes: vector tails and alignment gaps
needs_kernels = pytest.mark.skipif(K is None, reason="no C++ compiler: the kernels cannot be built")


# ---- the reference: written from the docstrings, sharing no code with runtime/host/lean.py ----------
def ref_hash(x: np.ndarray) -> np.ndarray:
    """Wellons' lowbias32 on uint32 (numpy wraps)."""
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def ref_key(seed: int, group: int, step: int) -> int:
    """rounding_key as documented: seed (both 32-bit halves), then the group, then the step."""
    h = lambda v: int(ref_hash(np.array([v & 0xFFFFFFFF], dtype=np.uint64))[0])  # noqa: E731
    return h(h(h((seed & 0xFFFFFFFF) ^ h(seed >> 32)) ^ group) ^ step)


def ref_round(x: torch.Tensor, r16: np.ndarray) -> torch.Tensor:
    """float32 -> bf16: add 16 random bits below the kept ones, cut them."""
    bits = x.numpy().view(np.uint32).astype(np.uint64) + r16.astype(np.uint64)
    out = (bits >> np.uint64(16)).astype(np.uint16)
    return torch.from_numpy(out.view(np.int16).copy()).view(BF16)


def ref_adamw(p, g, m, v, *, lr, betas, eps, weight_decay, step, key, offset, factor=1.0):
    """One AdamW step in plain float32 torch (torch.optim.AdamW's formula), then the moments rounded to bf16."""
    g = g * factor
    m32, v32 = m.float(), v.float()
    b1, b2 = betas
    p = p * (1 - lr * weight_decay)
    m32 = m32.lerp(g, 1 - b1)
    v32 = v32 * b2 + (1 - b2) * g * g
    denom = v32.sqrt() / (1 - b2 ** step) ** 0.5 + eps
    p = p - lr / (1 - b1 ** step) * m32 / denom
    r = ref_hash(np.arange(offset, offset + p.numel(), dtype=np.uint64) & 0xFFFFFFFF ^ key)
    return p, ref_round(m32, r & np.uint32(0xFFFF)), ref_round(v32, r >> np.uint32(16))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within the fp32 kernels' documented agreement (a float32 ulp or so of the weight)."""
    return bool(((a - b).abs() <= 1e-6 * b.abs() + 1e-7).all())


def start(n: int, seed: int = 0):
    """Weights, gradients and bf16 moments of n elements."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g), torch.randn(n, generator=g), (torch.randn(n, generator=g) * 0.1).to(BF16),
            (torch.rand(n, generator=g) * 0.01).to(BF16))


IMPLS = [pytest.param("kernel", marks=needs_kernels), "torch"]


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_moments_step_matches_the_float32_reference_rounded_stochastically(impl):
    n, offset = 100_003, 2**32 - 50_000  # an odd length and element offsets that wrap past 2**32
    p, g, m, v = start(n)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    out = torch.empty(n, dtype=BF16)
    run = (K if impl == "kernel" else TorchLean()).adamw
    for step in (1, 2, 3):
        kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=step, factor=0.5)
        key = ref_key(7, 3, step)
        run(p, g, m, v, out, key=key, offset=offset, **kw)
        rp, rm, rv = ref_adamw(rp, g, rm, rv, key=key, offset=offset, **kw)
        assert m.dtype == v.dtype == BF16
        assert torch.equal(m.view(torch.int16), rm.view(torch.int16))  # the same float32 moment, the same bits
        assert torch.equal(v.view(torch.int16), rv.view(torch.int16))
        assert close(p, rp) and torch.equal(out, p.to(BF16))


@needs_kernels
def test_the_torch_fallback_takes_the_kernels_rounding_decisions():
    p, g, m, v = start(70_001, seed=1)
    q, h, mm, vv = p.clone(), g.clone(), m.clone(), v.clone()
    for step in (1, 2):
        kw = dict(factor=1.0, lr=3e-4, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, step=step, key=step * 977,
                  offset=16)
        K.adamw(p, g, m, v, None, **kw)
        TorchLean().adamw(q, h, mm, vv, None, **kw)
    assert torch.equal(m.view(torch.int16), mm.view(torch.int16)) and torch.equal(v.view(torch.int16),
                                                                                   vv.view(torch.int16))
    assert close(p, q)


@needs_kernels
@pytest.mark.parametrize("lean", [dict(m=BF16), dict(p=BF16), dict(m=BF16, p=BF16, g=BF16)], ids=str)
@pytest.mark.parametrize("out_dtype", [None, torch.float32, BF16])
def test_the_kernels_keep_nan_and_inf_as_the_fallback_does_in_vector_bodies_and_tails(lean, out_dtype):
    # non-finite gradients scattered over 32-wide vector steps and the scalar tail of the last block: the stored bf16
    # values are the fallback's bits (a NaN 0x7FC0, an inf an inf), the fp32 ones non-finite at the same places
    n = 65_536 + 77  # a block of vector steps, then one with a 13-element scalar tail
    p, g, m, v = start(n, seed=5)
    g[::97] = float("nan")
    g[5::89] = float("inf")
    g[-3:] = torch.tensor([float("nan"), -float("inf"), 3e38])
    p[3::101] = float("inf")  # an inf weight with a finite update stays inf
    p, g = p.to(lean.get("p", torch.float32)), g.to(lean.get("g", torch.float32))
    m, v = m.to(lean.get("m", torch.float32)), v.to(lean.get("m", torch.float32))
    q, mm, vv = p.clone(), m.clone(), v.clone()
    o1, o2 = ((torch.empty(n, dtype=out_dtype), torch.empty(n, dtype=out_dtype)) if out_dtype else (None, None))
    kw = dict(factor=0.5, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=3, key=12345, offset=7)
    K.adamw(p, g, m, v, o1, **kw)
    TorchLean().adamw(q, g, mm, vv, o2, **kw)
    for a, b in ((p, q), (m, mm), (v, vv), (o1, o2)):
        if a is None:
            continue
        assert a.isnan().any() and a.isinf().any()
        if a.dtype == BF16 and a is not o1:
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        else:  # a float32 NaN's bits (sign, payload) are the arithmetic's, a cast NaN's the cast's (torch's vectorised
            # cast to bf16 writes 0xFFFF, its scalar one and the kernels 0x7FC0): NaN where the fallback has NaN
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


def test_stochastic_rounding_lets_the_second_moment_decay_where_round_to_nearest_freezes_it():
    # beta2 = 0.999 changes v by 0.1% a step, under half a bf16 ulp (0.2%): to nearest it never moves
    n, steps = 20_000, 100
    p, g, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n, dtype=BF16), torch.ones(n, dtype=BF16)
    for step in range(1, steps + 1):
        TorchLean().adamw(p, g, m, v, None, factor=1.0, lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                          step=step, key=step, offset=0)
    assert torch.ones(1, dtype=BF16).float().mul(0.999).to(BF16).item() == 1.0  # what round to nearest keeps
    assert abs(v.float().mean().item() - 0.999 ** steps) < 2e-3  # unbiased: the mean follows the fp32 decay


def groups_state(impl: str, seed: int = 0, state_dtype=BF16, **kw) -> HostState:
    """A HostState of three odd-shaped parameters, one group each, seeded weights."""
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=g)) for n, s in SHAPES.items()}
    return HostState(params, {n: (l,) for l, n in enumerate(params)}, len(params), seed=seed,
                     optimizer=rpcompile.AdamW(lr=1e-2, max_grad_norm=1.0, impl=impl, state_dtype=state_dtype), **kw)


def run_steps(state: HostState, steps: range, copy: bool = True) -> None:
    """Seeded gradients (step-dependent), then grads_complete and step(copy=...) per group."""
    for t in steps:
        g = torch.Generator().manual_seed(100 + t)
        for n, p in state.master.items():
            state.accumulate_grad(n, torch.randn(p.shape, generator=g))
        for l in reversed(range(len(state.groups))):
            state.grads_complete(l)
        for l in range(len(state.groups)):
            state.step(l, copy=copy)
            state.copy(l)


@pytest.mark.parametrize("impl", [pytest.param("fused", marks=needs_kernels), "foreach"])
def test_host_state_keeps_bf16_moments_and_steps_as_the_reference(impl):
    s = groups_state(impl)
    ref = {n: (s.master[n].clone().view(-1), torch.zeros(p.numel(), dtype=BF16), torch.zeros(p.numel(), dtype=BF16))
           for n, p in s.master.items()}
    assert all(b.dtype == BF16 for m in s.flat.moments for b in m.values())
    run_steps(s, range(2))
    for t in range(2):  # the reference, with the clip coefficient the state applied (the norm it recorded)
        g = torch.Generator().manual_seed(100 + t)
        grads = {n: torch.randn(p.shape, generator=g).view(-1) for n, p in s.master.items()}
        coef = min(1.0, 1.0 / (s.norms[t] + 1e-6))
        for l, n in enumerate(SHAPES):
            p, m, v = ref[n]
            ref[n] = ref_adamw(p, grads[n], m, v, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                               step=t + 1, key=ref_key(0, l, t + 1), offset=0, factor=coef)
    for n, (p, m, v) in ref.items():
        assert close(s.master[n].view(-1), p), n
        mom = s.flat.moment[n]
        assert (mom["exp_avg"].view(-1).float() - m.float()).abs().max() <= m.float().abs().max() * 2**-7, n
        assert (mom["exp_avg_sq"].view(-1).float() - v.float()).abs().max() <= v.float().abs().max() * 2**-7, n


@needs_kernels
def test_host_state_with_the_kernels_and_with_torch_agree():
    a, b = groups_state("fused"), groups_state("foreach")
    run_steps(a, range(3))
    run_steps(b, range(3), copy=False)
    for n in SHAPES:
        assert close(a.master[n], b.master[n])
        for k in ("exp_avg", "exp_avg_sq"):
            ma, mb = a.flat.moment[n][k], b.flat.moment[n][k]
            assert (ma != mb).float().mean() < 1e-3, (n, k)  # the same bits but where a weight ulp tipped one


@pytest.mark.parametrize("impl", [pytest.param("fused", marks=needs_kernels), "foreach"])
def test_a_bf16_state_dict_keeps_the_moments_as_they_are_and_resumes_bit_for_bit(impl):
    whole = groups_state(impl, seed=3)
    run_steps(whole, range(2))
    sd = whole.state_dict()
    assert all(t.dtype == BF16 for o in sd["optim"].values() for k, t in o.items() if k != "step")  # not widened
    assert sd["rounding"] == {"seed": 3, "state_dtype": "bf16"}
    run_steps(whole, range(2, 4))
    resumed = groups_state(impl, seed=99)  # another seed and other weights: the state dict brings its own
    resumed.load_state_dict(sd)
    run_steps(resumed, range(2, 4))
    for n in SHAPES:
        assert torch.equal(resumed.master[n], whole.master[n])
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(resumed.flat.moment[n][k].view(torch.int16), whole.flat.moment[n][k].view(torch.int16))


@pytest.mark.parametrize("saved, loading", [(BF16, torch.float32), (torch.float32, BF16)])
def test_a_state_dict_of_another_state_dtype_is_refused_in_one_line_naming_both(saved, loading):
    src = groups_state("foreach", state_dtype=saved)
    run_steps(src, range(1), copy=False)
    dst = groups_state("foreach", state_dtype=loading)
    before = {n: t.clone() for n, t in dst.master.items()}
    with pytest.raises(ValueError) as err:
        dst.load_state_dict(src.state_dict())
    msg = str(err.value)
    assert "\n" not in msg and f"state_dtype={saved}" in msg and f"state_dtype={loading}" in msg, msg
    assert all(torch.equal(dst.master[n], t) for n, t in before.items())  # nothing changed


def test_default_state_dtype_is_float32_and_other_dtypes_are_refused_naming_the_field():
    assert rpcompile.AdamW().state_dtype == torch.float32
    s = groups_state("foreach", state_dtype=torch.float32)
    assert all(b.dtype == torch.float32 for m in s.flat.moments for b in m.values())
    for bad in (torch.float16, "bf16", torch.float64):
        with pytest.raises(ValueError, match=r"AdamW: state_dtype must be torch.float32 or torch.bfloat16, got"):
            rpcompile.AdamW(state_dtype=bad)


@pytest.mark.parametrize("master, grad", [(torch.float32, torch.float32), (BF16, torch.float32), (BF16, BF16)],
                         ids=["fp32-master", "bf16-master", "bf16-master-grads"])
@pytest.mark.parametrize("staleness", [0, 1])
def test_compile_trains_with_bf16_moments_and_resumes_bit_for_bit(tmp_path, monkeypatch, staleness, master, grad):
    from rpcompile.models.zoo import LlamaConfig, TinyLlama
    # `step` returns once the loss is known, at either staleness while the optimizer lane may still be applying
    # the iteration's updates. Slowing the last iteration's updates makes a snapshot that does
    # not wait for them (HostState.state_dict, unflushed) miss some every time; Compiled.state_dict flushes first
    last, step = 4, HostState.step

    def slow_last_step(self, layer, copy=False):
        if self._stepped[layer] == last:
            time.sleep(0.05)
        step(self, layer, copy=copy)

    monkeypatch.setattr(HostState, "step", slow_last_step)
    cfg = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=64, max_seq=32)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    kw = dict(gpus=2, example=batch, microbatches=2, backend="host", staleness=staleness,
              optimizer=rpcompile.AdamW(lr=1e-3, state_dtype=BF16, master_dtype=master, grad_dtype=grad))
    torch.manual_seed(0)
    with rpcompile.compile(TinyLlama(cfg), **kw) as c:
        first = [c.step(batch) for _ in range(3)]
        c.save(tmp_path / "ckpt")
        rest = [c.step(batch) for _ in range(2)]
        final = c.state_dict()["host"]  # flushed: every update of the 5 iterations applied
    assert rest[-1] < first[-1] < first[0]  # it trains
    assert set(final["steps"]) == {last + 1}, final["steps"]
    assert all(t.dtype == master for t in final["master"].values())  # the checkpoint's masters as they are
    with rpcompile.load(tmp_path / "ckpt", TinyLlama(cfg)) as r:
        assert r.options.optimizer.state_dtype == BF16 and r.options.optimizer.master_dtype == master
        assert r.options.optimizer.grad_dtype == grad and all(g.dtype == grad for g in r.state.flat.grads)
        assert [r.step(batch) for _ in range(2)] == rest
        again = r.state_dict()["host"]
    assert again["steps"] == final["steps"]
    for key in ("master", "compute"):
        assert all(torch.equal(t, again[key][n]) for n, t in final[key].items()), key
    for n, o in final["optim"].items():
        assert all(torch.equal(o[k], again["optim"][n][k]) for k in o), n

