"""Host memory blocks: pageable ones on huge pages, and pinned ones at their exact size.

Huge pages. Every step streams the whole host state once: the landing writes each gradient, the update
reads and writes the master, the gradient and the moments. On 4 KiB pages a stream crosses a page every
1,024 fp32 values; each crossing can cost a page walk, and the hardware prefetcher stops at it. A 2 MiB
page holds 512 times more. Linux gives anonymous memory huge pages where transparent huge pages are on:
everywhere in `always` mode, and in `madvise` mode (the default of many distributions) only where the
program asks with madvise(MADV_HUGEPAGE) before it first touches the memory.

`host_buffers` puts the pageable buffers of one kind (a state's masters, gradients, each moment, compute
copies: one per layer group) one after another in one private anonymous mapping. Its bytes start at a
2 MiB boundary and are advised before the zero fill first touches them (`mapped`, `advise_huge`). So all
of it but the bytes after its last 2 MiB boundary can be huge pages, however small each group's buffer
(LoRA adapters: a few MiB a group, too small to hold an aligned 2 MiB of their own). Those last bytes stay
on small pages: no huge page holds bytes that are not the buffers', and the resident memory is the
buffers' bytes, as the host-memory plan counts them. `PinnedAllocator.zeros` maps and advises each block
the same way before the registration touches (and locks) its pages.

In `never` mode, on a kernel without transparent huge pages, or off Linux, the advice is skipped or
refused and the buffers are ordinary ones. `RPCOMPILE_HUGE_PAGES=0` in the environment turns the advice
off (read at each allocation; the buffers are then torch.zeros'). No value changes. On one core of a Xeon
VM, 48M parameters in 24 groups: the whole host side 1.06-1.08x faster for every state
(docs/bench/optimizer_hugepages_passes.md, `bench/optimizer.py`'s 4 KiB row).

Pinned blocks. `torch.empty(n, pin_memory=True)` comes from torch's caching host allocator,
which rounds every block up to a power of two: a 4.8 GB compute-copy block
(one Qwen3-235B MoE layer in bf16) takes 8 GB of page-locked RAM that the
host-memory admission never counted. `PinnedAllocator.zeros` allocates the
block pageable (an anonymous mapping: page-aligned, zero, huge pages asked
for) and registers exactly its bytes with
the CUDA driver (`torch.cuda.cudart().cudaHostRegister`, as the RoundPipe
reference does); the driver locks the pages that hold them, so the cost is the
block plus less than a page. Uploads from it are asynchronous like those from
torch's pinned memory (`Tensor.is_pinned()` is True for registered memory).

The memory is unregistered just before it is freed: the block's owner object
unregisters it when the last tensor viewing it dies (its finalizer), and
`PinnedAllocator.close()` unregisters what is still registered at once.
Registration goes through a `registrar` (`CudaRegistrar` by default), which a
test replaces with one that records the byte counts (no CUDA needed).

    >>> class Count:
    ...     def __init__(self): self.live = {}
    ...     def register(self, ptr, nbytes): self.live[ptr] = nbytes
    ...     def unregister(self, ptr): del self.live[ptr]
    >>> alloc = PinnedAllocator(Count())
    >>> t = alloc.zeros(10, torch.float32)
    >>> list(alloc.registrar.live.values()), t.data_ptr() % PAGE, float(t.sum())
    ([40], 0, 0.0)
    >>> del t; list(alloc.registrar.live.values())
    []
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["PinnedAllocator", "CudaRegistrar", "pinning", "pinned_zeros", "pinned_buffers", "host_zeros",
           "host_buffers", "mapped", "advise_huge", "huge_pages_wanted", "PAGE", "HUGE", "HUGE_PAGES_ENV"]

PAGE = mmap.PAGESIZE  # bytes: blocks start on a page, so no two blocks share a page the driver locks
HUGE = 2 << 20  # bytes: an x86-64 (and 4 KiB-granule arm64) transparent huge page
HUGE_PAGES_ENV = "RPCOMPILE_HUGE_PAGES"  # "0": no huge-page advice


def huge_pages_wanted() -> bool:
    """Whether the environment lets blocks ask for huge pages (`RPCOMPILE_HUGE_PAGES` unset or not "0").

    >>> isinstance(huge_pages_wanted(), bool)
    True
    """
    return os.environ.get(HUGE_PAGES_ENV, "1").strip() != "0"


def advise_huge(ptr: int, nbytes: int) -> int:
    """Ask for huge pages for the 2 MiB-aligned interior of [ptr, ptr + nbytes); returns the bytes advised.

    0 where the range holds no whole aligned 2 MiB, the platform has no MADV_HUGEPAGE, or the kernel
    refuses (one without transparent huge pages): the memory stays as it is, which is always correct.

    >>> advise_huge(HUGE + 1, HUGE)  # no whole aligned 2 MiB inside
    0
    """
    flag = getattr(mmap, "MADV_HUGEPAGE", None)
    lo, hi = -(-ptr // HUGE) * HUGE, (ptr + nbytes) // HUGE * HUGE
    if flag is None or hi <= lo:
        return 0
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return hi - lo if madvise(lo, hi - lo, flag) == 0 else 0


def mapped(nbytes: int, kind: type = mmap.mmap) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping (`kind`: mmap.mmap or a subclass) with room for `nbytes`, and the offset in
    it where they start: a 2 MiB boundary when they are `HUGE` or more (else a page), so every whole 2 MiB of
    them can be a huge page. They are advised for huge pages (`advise_huge`, unless the environment says no)
    before anything touches them. The mapping's pages are zero until first touched; the slack before the
    bytes and after them is never touched, so it takes no memory. A tensor made on it
    (`torch.frombuffer(block, ..., offset=...)`) keeps the mapping alive.
    """
    align = HUGE if nbytes >= HUGE else PAGE
    size = -(-nbytes // PAGE) * PAGE + align - PAGE
    private = getattr(mmap, "MAP_PRIVATE", None)  # not mmap's default MAP_SHARED: shared memory takes no THP
    block = kind(-1, size) if private is None else kind(-1, size, flags=private | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(block, dtype=torch.uint8, count=1).data_ptr()
    at = -base % align
    if nbytes >= HUGE and huge_pages_wanted():
        advise_huge(base + at, nbytes)
    return block, at


def host_buffers(sizes: Sequence[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zero buffers of `dtype` of the given element counts in pageable host memory, each a tensor with a
    storage of its own, on huge pages where the system gives them (module docstring).

    Together `HUGE` bytes or more, they lie one after another (each at a 64-byte boundary) in one block
    `mapped` for them: 2 MiB-aligned and advised, so all but the last 2 MiB or less of the block can be huge
    pages, however small each buffer (a group's LoRA adapters: a few MiB, which on a block of its own would
    hold little or no aligned 2 MiB). The buffers are zero-filled here, so their memory is taken now, as
    torch.zeros takes it; the block is freed when the last of them dies. Smaller together, or with the
    advice turned off: torch.zeros each.

    >>> [t.tolist() for t in host_buffers([2, 0, 1], torch.float32)]
    [[0.0, 0.0], [], [0.0]]
    """
    starts, end = [], 0
    for n in sizes:
        starts.append(end)
        end += -(-n * dtype.itemsize // 64) * 64
    if end < HUGE or not huge_pages_wanted():
        return [torch.zeros(n, dtype=dtype) for n in sizes]
    block, at = mapped(end)
    return [torch.frombuffer(block, dtype=dtype, count=n, offset=at + start).zero_() if n
            else torch.zeros(0, dtype=dtype) for n, start in zip(sizes, starts)]


def host_zeros(n: int, dtype: torch.dtype) -> torch.Tensor:
    """`n` zeros of `dtype` in pageable host memory: one `host_buffers` buffer.

    >>> host_zeros(3, torch.float32)
    tensor([0., 0., 0.])
    """
    return host_buffers([n], dtype)[0]


class CudaRegistrar:
    """Page-locks host ranges through the CUDA runtime (`cudaHostRegister` / `cudaHostUnregister`)."""

    def register(self, ptr: int, nbytes: int) -> None:
        """Page-lock [ptr, ptr + nbytes); RuntimeError naming the bytes if the driver refuses."""
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (CUDA error {int(err)}): the host may "
                               f"not have that much lockable memory (ulimit -l)")

    def unregister(self, ptr: int) -> None:
        """Unlock the range registered at `ptr` (errors ignored: the context may be gone at exit)."""
        torch.cuda.cudart().cudaHostUnregister(ptr)


class _Block(mmap.mmap):
    """The pageable memory of one block (an anonymous mapping: page-aligned, zero until first touched);
    unregisters it before the memory is freed (see module docstring)."""

    def __del__(self) -> None:
        release = getattr(self, "release", None)
        if release is not None:
            release()


class PinnedAllocator:
    """Exact-size page-locked host blocks (see the module docstring).

    Args:
        registrar: what page-locks the ranges (default `CudaRegistrar()`); anything with
            `register(ptr, nbytes)` and `unregister(ptr)`.
    """

    def __init__(self, registrar: Any = None) -> None:
        self.registrar = registrar if registrar is not None else CudaRegistrar()
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}  # registered pointer -> bytes

    @property
    def registered(self) -> int:
        """Bytes registered now."""
        with self._lock:
            return sum(self._live.values())

    def zeros(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled 1-D host tensor of `n` elements of `dtype`, its n * itemsize bytes registered.

        Raises:
            RuntimeError: the registrar refused (the memory is freed again).
        """
        nbytes = n * dtype.itemsize
        if not nbytes:
            return torch.zeros(0, dtype=dtype)
        block, at = mapped(nbytes, _Block)  # advised for huge pages before the registration touches them
        t = torch.frombuffer(block, dtype=dtype, count=n, offset=at)
        ptr = t.data_ptr()
        self.registrar.register(ptr, nbytes)
        with self._lock:
            self._live[ptr] = nbytes
        block.release = lambda: self._release(ptr)
        return t

    def _release(self, ptr: int) -> None:
        """Unregister `ptr` once (from a block's finalizer or `close`)."""
        with self._lock:
            if self._live.pop(ptr, None) is None:
                return
        self.registrar.unregister(ptr)

    def close(self) -> None:
        """Unregister every block still registered (their memory stays valid, now pageable)."""
        with self._lock:
            ptrs = list(self._live)
        for p in ptrs:
            self._release(p)


def pinning(pin: Any) -> PinnedAllocator | bool:
    """What a `pin_memory` argument asks for: a given PinnedAllocator, a new one (True, with CUDA), else False.

    >>> pinning(False)
    False
    """
    if isinstance(pin, PinnedAllocator):
        return pin
    return PinnedAllocator() if pin and torch.cuda.is_available() else False


def pinned_buffers(specs: Sequence[tuple[int, torch.dtype]], pin: Any) -> list[torch.Tensor]:
    """Zero buffers of the given (elements, dtype), in order: each `pinned_zeros` when `pin`, else the
    pageable ones of each dtype together (`host_buffers`: one block, on huge pages).

    >>> [t.dtype for t in pinned_buffers([(2, torch.float32), (3, torch.bfloat16), (1, torch.float32)], False)]
    [torch.float32, torch.bfloat16, torch.float32]
    """
    if pin:
        return [pinned_zeros(n, d, pin) for n, d in specs]
    out: list[Any] = [None] * len(specs)
    for d in dict.fromkeys(d for _, d in specs):
        at = [i for i, (_, di) in enumerate(specs) if di == d]
        for i, t in zip(at, host_buffers([specs[i][0] for i in at], d)):
            out[i] = t
    return out


def pinned_zeros(n: int, dtype: torch.dtype, pin: Any) -> torch.Tensor:
    """`n` zeros of `dtype`: pageable (`pin` False), from `pin` (a PinnedAllocator), or exact-size pinned (True).

    >>> pinned_zeros(3, torch.float16, False)
    tensor([0., 0., 0.], dtype=torch.float16)
    """
    if not pin:
        return host_zeros(n, dtype)
    return (pin if isinstance(pin, PinnedAllocator) else PinnedAllocator()).zeros(n, dtype)
