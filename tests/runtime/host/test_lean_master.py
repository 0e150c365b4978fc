"""bf16 masters (`AdamW/SGD(master_dtype=torch.bfloat16)`): the kernels' and the torch fallback's update against a
plain reference (float32 math from the widened weight, then stochastic rounding with the master's own hash key)
and against each other bit for bit, the rounding's statistics, a small training run where round to nearest learns
nothing, the separate compute copy (rule R1), checkpoints (bf16 as it is, bit for bit, a mismatch refused)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import rpcompile
from rpcompile.runtime.host import lean as lean_mod
from rpcompile.runtime.host.lean import TorchLean, rounding_key
from rpcompile.runtime.host.optimizer import HostState
from tests.runtime.host.test_lean import (BF16, IMPLS, SHAPES, K, close, needs_kernels, ref_adamw, ref_hash, ref_key,
                                          ref_round, run_steps, start)


def ref_master_round(p: torch.Tensor, key: int, offset: int) -> torch.Tensor:
    """float32 weights to a bf16 master as documented: r = hash32(element ^ key) (the moments' bits), the master's
    16 bits the xor of r's halves and of 0x8000."""
    r = ref_hash(np.arange(offset, offset + p.numel(), dtype=np.uint64) & 0xFFFFFFFF ^ key)
    return ref_round(p, (r ^ (r >> np.uint32(16)) ^ np.uint32(0x8000)) & np.uint32(0xFFFF))


def test_an_elements_three_draws_are_uniform_and_pairwise_independent():
    # exp_avg, exp_avg_sq and a bf16 master share one hash per element: each draw uniform, any two independent (what
    # each rounding's mean and two roundings' covariance depend on); counted over 2**20 elements of one step
    r = lean_mod.random_bits(2**32 - 1000, 2**20, rounding_key(3, 1, 7))
    draws = {"m": r & 0xFFFF, "v": r >> 16, "p": lean_mod.master_bits(r)}
    n = r.numel()
    for name, d in draws.items():
        quarters = torch.bincount(d >> 14, minlength=4).double() / n
        assert (quarters - 0.25).abs().max() < 0.004, (name, quarters)  # about 8 standard deviations
    for a, b in (("m", "v"), ("m", "p"), ("v", "p")):
        joint = torch.bincount((draws[a] >> 14) * 4 + (draws[b] >> 14), minlength=16).double() / n
        assert (joint - 1 / 16).abs().max() < 0.002, (a, b, joint)  # each pair of quarters 1/16: no dependence


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits (bf16 and fp16 as int16), for exact comparisons."""
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("state", [torch.float32, BF16])
@pytest.mark.parametrize("out_dtype", [torch.float16, BF16])  # the kernels' scalar loop, their AVX-512 one
def test_bf16_master_step_matches_the_float32_reference_rounded_stochastically(impl, state, out_dtype):
    n, offset = 100_003, 2**32 - 50_000
    p, g, m, v = start(n, seed=2)
    p, m, v = p.to(BF16), m.to(state), v.to(state)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    out = torch.empty(n, dtype=out_dtype)
    run = (K if impl == "kernel" else TorchLean()).adamw
    for step in (1, 2, 3):
        kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=step, factor=0.5)
        key = ref_key(7, 3, step)
        run(p, g, m, v, out, key=key, offset=offset, **kw)
        # the reference: float32 math from the widened master, then the weight rounded with the master's bits
        p32, m32, v32 = ref_adamw(rp.float(), g, rm, rv, key=key, offset=offset, **kw)
        rp = ref_master_round(p32, key, offset)
        if state == BF16:
            rm, rv = m32, v32
        else:  # fp32 moments: the float32 values as they are
            rm, rv = rm.lerp(g * 0.5, 0.1), rv * 0.999 + (1 - 0.999) * (g * 0.5) * (g * 0.5)
        assert p.dtype == BF16 and torch.equal(bits(p), bits(rp)), step
        assert torch.equal(out, p.to(out_dtype))  # the compute copy is cast from the stored bf16 weight
        if state == BF16:
            assert torch.equal(bits(m), bits(rm)) and torch.equal(bits(v), bits(rv))
        else:
            assert close(m, rm) and close(v, rv)


@needs_kernels
@pytest.mark.parametrize("state", [torch.float32, BF16])
@pytest.mark.parametrize("out_dtype", [None, torch.float32, BF16, torch.float16])
def test_the_torch_fallback_steps_a_bf16_master_to_the_kernels_bits(state, out_dtype):
    for n in (1, 17, 70_001):  # scalar tails, vector bodies, several OpenMP blocks
        p, g, m, v = start(n, seed=n)
        p, m, v = p.to(BF16), m.to(state), v.to(state)
        q, mm, vv = p.clone(), m.clone(), v.clone()
        o1, o2 = ((torch.empty(n, dtype=out_dtype), torch.empty(n, dtype=out_dtype)) if out_dtype else (None, None))
        for step in (1, 2, 3):
            kw = dict(factor=0.7, lr=3e-4, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, step=step,
                      key=step * 977, offset=2**32 - 30)
            K.adamw(p, g, m, v, o1, **kw)
            TorchLean().adamw(q, g, mm, vv, o2, **kw)
        assert torch.equal(bits(p), bits(q)) and torch.equal(bits(m), bits(mm)) and torch.equal(bits(v), bits(vv)), n
        assert out_dtype is None or torch.equal(bits(o1), bits(o2)), n


@needs_kernels
def test_the_torch_fallback_steps_bf16_moments_and_an_fp32_master_to_the_kernels_bits():
    p, g, m, v = start(70_001, seed=4)  # its square root correctly rounded as the kernels': the same weight bits
    q, mm, vv = p.clone(), m.clone(), v.clone()
    for step in (1, 2):
        kw = dict(factor=1.0, lr=3e-4, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, step=step, key=step, offset=0)
        K.adamw(p, g, m, v, None, **kw)
        TorchLean().adamw(q, g, mm, vv, None, **kw)
    assert torch.equal(p, q) and torch.equal(bits(m), bits(mm)) and torch.equal(bits(v), bits(vv))


@needs_kernels
@pytest.mark.parametrize("momentum, nesterov, wd", [(0.0, False, 0.0), (0.9, False, 0.01), (0.9, True, 0.01)])
def test_sgd_steps_a_bf16_master_with_the_same_bits_in_the_kernel_and_the_fallback(momentum, nesterov, wd):
    n = 70_001
    p, g, _, _ = start(n, seed=5)
    p = p.to(BF16)
    q = p.clone()
    b1 = torch.randn(n) if momentum else None
    b2 = b1.clone() if momentum else None
    ref = p.clone()
    for step in range(3):
        kw = dict(factor=0.5, lr=1e-2, momentum=momentum, weight_decay=wd, nesterov=nesterov, first=step == 0,
                  key=step + 5, offset=3)
        K.sgd(p, g, b1, None, **kw)
        TorchLean().sgd(q, g, b2, None, **kw)
        if not momentum:  # plain SGD: the float32 step, then the master's rounding
            ref = ref_master_round(ref.float() - 1e-2 * (g * 0.5), step + 5, 3)
            assert torch.equal(bits(p), bits(ref))
    assert torch.equal(bits(p), bits(q)) and (not momentum or torch.equal(b1, b2))


def test_a_bf16_master_rounds_tiny_updates_unbiased_and_the_same_every_run():
    # a constant update of a quarter ulp: round to nearest keeps every weight, stochastic rounding moves
    # about a quarter of them by one ulp each step, so the mean follows the float32 trajectory
    n, steps, ulp = 50_000, 40, 2**-13  # weights in [2**-6, 2**-5), where a bf16 ulp is 2**-13
    w0 = torch.full((n,), 1 / 64 + 8 * ulp)
    g = torch.ones(n)

    def run(seed: int) -> torch.Tensor:
        p = w0.to(BF16)
        for step in range(1, steps + 1):
            TorchLean().sgd(p, g, None, None, factor=1.0, lr=ulp / 4, momentum=0.0, weight_decay=0.0,
                            nesterov=False, first=step == 1, key=rounding_key(seed, 0, step), offset=0)
        return p
    a, b, c = run(1), run(1), run(2)
    assert torch.equal(bits(a), bits(b)) and not torch.equal(bits(a), bits(c))  # seeded: deterministic
    expected = (w0 - steps * ulp / 4).mean().item()  # float32: 10 ulps down
    assert abs(a.float().mean().item() - expected) < 0.05 * ulp  # unbiased to a twentieth of an ulp
    assert w0.to(BF16).float().sub(ulp / 4).to(BF16).float().equal(w0)  # to nearest: never moves



def master_state(impl: str, seed: int = 0, master=BF16, state=BF16, sgd: bool = False, **kw) -> HostState:
    """`groups_state`'s parameters with a bf16 (or fp32) master: AdamW, or SGD with Nesterov momentum."""
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=g)) for n, s in SHAPES.items()}
    opt = (rpcompile.SGD(lr=1e-2, momentum=0.9, nesterov=True, max_grad_norm=1.0, impl=impl, master_dtype=master)
           if sgd else rpcompile.AdamW(lr=1e-2, max_grad_norm=1.0, impl=impl, state_dtype=state, master_dtype=master))
    return HostState(params, {n: (l,) for l, n in enumerate(params)}, len(params), seed=seed, optimizer=opt, **kw)


