"""bf16 host gradients (`grad_dtype=torch.bfloat16`): landing (the float32 sum stored with stochastic rounding,
a single bf16 write exact, its own bits per write), the update kernels reading a bf16 gradient (kernel and torch
fallback, the same bits), HostState bit for bit with and without the kernels, the data-parallel average, resume,
the config check and a small training run with two accumulation rounds per iteration."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import rpcompile
from rpcompile.runtime.host import lean as lean_mod
from rpcompile.runtime.host.lean import TorchLean, grad_key
from rpcompile.runtime.host.optimizer import HostState
from tests.runtime.host.test_lean import BF16, SHAPES, K, needs_kernels, ref_hash, ref_key, ref_round, start
from tests.runtime.host.test_lean_master import bits

LAND_IMPLS = [pytest.param("kernel", marks=needs_kernels), "torch"]


def ref_grad_key(seed: int, group: int, iteration: int, write: int) -> int:
    """grad_key as documented: rounding_key(seed, group, iteration), salted with 0x85EBCA77, then the write."""
    h = lambda v: int(ref_hash(np.array([v & 0xFFFFFFFF], dtype=np.uint64))[0])  # noqa: E731
    return h(h(ref_key(seed, group, iteration) ^ 0x85EBCA77) ^ write)


def ref_land(dst: torch.Tensor, src: torch.Tensor, add: bool, key: int, offset: int, divisor: float = 1.0):
    """The float32 sum (and division), then the documented rounding: the low 16 bits of hash32(offset + i ^ key)."""
    x = (dst.float() + src.float()) if add else src.float()
    x = x / divisor if divisor != 1.0 else x
    r = ref_hash(np.arange(offset, offset + x.numel(), dtype=np.uint64) & 0xFFFFFFFF ^ key)
    return ref_round(x, r & np.uint32(0xFFFF))


def land_with(impl: str):
    return K.land if impl == "kernel" else lean_mod.land


@pytest.mark.parametrize("impl", LAND_IMPLS)
@pytest.mark.parametrize("src_dtype", [torch.float32, BF16, torch.float16])
def test_a_bf16_gradient_is_the_float32_sum_rounded_stochastically_with_its_statistics(impl, src_dtype):
    for n in (1, 17, 70_001):  # scalar tails, vector bodies, several OpenMP blocks
        g = torch.Generator().manual_seed(n)
        dst = torch.randn(n, generator=g).to(BF16)
        src = torch.randn(n, generator=g).to(src_dtype)
        for add, divisor in ((False, 1.0), (True, 1.0), (True, 3.0)):
            out = dst.clone()
            sq, bad = land_with(impl)(out, src, add=add, key=977 * n, offset=2**32 - 5, divisor=divisor)
            ref = ref_land(dst, src, add, 977 * n, 2**32 - 5, divisor)
            assert torch.equal(bits(out), bits(ref)), (n, add, divisor)
            assert sq == pytest.approx(float(ref.double().square().sum()), rel=1e-12) and not bad  # the stored values'
    nan = torch.tensor([1.0, float("nan"), 2.0], dtype=BF16)
    assert land_with(impl)(torch.zeros(3, dtype=BF16), nan, add=False, key=1, offset=0)[1]


@pytest.mark.parametrize("impl", LAND_IMPLS)
def test_one_bf16_write_is_stored_exactly_and_each_write_draws_its_own_bits(impl):
    src = torch.randn(70_001, generator=torch.Generator().manual_seed(1)).to(BF16)
    src[3], src[5] = float("nan"), float("-inf")  # kept as they are too
    dst = torch.empty_like(src)
    land_with(impl)(dst, src, add=False, key=grad_key(3, 0, 0, 0), offset=0)
    assert torch.equal(bits(dst), bits(src))  # a device's bf16 gradient that lands once keeps its bits
    sums = []
    for write in (1, 2):  # the same sum, two writes: other keys, other rounding decisions
        out = dst.clone()
        land_with(impl)(out, src * 1.37, add=True, key=grad_key(3, 0, 0, write), offset=0)
        sums.append(out)
    assert not torch.equal(bits(sums[0]), bits(sums[1]))
    keys = {grad_key(3, g, it, w) for g in range(3) for it in range(3) for w in range(3)}
    assert len(keys) == 27 and grad_key(3, 1, 2, 1) == ref_grad_key(3, 1, 2, 1)


def test_stochastic_accumulation_keeps_the_small_rounds_that_round_to_nearest_drops():
    # one large round and 15 rounds each a quarter ulp of the running sum: to nearest never moves the sum, the
    # stochastic sums keep the small rounds in expectation
    n, big, small = 50_000, torch.full((50_000,), 1.0, dtype=BF16), torch.full((50_000,), 2**-7 / 4, dtype=BF16)
    exact = 1.0 + 15 * 2**-7 / 4

    def accumulate(rn: bool) -> torch.Tensor:
        buf = torch.empty(n, dtype=BF16)
        lean_mod.land(buf, big, add=False, key=grad_key(0, 0, 0, 0), offset=0)
        for w in range(1, 16):
            if rn:
                buf.copy_((buf.float() + small.float()).to(BF16))
            else:
                lean_mod.land(buf, small, add=True, key=grad_key(0, 0, 0, w), offset=0)
        return buf.float()
    assert torch.equal(accumulate(rn=True), big.float())  # every small round rounded away
    assert abs(accumulate(rn=False).mean().item() - exact) < 0.01 * 15 * 2**-7 / 4  # unbiased within 1% of them


@needs_kernels
@pytest.mark.parametrize("master, state", [(torch.float32, torch.float32), (torch.float32, BF16),
                                           (BF16, torch.float32), (BF16, BF16)])
def test_adamw_reads_a_bf16_gradient_as_its_widened_float32_with_the_same_bits_in_kernel_and_fallback(master, state):
    for n in (1, 17, 70_001):
        p, g, m, v = start(n, seed=n)
        g16 = g.to(BF16)
        p, m, v = p.to(master), m.to(state), v.to(state)
        runs = [(p.clone(), m.clone(), v.clone(), torch.empty(n, dtype=BF16)) for _ in range(3)]
        for step in (1, 2):
            kw = dict(factor=0.7, lr=3e-4, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, step=step,
                      key=step * 31, offset=2**32 - 30)
            K.adamw(runs[0][0], g16, runs[0][1], runs[0][2], runs[0][3], **kw)
            TorchLean().adamw(runs[1][0], g16, runs[1][1], runs[1][2], runs[1][3], **kw)
            K.adamw(runs[2][0], g16.float(), runs[2][1], runs[2][2], runs[2][3], **kw)  # the widened gradient
        for other in runs[1:]:
            assert all(torch.equal(bits(a), bits(b)) for a, b in zip(runs[0], other)), n


def bits_any(t: torch.Tensor) -> torch.Tensor:
    return bits(t) if t.dtype == BF16 else t.view(torch.int32)


@needs_kernels
@pytest.mark.parametrize("master", [torch.float32, BF16])
@pytest.mark.parametrize("momentum, nesterov, wd", [(0.0, False, 0.0), (0.9, True, 0.01)])
def test_sgd_reads_a_bf16_gradient_with_the_same_bits_in_kernel_and_fallback(master, momentum, nesterov, wd):
    n = 70_001
    p, g, _, _ = start(n, seed=5)
    g16, p = g.to(BF16), p.to(master)
    runs = [(p.clone(), torch.randn(n) if momentum else None) for _ in range(3)]
    for r in runs[1:]:
        if momentum:
            r[1].copy_(runs[0][1])
    for step in range(3):
        kw = dict(factor=0.5, lr=1e-2, momentum=momentum, weight_decay=wd, nesterov=nesterov, first=step == 0,
                  key=step + 5, offset=3)
        K.sgd(runs[0][0], g16, runs[0][1], None, **kw)
        TorchLean().sgd(runs[1][0], g16, runs[1][1], None, **kw)
        K.sgd(runs[2][0], g16.float(), runs[2][1], None, **kw)
    for other in runs[1:]:
        assert torch.equal(bits_any(runs[0][0]), bits_any(other[0]))
        assert momentum == 0 or torch.equal(runs[0][1], other[1])


def grad_state(impl: str, seed: int = 0, sgd: bool = False, lean: bool = True, **kw) -> HostState:
    """`SHAPES` (odd) in three groups with bf16 gradients (and bf16 moments and master with `lean`), clipping on."""
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=g)) for n, s in SHAPES.items()}
    extra = dict(master_dtype=BF16) if lean else {}
    opt = (rpcompile.SGD(lr=1e-2, momentum=0.9, max_grad_norm=1.0, impl=impl, grad_dtype=BF16, **extra) if sgd
           else rpcompile.AdamW(lr=1e-2, max_grad_norm=1.0, impl=impl, grad_dtype=BF16,
                                **(dict(extra, state_dtype=BF16) if lean else {})))
    return HostState(params, {n: (l,) for l, n in enumerate(params)}, len(params), seed=seed, optimizer=opt, **kw)


def run_rounds(state: HostState, steps: range, rounds: int = 3, copy: bool = True) -> None:
    """Seeded bf16 gradients, `rounds` writes per parameter and iteration, then grads_complete and step."""
    for t in steps:
        g = torch.Generator().manual_seed(100 + t)
        for _ in range(rounds):
            for n, p in state.master.items():
                state.accumulate_grad(n, torch.randn(p.shape, generator=g).to(BF16))
        for l in reversed(range(len(state.groups))):
            state.grads_complete(l)
        for l in range(len(state.groups)):
            state.step(l, copy=copy)
            state.copy(l)


def snapshot(state: HostState) -> list[torch.Tensor]:
    return ([bits_any(state.master[n]) for n in SHAPES] + [bits_any(state.compute[n]) for n in SHAPES]
            + [bits_any(t) for m in state.flat.moments for t in m.values()])


@needs_kernels
@pytest.mark.parametrize("sgd, lean", [(False, True), (False, False), (True, True)], ids=["adamw-10B", "adamw", "sgd"])
def test_host_state_with_bf16_gradients_steps_the_same_bits_with_the_kernels_and_with_torch(sgd, lean):
    a, b = grad_state("fused", sgd=sgd, lean=lean), grad_state("foreach", sgd=sgd, lean=lean)
    assert all(t.dtype == BF16 for t in a.flat.grads) and all(t.dtype == BF16 for t in b.flat.grads)
    run_rounds(a, range(3))
    run_rounds(b, range(3), copy=False)
    assert all(torch.equal(x, y) for x, y in zip(snapshot(a), snapshot(b)))
    assert a.norms == b.norms  # the clipping norms: fp64 sums of the stored values, in the same order


@needs_kernels
def test_bf16_gradients_under_a_dynamic_loss_scale_unscale_and_skip_with_the_same_bits_with_and_without_kernels():
    scale = lambda: rpcompile.DynamicLossScale(init_scale=2.0**10, growth_interval=2)  # noqa: E731
    a, b = grad_state("fused", loss_scale=scale()), grad_state("foreach", loss_scale=scale())
    for s in (a, b):
        for t in range(4):
            s.begin_iteration()
            g = torch.Generator().manual_seed(t)
            for n, p in s.master.items():
                x = torch.randn(p.shape, generator=g) * s.loss_scale
                if t == 2 and n == "b":
                    x.view(-1)[3] = float("inf")  # iteration 2 overflows: skipped
                assert s.accumulate_grad(n, x.to(BF16)) == (t != 2 or n != "b")
            for l in reversed(range(len(s.groups))):
                s.grads_complete(l)
            for l in range(len(s.groups)):
                s.step(l)
                s.copy(l)
    assert a.skipped == b.skipped == [2] and a.loss_scale == b.loss_scale
    assert all(torch.equal(x, y) for x, y in zip(snapshot(a), snapshot(b)))


def test_bf16_gradient_accumulation_is_seeded_and_its_sum_is_the_reference():
    s = grad_state("foreach", seed=4)
    g = [torch.randn(SHAPES["a"], generator=torch.Generator().manual_seed(i)).to(BF16) for i in range(3)]
    for x in g:
        s.accumulate_grad("a", x)
    ref = g[0]  # the first write exact, then each sum rounded with its write's key
    for w, x in enumerate(g[1:], start=1):
        ref = ref_land(ref.view(-1), x.view(-1), True, ref_grad_key(4, 0, 0, w), s.layout.master["a"])
    assert torch.equal(bits(s.grad["a"].view(-1)), bits(ref))
    again, other = grad_state("foreach", seed=4), grad_state("foreach", seed=5)
    for x in g:
        again.accumulate_grad("a", x), other.accumulate_grad("a", x)
    assert torch.equal(bits(again.grad["a"]), bits(s.grad["a"])) and not torch.equal(bits(other.grad["a"]),
                                                                                      bits(s.grad["a"]))


@pytest.mark.parametrize("impl", [pytest.param("fused", marks=needs_kernels), "foreach"])
def test_a_run_with_bf16_gradients_resumes_bit_for_bit(impl):
    whole = grad_state(impl)
    run_rounds(whole, range(4))
    first = grad_state(impl)
    run_rounds(first, range(2))
    resumed = grad_state(impl, seed=9)  # the checkpoint's seed replaces it
    resumed.load_state_dict(first.state_dict())
    run_rounds(resumed, range(2, 4))
    assert all(torch.equal(x, y) for x, y in zip(snapshot(whole), snapshot(resumed)))


@pytest.mark.parametrize("impl", [pytest.param("fused", marks=needs_kernels), "foreach"])
def test_the_data_parallel_average_of_bf16_gradients_is_summed_in_float32_and_rounded_stochastically(impl):
    s = grad_state(impl, seed=2)
    for n, p in s.master.items():
        s.accumulate_grad(n, torch.randn(p.shape, generator=torch.Generator().manual_seed(7)).to(BF16))
    before = s.flat.grads[1].clone()
    other = torch.randn(before.numel(), generator=torch.Generator().manual_seed(8))  # the other process's sum
    seen = []

    def all_reduce(flat: torch.Tensor) -> None:
        seen.append(flat.dtype)
        flat.add_(other)
    s.average_grads(1, 2, all_reduce)
    assert seen == [torch.float32]  # gloo sums the widened copy
    off, n = s.layout.master["b"], s.grad["b"].numel()
    wide = before[off:off + n].float() + other[off:off + n]
    ref = ref_land(torch.zeros(n, dtype=BF16), wide, False, ref_grad_key(2, 1, 0, 0xFFFFFFFF), off, divisor=2)
    assert torch.equal(bits(s.grad["b"].view(-1)), bits(ref))
    assert s._sq["b"] == pytest.approx(float(ref.double().square().sum()), rel=1e-12)


def test_default_grad_dtype_is_float32_and_other_dtypes_are_refused_naming_the_field():
    assert rpcompile.AdamW().grad_dtype == rpcompile.SGD(lr=0.1).grad_dtype == torch.float32
    s = HostState({"w": torch.nn.Parameter(torch.ones(3))}, {"w": (0,)}, 1, optimizer=rpcompile.AdamW())
    assert s.flat.grads[0].dtype == torch.float32
    for make in (rpcompile.AdamW, lambda **k: rpcompile.SGD(lr=0.1, **k)):
        for bad in (torch.float16, "bf16"):
            with pytest.raises(ValueError, match=r"(AdamW|SGD): grad_dtype must be torch.float32 or torch.bfloat16"):
                make(grad_dtype=bad)


def train_rounds(optimizer, steps: int = 150, rounds: int = 2) -> tuple[float, float]:
    """`test_lean_master.train_small_steps`'s student and teacher at lr 3e-5, the batch split into `rounds`
    accumulation rounds per iteration, each round's gradient written as bf16 (a bf16 device's)."""
    g = torch.Generator().manual_seed(0)
    sign = lambda: torch.randint(0, 2, (32, 64), generator=g) * 2.0 - 1  # noqa: E731
    w0 = ((torch.rand(32, 64, generator=g) * 0.01 + 0.02) * sign()).to(BF16).float()
    teacher = w0 + (torch.rand(32, 64, generator=g) * 0.01 + 0.01) * sign()
    x = torch.randn(256, 64, generator=g)
    y = x @ teacher.T
    s = HostState({"w": torch.nn.Parameter(w0.clone())}, {"w": (0,)}, 1, optimizer=optimizer, seed=11)
    loss = lambda w, a, b: ((a @ w.T - b) ** 2).mean()  # noqa: E731
    first = loss(s.compute["w"], x, y).item()
    for _ in range(steps):
        for a, b in zip(x.chunk(rounds), y.chunk(rounds)):
            w = s.compute["w"].detach().requires_grad_()
            (loss(w, a, b) / rounds).backward()
            s.accumulate_grad("w", w.grad.to(BF16))
        s.grads_complete(0)
        s.step(0)
        s.copy(0)
    return first, loss(s.master["w"].float(), x, y).item()


def test_bf16_gradients_accumulated_over_two_rounds_train_like_fp32(monkeypatch):
    impl = "fused" if K is not None else "foreach"
    adamw = lambda **kw: rpcompile.AdamW(lr=3e-5, weight_decay=0.0, impl=impl, **kw)  # noqa: E731
    f0, f1 = train_rounds(adamw())
    drop = f0 - f1
    assert drop > 0.1 * f0  # the fp32 state learns
    for lean in (dict(grad_dtype=BF16), dict(grad_dtype=BF16, master_dtype=BF16, state_dtype=BF16)):
        l0, l1 = train_rounds(adamw(**lean))
        assert l0 == f0 and l0 - l1 >= 0.9 * drop and abs(l1 - f1) <= 0.01 * f1, (lean, l0 - l1, drop, l1, f1)
    # round to nearest accumulation (the torch fallback, its bits made ties-away): at two rounds of comparable
    # gradients it is not measurably worse here (AdamW normalises the gradient; its rounding errors are not
    # biased), so this pins only that it also trains: the case it loses is the one above, small rounds on a
    # large sum (test_stochastic_accumulation_keeps_the_small_rounds_that_round_to_nearest_drops)
    monkeypatch.setattr(lean_mod, "random_bits", lambda offset, n, key: torch.full((n,), 0x8000))
    n0, n1 = train_rounds(rpcompile.AdamW(lr=3e-5, weight_decay=0.0, impl="foreach", grad_dtype=BF16))
    assert n0 == f0 and abs(n1 - f1) <= 0.01 * f1, (n1, f1)
