"""The host optimizer's kernels: kernels.cpp (and the headers it includes) built once per machine, and checked calls
into it.

`load_kernels()` builds `kernels.cpp` with `torch.utils.cpp_extension` (OpenMP, -O3 -march=native,
-ffp-contract=off) into a cache folder keyed by the source, the flags, the CPU's feature flags and
the Python and torch versions, so each machine builds once (`python -m rpcompile.runtime.host.kernels`
builds ahead of time); later processes only load the library, once its size and digest are those
of the seal the build wrote (a damaged file is built again, never mapped). `compile()` loads it
when it makes the host state, so no build lands inside a timed step. Without a C++ compiler (or when the build
fails) it returns None after one warning line, and the optimizer runs torch's kernels instead.

Each call checks its tensors (CPU, contiguous, dtype, length) before handing the raw pointers over;
the C++ side releases the GIL for the whole loop.

    >>> k = load_kernels()
    >>> buf = torch.zeros(3); k.land(buf, torch.tensor([1.0, 2.0, 2.0], dtype=torch.bfloat16), add=False)
    (9.0, False)
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import statistics
import sys
import sysconfig
import time
import warnings
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from rpcompile.ir.cache import build_once, cache_dir
from rpcompile.runtime.host.lean import M32

__all__ = ["Kernels", "load_kernels", "cache_dir", "optimizer_rate", "KINDS"]

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.cpp")
HEADERS = tuple(os.path.join(os.path.dirname(SOURCE), h) for h in (  # what SOURCE includes, and they include:
    "kernels_common.h", "kernels_land.h", "kernels_update.h", "kernels_avx512.h", "kernels_cast.h"))  # the build's key
# C++ compile flags. -mprefer-vector-width=512: GCC defaults to 256-bit vectors even where AVX-512 exists; the
# wider ones made the whole host side 5% faster on this machine's Xeon (98.8 -> 93 ms, bench/optimizer.py,
# 1 thread) and change nothing on a CPU without AVX-512. -ffp-contract=off: eager's float operations, no FMA
# where ATen has none.
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffp-contract=off", "-fno-math-errno")
KINDS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}  # dtype -> the kernels' kind number


class Kernels:
    """Checked calls into the built module (one per process, shared by every HostState)."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module  # the loaded extension

    def land(self, dst: Tensor, src: Tensor, *, add: bool, divisor: float = 1.0, key: int = 0,
             offset: int = 0) -> tuple[float, bool]:
        """dst = ((dst if add else 0) + src) / divisor (fp32 dst, any float src; src may be dst: in place);
        returns (sum of squares, non-finite) of the new dst, taken in the same pass. A first landing (add=False,
        divisor 1) of 1 MiB or more (an fp32 dst, or a bf16 one from a bf16 src: a copy) goes around the cache
        (non-temporal stores, with AVX-512; the squares then add in that loop's order, the same for the same buffers).

        A bf16 dst (`grad_dtype=torch.bfloat16`) gets the float32 result rounded stochastically with the
        bits that `key` and `offset` (dst's first element's offset in its group's buffers) choose
        (runtime/host/lean.py `land`, the same bits); the statistics are the stored values'.

        Example (`k = load_kernels()`: None without a C++ compiler, so not run here):
            >>> k.land(torch.ones(2), torch.ones(2), add=True)  # doctest: +SKIP
            (8.0, False)
            >>> g = torch.full((2,), 6.0); k.land(g, g, add=False, divisor=2)  # doctest: +SKIP
            (18.0, False)
        """
        _check("land", dst, _lean_dtype("land", dst), dst.numel())
        _check("land", src, src.dtype, dst.numel())
        if dst.dtype == torch.bfloat16:
            return self.module.land_bf16(dst.data_ptr(), src.data_ptr(), _kind(src), dst.numel(), add, _threads(),
                                         float(divisor), key & M32, offset)
        return self.module.land(dst.data_ptr(), src.data_ptr(), _kind(src), dst.numel(), add, _threads(),
                                float(divisor))

    def adamw(self, p: Tensor, g: Tensor, m: Tensor, v: Tensor, out: Tensor | None, *, factor: float, lr: float,
              betas: tuple[float, float], eps: float, weight_decay: float, step: int, key: int = 0,
              offset: int = 0, src: Tensor | None = None, low: Tensor | None = None) -> None:
        """AdamW step `step` (1-based) of p, m, v with the gradient g * factor; out (if given) = cast(new p).

        The scalars are formed as torch.optim.AdamW forms them (Python floats, then float32). m and v
        are both float32, or both bf16 (`AdamW(state_dtype=torch.bfloat16)`); p, the master, is float32
        or bf16 (`AdamW(master_dtype=torch.bfloat16)`); g float32 or bf16 (`grad_dtype=torch.bfloat16`).
        A bf16 value is read and widened, the update is
        the same float32 arithmetic, and the new value is rounded stochastically with the bits that `key`
        and `offset` (p's first element's offset in its group's buffers) choose (runtime/host/lean.py);
        out is then cast from the stored bf16 weight. `src`: read the master from it (p's dtype and size) and
        write the new one to p, out of place (a bf16 master's alternating copies, runtime/host/layout.py);
        None: p in place. A bf16 out of 1 MiB or more (else, with no out, a bf16 p written out of place) goes
        around the cache (non-temporal stores, with AVX-512), with the same bits.
        `low` (int16, p's size): p is a split master's hi halves (bf16) and `low` its lo halves, an exact float32
        master (runtime/host/lean.py); it is updated as the float32 one is and stored whole, and a bf16 out
        takes hi.
        """
        master = _lean_dtype("adamw", p)
        _check_src("adamw", src, p)
        if low is not None:
            if master != torch.bfloat16:
                raise ValueError(f"adamw: a split master's hi halves are bfloat16, got {p.dtype}")
            if (low.device.type != "cpu" or not low.is_contiguous() or low.dtype != torch.int16
                    or low.numel() != p.numel()):
                raise ValueError(f"host kernel adamw: a split master's lo halves need contiguous CPU int16 of "
                                 f"{p.numel()} elements, got {low.dtype} {tuple(low.shape)} on {low.device}")
        grad = _lean_dtype("adamw", g)
        _check("adamw", g, grad, p.numel())
        state = _lean_dtype("adamw", m)
        for t in (m, v):
            _check("adamw", t, state, p.numel())
        if out is not None:
            _check("adamw", out, out.dtype, p.numel())
        b1, b2 = betas
        bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
        scalars = (factor, 1 - lr * weight_decay, 1 - b1, b2, 1 - b2, eps, -(lr / bc1), bc2 ** 0.5)
        args = (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), _ptr(out), _kind(out), p.numel(), _threads())
        split = low is not None
        lean = ((state == torch.bfloat16) | (master == torch.bfloat16 and not split) << 1
                | (grad == torch.bfloat16) << 2 | split << 3)
        if not lean and src is None:
            self.module.adamw(*args, *scalars)
        else:  # lean mode bits: 1 bf16 moments, 2 a bf16 master, 4 a bf16 gradient, 8 split (0 only out of place)
            self.module.adamw_lean(*args, *scalars, key & M32, offset, lean, _ptr(src), _ptr(low))

    def sgd(self, p: Tensor, g: Tensor, buf: Tensor | None, out: Tensor | None, *, factor: float, lr: float,
            momentum: float, weight_decay: float, nesterov: bool, first: bool, key: int = 0, offset: int = 0,
            src: Tensor | None = None) -> None:
        """SGD step of p (and the momentum buffer `buf`, None without momentum) with g * factor; out = cast(new p).

        `first`: the buffer's first step (it becomes the gradient, as torch's clone). p is the float32 or
        bf16 master (`SGD(master_dtype=torch.bfloat16)`: rounded stochastically as in `adamw`, `key` and
        `offset` choosing the bits); g is float32 or bf16 (`grad_dtype=torch.bfloat16`), buf float32. `src`: as
        for `adamw`, the master read from it and the new one written to p.
        """
        master = _lean_dtype("sgd", p)
        _check_src("sgd", src, p)
        _check("sgd", g, _lean_dtype("sgd", g), p.numel())
        if buf is not None:
            _check("sgd", buf, torch.float32, p.numel())
        if out is not None:
            _check("sgd", out, out.dtype, p.numel())
        self.module.sgd(p.data_ptr(), g.data_ptr(), _ptr(buf), _ptr(out), _kind(out), p.numel(), _threads(),
                        factor, weight_decay, momentum, 1.0, -lr, nesterov, first, buf is not None,
                        key & M32, offset, master == torch.bfloat16, g.dtype == torch.bfloat16, _ptr(src))

    def cast(self, src: Tensor, out: Tensor) -> None:
        """out = src.to(out.dtype) (fp32 src: fp32, bf16 or fp16 out, round to nearest even; a bf16 src: bf16 out), in
        one pass; a bf16 out of 1 MiB or more is written around the cache (non-temporal stores, with AVX-512)."""
        same = src.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
        _check("cast", src, torch.bfloat16 if same else torch.float32, src.numel())
        _check("cast", out, out.dtype, src.numel())
        self.module.cast(src.data_ptr(), out.data_ptr(), _kind(out), src.numel(), _threads(), int(same))


