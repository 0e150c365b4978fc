"""The host kernels' non-temporal stores (a buffer written whole, 1 MiB or more, goes around the cache): the same bits
as the stores through the cache, in the scalar head before the first 64-byte boundary, the vector body and the
tail, and nothing written outside the view."""
from __future__ import annotations

import pytest
import torch

from rpcompile.runtime.host import kernels as kmod
from tests.runtime.host.test_kernels import specials

K = kmod.load_kernels()
pytestmark = pytest.mark.skipif(K is None, reason="no C++ compiler: the kernels cannot be built")
BF16 = torch.bfloat16
N = 700_001  # 1.4 MB of bf16 (streamed); a view 3 elements into its buffer: a scalar head, blocks of 32, a tail
CHUNK = 100_000  # a reference call's elements: 200 kB of bf16, written through the cache


def threads(n: int):
    """Run the body with n torch threads (the kernels' OpenMP threads)."""
    class Threads:
        def __enter__(self):
            self.old = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.old)
    return Threads()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaNs included (as 16- or 32-bit patterns)."""
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a.view(bits), b.view(bits))


@pytest.mark.parametrize("threads_n", [1, 2])
@pytest.mark.parametrize("src_dtype", [torch.float32, BF16])  # an fp32 master's copy, a bf16 master's
def test_a_large_bf16_copy_written_around_the_cache_has_the_same_bits_and_stays_in_its_view(src_dtype, threads_n):
    x = specials(N, seed=3)
    x[[1, 40, 1000, N // 2, N - 5]] = float("nan")
    x = x.to(src_dtype)
    whole = torch.full((N + 10,), -7.0, dtype=BF16)
    out = whole[3:3 + N]
    with threads(threads_n):
        K.cast(x, out)
    ref = x.to(BF16)
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int16), ref[~nan].view(torch.int16))
    assert (whole[:3] == -7).all() and (whole[3 + N:] == -7).all()  # nothing written outside the view


def adam_buffers(state: torch.dtype, master: torch.dtype, seed: int) -> list[torch.Tensor]:
    """p, g, m, v of N elements (v > 0), with a NaN gradient in the head, the body and the tail."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(N, generator=gen).to(master)
    g = torch.randn(N, generator=gen) * 1e-2
    g[[2, 5000, N - 7]] = float("nan")
    m = (torch.randn(N, generator=gen) * 1e-3).to(state)
    v = (torch.rand(N, generator=gen) * 1e-5).to(state)
    return [p, g, m, v]


@pytest.mark.parametrize("threads_n", [1, 2])
@pytest.mark.parametrize("state,master", [(torch.float32, torch.float32), (BF16, torch.float32), (BF16, BF16),
                                          (torch.float32, BF16)])
def test_the_update_streams_a_large_bf16_copy_with_the_bits_of_calls_through_the_cache(state, master, threads_n):
    # the reference steps the same buffers in calls of CHUNK elements (each under 1 MiB of copy: not streamed; the
    # fp32 state's: the plain fp32 kernel) at their element offsets, so the rounding draws are the same ones
    kw = dict(factor=0.5, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=3, key=12345)
    ours, ref = adam_buffers(state, master, 1), adam_buffers(state, master, 1)
    whole = torch.full((N + 10,), -7.0, dtype=BF16)
    out, ref_out = whole[3:3 + N], torch.empty(N, dtype=BF16)
    with threads(threads_n):
        K.adamw(*ours, out, offset=64, **kw)
    for lo in range(0, N, CHUNK):
        hi = min(N, lo + CHUNK)
        K.adamw(*(t[lo:hi] for t in ref), ref_out[lo:hi], offset=64 + lo, **kw)
    assert all(same_bits(a, b) for a, b in zip(ours, ref))
    assert same_bits(out, ref_out)
    assert out[2].isnan() and out[N - 7].isnan()  # the NaN lanes in the head and the tail
    assert (whole[:3] == -7).all() and (whole[3 + N:] == -7).all()  # nothing written outside the view