@needs_kernels
@pytest.mark.parametrize("sgd", [False, True], ids=["adamw", "sgd"])
def test_host_state_steps_a_bf16_master_with_the_same_bits_with_the_kernels_and_with_torch(sgd):
    a, b = master_state("fused", sgd=sgd), master_state("foreach", sgd=sgd)
    assert all(t.dtype == BF16 for t in a.flat.masters) and all(t.dtype == BF16 for t in b.flat.masters)
    run_steps(a, range(3))
    run_steps(b, range(3), copy=False)  # the kernels write the copies in the update's pass, torch casts after
    for n in SHAPES:
        assert torch.equal(bits(a.master[n]), bits(b.master[n])), n
        assert torch.equal(a.compute[n], b.compute[n]) and torch.equal(a.compute[n], a.master[n].float()), n
        for k, t in a.flat.moment[n].items():
            assert torch.equal(bits(t), bits(b.flat.moment[n][k])), (n, k)


def test_a_bf16_master_is_its_own_buffer_so_a_step_leaves_the_compute_copy_to_copy():
    # staleness 1 (rule R1): the step writes the master while the compute copy still holds the version that
    # the next iteration's uploads read; only copy() overwrites it
    s = master_state("foreach")
    assert all(torch.equal(s.compute[n], s.master[n].float()) for n in SHAPES)  # the copies start as the master
    before = {n: s.compute[n].clone() for n in SHAPES}
    for n, p in s.master.items():
        s.accumulate_grad(n, torch.ones(p.shape))
    for l in range(len(SHAPES)):
        s.grads_complete(l)  # all of them first: the clipping's global norm waits for every group
    for l in range(len(SHAPES)):
        s.step(l)
    for n in SHAPES:
        assert s.compute[n].data_ptr() != s.master[n].data_ptr()
        assert torch.equal(s.compute[n], before[n]) and not torch.equal(s.master[n].float(), before[n]), n
    for l in range(len(SHAPES)):
        s.copy(l)
    assert all(torch.equal(s.compute[n], s.master[n].float()) for n in SHAPES)
    assert all(t.dtype == torch.float32 for t in s.parameters_fp32().values())