def _check_src(op: str, src: Tensor | None, p: Tensor) -> None:
    """An out-of-place master's source: p's dtype and size, contiguous, and not overlapping p unless it is p."""
    if src is None:
        return
    _check(op, src, p.dtype, p.numel())
    a, b, n = src.data_ptr(), p.data_ptr(), p.numel() * p.element_size()
    if a != b and a < b + n and b < a + n:
        raise ValueError(f"{op}: the master's source overlaps its destination without being it")


def _check(op: str, t: Tensor, dtype: torch.dtype, n: int) -> None:
    """Refuse a tensor the raw-pointer kernel cannot take (one line naming what is wrong)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.dtype != dtype or t.numel() != n or t.dtype not in KINDS:
        raise ValueError(f"host kernel {op}: needs contiguous CPU {dtype} of {n} elements (fp32/bf16/fp16), got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}")


def _lean_dtype(op: str, t: Tensor) -> torch.dtype:
    """t's dtype, float32 or bf16 (a master or moment buffer), after `_check`."""
    dtype = t.dtype if t.dtype == torch.bfloat16 else torch.float32
    _check(op, t, dtype, t.numel())
    return dtype


def _kind(t: Tensor | None) -> int:
    """The kernels' number for t's dtype (0: no tensor)."""
    return 0 if t is None else KINDS[t.dtype]


