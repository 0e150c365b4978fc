"""Host blocks on huge pages (runtime/host/pinned.py): the advice reaches the kernel before the first touch,
for the optimizer state's buffers and pinned blocks alike, only inside the block, and the values are zeros."""
from __future__ import annotations

import mmap
import os
import re

import pytest
import torch

import rpcompile
from rpcompile.runtime.host.optimizer import HostState
from rpcompile.runtime.host.pinned import (HUGE, HUGE_PAGES_ENV, PinnedAllocator, advise_huge, host_buffers, host_zeros,
                                          pinned_buffers)


BIG = 40 << 20  # bytes: above glibc's largest mmap threshold (32 MiB), so a fresh mapping, never reused memory


def mappings() -> list[tuple[int, int, dict[str, str]]]:
    """This process's mappings: (start, end, their /proc/self/smaps fields)."""
    out = []
    with open("/proc/self/smaps") as f:
        for line in f:
            head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                out.append((int(head[1], 16), int(head[2], 16), {}))
            elif ":" in line and out:
                key, value = line.split(":", 1)
                out[-1][2][key] = value.strip()
    return out


def holding(addr: int) -> dict[str, str]:
    """The smaps fields of the mapping that holds `addr`."""
    found = [fields for lo, hi, fields in mappings() if lo <= addr < hi]
    assert found, f"no mapping holds {addr:#x}"
    return found[0]


def vma_flags(addr: int) -> set[str]:
    """The VmFlags of the mapping that holds `addr` ("hg": advised for huge pages, "sh": shared)."""
    return set(holding(addr)["VmFlags"].split())


def kib(fields: dict[str, str], key: str) -> int:
    return int(fields[key].split()[0])


def rss_kib(start: int, end: int) -> int:
    """Rss (KiB) of the mappings that overlap [start, end)."""
    return sum(kib(fields, "Rss") for lo, hi, fields in mappings() if lo < end and start < hi)


def vmstat(name: str) -> int:
    """A counter of /proc/vmstat."""
    with open("/proc/vmstat") as f:
        return next(int(line.split()[1]) for line in f if line.split()[0] == name)


