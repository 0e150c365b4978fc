"""Pinned host memory at its exact size: pageable memory page-locked with `cudaHostRegister`.

`torch.empty(n, pin_memory=True)` comes from torch's caching host allocator,
which rounds every block up to a power of two: a 4.8 GB compute-copy block
(one Qwen3-235B MoE layer in bf16) takes 8 GB of page-locked RAM that the
host-memory admission never counted. `PinnedAllocator.zeros` allocates the
block pageable (page-aligned, zero-filled) and registers exactly its bytes with
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

import mmap
import threading
from typing import Any

import torch

__all__ = ["PinnedAllocator", "CudaRegistrar", "pinning", "pinned_zeros", "PAGE"]

PAGE = mmap.PAGESIZE  # bytes: blocks start on a page, so no two blocks share a page the driver locks


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


class _Block(bytearray):
    """The pageable memory of one block; unregisters it before the memory is freed (see module docstring)."""

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
        pages = -(-nbytes // PAGE) * PAGE
        block = _Block(pages + PAGE)  # zero-filled; one page of slack to start on a page boundary
        raw = torch.frombuffer(block, dtype=torch.uint8)
        off = -raw.data_ptr() % PAGE
        t = raw[off:off + nbytes].view(dtype)
        if nbytes:
            ptr = raw.data_ptr() + off
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


def pinned_zeros(n: int, dtype: torch.dtype, pin: Any) -> torch.Tensor:
    """`n` zeros of `dtype`: pageable (`pin` False), from `pin` (a PinnedAllocator), or exact-size pinned (True).

    >>> pinned_zeros(3, torch.float16, False)
    tensor([0., 0., 0.], dtype=torch.float16)
    """
    if not pin:
        return torch.zeros(n, dtype=dtype)
    return (pin if isinstance(pin, PinnedAllocator) else PinnedAllocator()).zeros(n, dtype)