def _ptr(t: Tensor | None) -> int:
    """t's data pointer (0: no tensor)."""
    return 0 if t is None else t.data_ptr()


def _threads() -> int:
    """OpenMP threads for one call: torch's intra-op thread count."""
    return torch.get_num_threads()


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for), or the machine name without /proc."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def module_name() -> str:
    """The extension's name: a digest of the source and the headers it includes, flags, CPU flags, compiler and
    versions."""
    key = []
    for path in (SOURCE, *HEADERS):
        with open(path, "rb") as f:
            key.append(f.read())
    key += [repr(FLAGS).encode(), _cpu_flags().encode(), torch.__version__.encode(), sys.version.encode(),
            (os.environ.get("CXX") or "c++").encode(), sysconfig.get_platform().encode()]
    return "rpcompile_host_kernels_" + hashlib.sha256(b"\0".join(key)).hexdigest()[:16]


def load_kernels(*, verbose: bool = False) -> Kernels | None:
    """The built kernels (building them on this machine's first call), or None after one warning line.

    Args:
        verbose: show the compiler's output.
    Returns:
        A `Kernels`, or None when no C++ compiler or ninja is found or the build fails (the warning
        says which, and that torch's optimizer kernels run instead).

    Example:
        >>> load_kernels() is not None   # with a C++ compiler
        True
    """
    name = module_name()
    if name in sys.modules:  # loaded by an earlier call in this process
        return Kernels(sys.modules[name])
    try:
        module = _build(name, verbose)
    except Exception as exc:  # noqa: BLE001 - any build failure falls back to torch's kernels
        why = " ".join(str(exc).split())[:300]
        warnings.warn(f"rpcompile: the host optimizer kernels are not available ({type(exc).__name__}: {why}); "
                      f"using torch's optimizer kernels (slower)", RuntimeWarning, stacklevel=2)
        return None
    sys.modules[name] = module
    return Kernels(module)