@pytest.mark.parametrize("impl", [pytest.param("fused", marks=needs_kernels), "foreach"])
@pytest.mark.parametrize("sgd", [False, True], ids=["adamw", "sgd"])
def test_a_bf16_master_state_dict_keeps_it_as_it_is_and_resumes_bit_for_bit(impl, sgd):
    whole = master_state(impl, seed=3, sgd=sgd)
    run_steps(whole, range(2))
    sd = whole.state_dict()
    assert all(t.dtype == BF16 for t in sd["master"].values())  # not widened
    assert sd["rounding"]["seed"] == 3
    run_steps(whole, range(2, 4))
    resumed = master_state(impl, seed=99, sgd=sgd)  # another seed and other weights: the state dict brings its own
    resumed.load_state_dict(sd)
    run_steps(resumed, range(2, 4))
    for n in SHAPES:
        assert torch.equal(bits(resumed.master[n]), bits(whole.master[n])), n
        assert torch.equal(resumed.compute[n], whole.compute[n]), n
        for k, t in whole.flat.moment[n].items():
            assert torch.equal(bits(resumed.flat.moment[n][k]), bits(t)), (n, k)


@pytest.mark.parametrize("saved, loading", [(BF16, torch.float32), (torch.float32, BF16)])
def test_a_state_dict_of_another_master_dtype_is_refused_in_one_line_naming_both(saved, loading):
    src = master_state("foreach", master=saved, state=torch.float32)
    run_steps(src, range(1), copy=False)
    dst = master_state("foreach", master=loading, state=torch.float32)
    before = {n: t.clone() for n, t in dst.master.items()}
    with pytest.raises(ValueError) as err:
        dst.load_state_dict(src.state_dict())
    msg = str(err.value)
    assert "\n" not in msg and f"master_dtype={saved}" in msg and f"master_dtype={loading}" in msg, msg
    assert "--master-dtype" in msg, msg
    assert all(torch.equal(dst.master[n], t) for n, t in before.items())  # nothing changed