def interior(t: torch.Tensor) -> tuple[int, int]:
    """The 2 MiB-aligned interior of t's bytes."""
    p = t.data_ptr()
    return -(-p // HUGE) * HUGE, (p + t.nbytes) // HUGE * HUGE


@pytest.fixture
def thp():
    """Skip where the kernel takes no huge-page advice (not Linux, or no transparent huge pages)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        pytest.skip("no transparent huge pages here")


@pytest.mark.parametrize("n,dtype", [(0, torch.float32), (3, torch.bfloat16), (HUGE // 4 - 1, torch.float32),
                                     (5 * HUGE // 2 + 7, torch.bfloat16), (3 * HUGE + 1, torch.int16)])
def test_host_zeros_are_zeros_of_the_size_and_dtype(n, dtype, monkeypatch):
    for env in ("1", "0"):
        monkeypatch.setenv(HUGE_PAGES_ENV, env)
        t = host_zeros(n, dtype)
        assert t.dtype == dtype and t.shape == (n,) and t.is_contiguous() and not t.any()


@pytest.mark.parametrize("env", ["1", "0"])
def test_small_buffers_share_one_advised_block_each_with_a_storage_of_its_own(thp, monkeypatch, env):
    monkeypatch.setenv(HUGE_PAGES_ENV, env)
    sizes = [HUGE // 8 + 3, 0, *[HUGE // 8] * 40]  # 1 MiB fp32 buffers, 40 MiB in all
    bufs = host_buffers(sizes, torch.float32)
    assert [t.numel() for t in bufs] == sizes and not any(t.any() for t in bufs)
    for t in bufs:
        assert t.untyped_storage().data_ptr() == t.data_ptr() and t.untyped_storage().nbytes() == t.nbytes
        assert t.data_ptr() % 64 == 0  # (each at a cache line: no false sharing between groups' threads)
    big = [t for t in bufs if t.numel()]
    ends = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in big)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # no overlap
    assert rss_kib(ends[0][0], ends[-1][1]) * 1024 >= sum(t.nbytes for t in big) - 4096  # taken now, as torch.zeros
    for t in big:
        t.fill_(1.0)
    assert all(bool((t == 1).all()) for t in big)
    if env == "1":  # one block: every buffer before its last 2 MiB boundary is advised
        assert ends[-1][1] - ends[0][0] < sum(t.nbytes for t in big) + 64 * len(big)
        last = (ends[-1][1] // HUGE) * HUGE
        assert all("hg" in vma_flags(t.data_ptr()) for t in big if t.data_ptr() + t.nbytes <= last)
    else:
        assert "hg" not in vma_flags(big[0].data_ptr())


def test_pinned_buffers_keep_order_and_dtypes(monkeypatch):
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    specs = [(HUGE, torch.float32), (5, torch.bfloat16), (HUGE // 2, torch.float32), (HUGE, torch.bfloat16)]
    bufs = pinned_buffers(specs, False)
    assert [(t.numel(), t.dtype) for t in bufs] == specs and not any(t.any() for t in bufs)


def test_advise_returns_the_aligned_interior(thp):
    block = mmap.mmap(-1, 6 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (not heap memory others reuse)
    t = torch.frombuffer(block, dtype=torch.uint8, count=5 * HUGE + 12345, offset=12345)
    lo, hi = interior(t)
    assert advise_huge(t.data_ptr(), t.nbytes) == hi - lo >= 4 * HUGE
    assert advise_huge(t.data_ptr(), HUGE - 1) == 0  # no whole aligned 2 MiB


def test_large_host_zeros_start_on_a_huge_page_and_are_advised_inside_and_not_outside(thp, monkeypatch):
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    t = host_zeros(BIG // 4 + 100, torch.float32)
    lo, hi = interior(t)
    assert lo == t.data_ptr() == t.untyped_storage().data_ptr() and t.untyped_storage().nbytes() == t.nbytes
    assert "hg" in vma_flags(lo) and "hg" in vma_flags(hi - 1)
    if hi < t.data_ptr() + t.nbytes:  # the tail after the last boundary is not advised: no huge page past the end
        assert "hg" not in vma_flags(hi)


def test_exactly_one_huge_page_of_buffers_is_one_advised_huge_page(thp, monkeypatch):
    """The boundary: buffers of HUGE bytes in all take the block (not torch.zeros), start on a 2 MiB boundary
    and are advised, so they can be one huge page."""
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    for bufs in (host_buffers([HUGE // 4], torch.float32), host_buffers([HUGE // 8] * 2, torch.float32)):
        assert bufs[0].data_ptr() % HUGE == 0 and interior(bufs[-1])[1] == bufs[0].data_ptr() + HUGE
        assert "hg" in vma_flags(bufs[0].data_ptr())


@pytest.mark.parametrize("pinned", [False, True])
def test_the_kernel_gives_the_block_huge_pages(thp, monkeypatch, pinned):
    """Private memory (shared memory follows shmem_enabled, usually never) that faults in as huge pages, unless
    the kernel records that it tried and fell back (no free 2 MiB of physical memory)."""
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[never]" in f.read():
            pytest.skip("transparent huge pages are off here")
    fallbacks = vmstat("thp_fault_fallback")
    t = PinnedAllocator(Checking()).zeros(BIG, torch.uint8) if pinned else host_zeros(BIG, torch.uint8)
    t.fill_(1)
    assert "sh" not in vma_flags(t.data_ptr())
    huge = kib(holding(t.data_ptr()), "AnonHugePages")
    if vmstat("thp_fault_fallback") > fallbacks:
        pytest.skip("the kernel found no free huge page")
    assert huge >= (BIG // HUGE - 1) * HUGE // 1024


@pytest.mark.parametrize("env,calls", [("0", 0), (" 0 ", 0), ("1", 3), ("", 3)])
def test_the_environment_turns_the_advice_off(monkeypatch, env, calls):
    import rpcompile.runtime.host.pinned as pinned
    asked = []
    monkeypatch.setattr(pinned, "advise_huge", lambda ptr, n: asked.append(n) or 0)
    monkeypatch.setenv(HUGE_PAGES_ENV, env)
    host_zeros(BIG // 4, torch.float32)
    host_buffers([HUGE // 8] * 3, torch.float32)
    PinnedAllocator(Checking()).zeros(HUGE, torch.uint8)
    assert len(asked) == calls


def test_the_optimizer_state_lies_on_advised_memory(thp, monkeypatch):
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    params = {"a.weight": torch.nn.Parameter(torch.randn(BIG // 2))}  # bf16 buffers: 40 MiB
    for opt, staleness in ((rpcompile.AdamW(), 0), (rpcompile.AdamW(state_dtype=torch.bfloat16), 1),  # 1: split
                           (rpcompile.AdamW(state_dtype=torch.bfloat16, master_dtype=torch.bfloat16), 0)):
        state = HostState(params, {"a.weight": (0,)}, 1, dtype=torch.bfloat16, optimizer=opt, staleness=staleness)
        flat = state.flat
        buffers = [flat.masters[0], flat.grads[0], *flat.moments[0].values()]
        buffers += [flat.lows[0]] if staleness else []
        buffers += [state.blocks[(0, torch.bfloat16)]]  # the compute copies
        for t in buffers:
            assert "hg" in vma_flags(interior(t)[0]), t.dtype


def test_small_groups_lie_on_advised_memory(thp, monkeypatch):
    """24 groups of 256Ki parameters (1 MiB fp32 buffers): on blocks of their own, none would be advised."""
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    params = {f"l{g}.weight": torch.nn.Parameter(torch.randn(HUGE // 8)) for g in range(24)}
    state = HostState(params, {n: (g,) for g, n in enumerate(params)}, 24, dtype=torch.bfloat16,
                      optimizer=rpcompile.AdamW(state_dtype=torch.bfloat16), staleness=1)
    state.alternate(0)
    flat = state.flat
    kinds = {"masters": flat.masters, "lows": flat.lows, "grads": flat.grads,
             "moments": [m["exp_avg"] for m in flat.moments], "copies": [state.blocks[(g, torch.bfloat16)]
                                                                       for g in range(24)]}
    for kind, bufs in kinds.items():
        assert "hg" in vma_flags(bufs[0].data_ptr()), kind
    fp32 = HostState(params, {n: (g,) for g, n in enumerate(params)}, 24, dtype=torch.bfloat16,
                     optimizer=rpcompile.AdamW(), staleness=1)
    assert fp32.alternate(0)
    assert "hg" in vma_flags(fp32.alt.pairs[0][0][1].data_ptr())  # the second compute copies


class Checking:
    """A registrar that records whether each range was advised when it was registered."""

    def __init__(self) -> None:
        self.advised: list[bool] = []

    def register(self, ptr: int, nbytes: int) -> None:
        self.advised.append("hg" in vma_flags(-(-ptr // HUGE) * HUGE))

    def unregister(self, ptr: int) -> None:
        pass


def test_pinned_blocks_are_advised_before_registration(thp, monkeypatch):
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    reg = Checking()
    t = PinnedAllocator(reg).zeros(3 * HUGE + 5, torch.bfloat16)  # (an mmap of its own)
    assert reg.advised == [True] and not t.any() and t.numel() == 3 * HUGE + 5 and t.data_ptr() % HUGE == 0