@pytest.mark.parametrize("src_dtype", [BF16, torch.float32, torch.float16])  # fp16 takes the loop through the cache
def test_a_large_first_landing_streams_the_gradient_and_takes_its_statistics(src_dtype):
    n = 300_001  # 1.2 MB of fp32: streamed from the view's first 64-byte boundary (3 floats in: a scalar head)
    src = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(src_dtype)
    whole = torch.full((n + 10,), -7.0)
    dst = whole[3:3 + n]
    with threads(1):
        sq, bad = K.land(dst, src, add=False)
    assert torch.equal(dst, src.float()) and not bad
    assert (whole[:3] == -7).all() and (whole[3 + n:] == -7).all()  # nothing written outside the view
    assert sq == pytest.approx(float((src.double() ** 2).sum()), rel=1e-12)
    with threads(2):  # fixed blocks: the same sum with any thread count
        assert K.land(whole[3:3 + n], src, add=False) == (sq, bad)
    for at in (1, 64, 4096, n - 2):  # the head, the first vector, a later block, the tail
        for special in (float("inf"), float("nan")):
            part = src.clone()
            part[at] = special
            assert K.land(dst, part, add=False)[1], (at, special)
            assert dst[at].isnan() if special != special else dst[at] == special


@pytest.mark.parametrize("threads_n", [1, 2])
@pytest.mark.parametrize("state", [torch.float32, BF16])
def test_a_bf16_master_stepped_out_of_place_streams_the_new_one_with_the_bits_of_calls_through_the_cache(
        state, threads_n):
    # the alternating copies' shared buffers (runtime/host/layout.py): no copy, the new master written whole into a
    # view 3 elements into the other buffer; the reference steps it in CHUNK-element calls
    kw = dict(factor=0.5, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=3, key=999)
    src, g, m, v = adam_buffers(state, BF16, 2)
    ref_m, ref_v = m.clone(), v.clone()
    whole = torch.full((N + 10,), -7.0, dtype=BF16)
    dst, ref_dst, before = whole[3:3 + N], torch.empty(N, dtype=BF16), src.clone()
    with threads(threads_n):
        K.adamw(dst, g, m, v, None, offset=5, src=src, **kw)
    for lo in range(0, N, CHUNK):
        hi = min(N, lo + CHUNK)
        K.adamw(ref_dst[lo:hi], g[lo:hi], ref_m[lo:hi], ref_v[lo:hi], None, offset=5 + lo, src=src[lo:hi], **kw)
    assert same_bits(dst, ref_dst) and same_bits(m, ref_m) and same_bits(v, ref_v)
    assert same_bits(src, before)  # the source is only read
    assert (whole[:3] == -7).all() and (whole[3 + N:] == -7).all()  # nothing written outside the view


def test_a_large_first_bf16_landing_of_a_bf16_gradient_streams_the_copy_and_takes_its_statistics():
    # grad_dtype=torch.bfloat16: a bf16 gradient's first write is stored exactly (a copy), 1.2 MB of it streamed
    n = 600_001
    src = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(BF16)
    whole = torch.full((n + 40,), -7.0, dtype=BF16)
    dst = whole[3:3 + n]
    with threads(1):
        sq, bad = K.land(dst, src, add=False, key=77, offset=3)
    assert same_bits(dst, src) and not bad
    assert (whole[:3] == -7).all() and (whole[3 + n:] == -7).all()  # nothing written outside the view
    assert sq == pytest.approx(float((src.double() ** 2).sum()), rel=1e-12)
    with threads(2):  # fixed blocks: the same sum with any thread count
        assert K.land(whole[3:3 + n], src, add=False, key=77, offset=3) == (sq, bad)
    for at in (1, 64, 4096, n - 2):  # the head, the first vector, a later block, the tail
        part = src.clone()
        part[at] = float("nan")
        assert K.land(dst, part, add=False, key=77, offset=3)[1], at
        assert same_bits(dst, part)