def test_default_master_dtype_is_float32_and_other_dtypes_are_refused_naming_the_field():
    assert rpcompile.AdamW().master_dtype == rpcompile.SGD(lr=0.1).master_dtype == torch.float32
    st = master_state("foreach", master=torch.float32)  # beside bf16 moments: split (runtime/host/lean.py)
    assert st.flat.master_dtype == torch.float32 and all(t.dtype == torch.float32 for t in st.master.values())
    for make in (rpcompile.AdamW, lambda **k: rpcompile.SGD(lr=0.1, **k)):
        for bad in (torch.float16, "bf16", torch.float64):
            with pytest.raises(ValueError, match=r"(AdamW|SGD): master_dtype must be torch.float32 or torch.bfloat16"):
                make(master_dtype=bad)
    with pytest.raises(ValueError, match="master_dtype=torch.bfloat16"):  # torch's optimizers update fp32 tensors
        rpcompile.ir.optim.make_torch_optimizer(rpcompile.SGD(lr=0.1, master_dtype=BF16), [torch.zeros(2)])


def train_small_steps(optimizer, steps: int = 150) -> tuple[float, float]:
    """(first loss, final loss) of a linear student fitting a teacher with AdamW at lr 3e-5 through a HostState.

    The weights are 0.02-0.03 in size (bf16-exact), where half a bf16 ulp is 6.1e-5: every update (at most
    about lr) is below it. The teacher is 0.01-0.02 away per weight, more than 150 steps can move.
    """
    g = torch.Generator().manual_seed(0)
    sign = lambda: torch.randint(0, 2, (32, 64), generator=g) * 2.0 - 1  # noqa: E731
    w0 = ((torch.rand(32, 64, generator=g) * 0.01 + 0.02) * sign()).to(BF16).float()
    teacher = w0 + (torch.rand(32, 64, generator=g) * 0.01 + 0.01) * sign()
    x = torch.randn(256, 64, generator=g)
    y = x @ teacher.T
    s = HostState({"w": torch.nn.Parameter(w0.clone())}, {"w": (0,)}, 1, optimizer=optimizer, seed=11)
    loss = lambda w: ((x @ w.T - y) ** 2).mean()  # noqa: E731
    first = loss(s.compute["w"]).item()
    for _ in range(steps):
        w = s.compute["w"].detach().requires_grad_()
        loss(w).backward()
        s.accumulate_grad("w", w.grad)
        s.grads_complete(0)
        s.step(0)
        s.copy(0)
    return first, loss(s.master["w"].float()).item()