def _build(name: str, verbose: bool) -> Any:
    """Build (or, when cached, just load) the extension `name`.

    An extension an earlier process built is imported directly: its name keys the source, the flags, the
    CPU, the compiler and the versions, so the file is the build `cpp_extension.load` would make, and
    loading it that way costs an import of setuptools and a ninja check (about 70 ms, a tenth of a small
    model's compile). It is imported only when it is whole (`rpcompile.ir.cache.build_once`: the size and
    digest of its seal, written after a finished build); a file that is not (a link cut short by a full
    disk, garbage) is never mapped: it is built again from nothing.
    """
    folder = os.path.join(cache_dir(), name)
    built = os.path.join(folder, name + ".so")
    module = build_once(built, lambda: _compile(name, folder, verbose))  # holding the folder's lock
    if module is not None:  # built now (cpp_extension.load imported it)
        return module
    spec = importlib.util.spec_from_file_location(name, built)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(name: str, folder: str, verbose: bool) -> Any:
    """`cpp_extension.load` into `folder`, emptied first (besides its lock), so nothing a cut-short build left
    there counts as up to date; returns the module it imports."""
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH (set CXX or install g++)")
    for entry in os.listdir(folder):
        if entry != "lock":  # cpp_extension's own lock file, maybe held by an older rpcompile's build
            target = os.path.join(folder, entry)
            shutil.rmtree(target) if os.path.isdir(target) else os.unlink(target)
    cpp_extension = _import_cpp_extension()
    return cpp_extension.load(name=name, sources=[SOURCE], extra_cflags=list(FLAGS), extra_ldflags=["-fopenmp"],
                              build_directory=folder, verbose=verbose)


class _NoCudaHome(logging.Filter):
    """Drops the line torch's extension module logs at import on a machine without CUDA ("No CUDA runtime is
    found, using CUDA_HOME=..."): the host kernels are a CPU-only extension, so it says nothing about the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


def _import_cpp_extension() -> ModuleType:
    """torch.utils.cpp_extension (imports setuptools: only when building), without its CUDA_HOME line."""
    logger = logging.getLogger("torch.utils.cpp_extension")  # the module's own logger (logging.getLogger(__name__))
    quiet = _NoCudaHome()
    logger.addFilter(quiet)
    try:
        from torch.utils import cpp_extension
    finally:
        logger.removeFilter(quiet)
    return cpp_extension


def optimizer_rate(budget_s: float = 0.5, *, elements: int = 2 ** 22) -> float:
    """fp32 master bytes per second of the kernels' AdamW step (torch's foreach AdamW without the kernels).

    For `Hardware.measure(optimizer_rate=optimizer_rate)`: the simulator's optimizer lane prices a
    step at this rate. The median of repeated steps over `elements` parameters (16 MiB of masters by
    default: past the caches, as a layer group is) within about `budget_s` seconds.

    Example:
        >>> optimizer_rate(0.2) > 1e8
        True
    """
    k = load_kernels()
    p, g, m, v = (torch.rand(elements) for _ in range(4))
    if k is None:
        q = p.requires_grad_()
        q.grad = g
        opt = torch.optim.AdamW([q], lr=1e-3, foreach=True)
        run = opt.step
    else:
        def run() -> None:
            k.adamw(p, g, m, v, None, factor=1.0, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=2)
    run()
    times, start = [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 50):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return p.nbytes / statistics.median(times)


if __name__ == "__main__":  # build ahead of time: python -m rpcompile.runtime.host.kernels
    k = load_kernels(verbose=True)
    print(f"{'built' if k else 'NOT built'}: {os.path.join(cache_dir(), module_name())}")