def test_a_bf16_master_trains_like_fp32_where_round_to_nearest_learns_nothing(monkeypatch):
    # below half an ulp every update rounds away to nearest; stochastic rounding keeps it in expectation
    adamw = lambda **kw: rpcompile.AdamW(lr=3e-5, weight_decay=0.0, impl="foreach", **kw)  # noqa: E731
    f0, f1 = train_small_steps(adamw())
    drop = f0 - f1
    assert drop > 0.1 * f0  # the fp32 state learns
    for lean in (dict(master_dtype=BF16), dict(master_dtype=BF16, state_dtype=BF16)):
        l0, l1 = train_small_steps(adamw(**lean))
        assert l0 == f0 and l0 - l1 >= 0.9 * drop and abs(l1 - f1) <= 0.01 * f1, (lean, l0 - l1, drop, l1, f1)
    # the same bf16 master rounded to nearest (ties away): every weight's update rounds away, nothing is learned
    monkeypatch.setattr(lean_mod, "random_bits", lambda offset, n, key: torch.full((n,), 0x80008000))
    n0, n1 = train_small_steps(adamw(master_dtype=BF16))
    assert n0 - n1 < 0.1 * drop, (n0 - n1, drop)


@needs_kernels
@pytest.mark.parametrize("master, state, grad", [(BF16, BF16, torch.float32), (BF16, torch.float32, BF16),
                                                 (torch.float32, BF16, torch.float32),
                                                 (torch.float32, torch.float32, torch.float32)])
def test_an_out_of_place_step_reads_the_source_writes_the_destination_and_equals_the_step_in_place(master, state,
                                                                                                  grad):
    # the alternating copies (runtime/host/layout.py `Alternation`): the master read from one buffer, written to the other;
    # the kernels' vector body, its scalar tail and the torch fallback all the same bits as the step in place
    for n in (17, 70_001):
        p, g, m, v = start(n, seed=n + 1)
        p, g, m, v = p.to(master), g.to(grad), m.to(state), v.to(state)
        for opt in (K, TorchLean()):
            src, dst = p.clone(), torch.full_like(p, 7.0)
            inplace, m1, v1, m2, v2 = p.clone(), m.clone(), v.clone(), m.clone(), v.clone()
            kw = dict(factor=0.7, lr=3e-4, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, step=2, key=99, offset=5)
            opt.adamw(inplace, g, m1, v1, None, **kw)
            opt.adamw(dst, g, m2, v2, None, src=src, **kw)
            assert torch.equal(bits(dst), bits(inplace)) and torch.equal(bits(src), bits(p)), (n, opt)
            assert torch.equal(bits(m1), bits(m2)) and torch.equal(bits(v1), bits(v2)), (n, opt)
            if master == BF16:
                src, dst, inplace = p.clone(), torch.zeros_like(p), p.clone()
                b1, b2 = torch.ones(n), torch.ones(n)
                skw = dict(factor=0.5, lr=1e-2, momentum=0.9, weight_decay=0.01, nesterov=False, first=False,
                           key=3, offset=1)
                opt.sgd(inplace, g, b1, None, **skw)
                opt.sgd(dst, g, b2, None, src=src, **skw)
                assert torch.equal(bits(dst), bits(inplace)) and torch.equal(bits(src), bits(p)), (n, opt)
                assert torch.equal(b1, b2)
    p = torch.zeros(64, dtype=BF16)
    with pytest.raises(ValueError, match="overlaps"):
        K.adamw(p[8:40], torch.zeros(32), torch.zeros(32), torch.zeros(32), None, factor=1.0, lr=1e-3,
                betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, step=1, src=p[0:32])
