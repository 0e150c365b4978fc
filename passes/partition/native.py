"""The planner's hot loops in C (shape.c, steady.c, exact.c, layouts.c), built once per machine, loaded with ctypes.

`partition` times thousands of plans: the exact recurrence of `timing.py`
(`shape_time`, what every time it compares or reports is) and the fast one of
`steady.py` (`steady_time`, the screen), one plan at a time, and the complete
even family of a model of up to 40 layers all at once (`even_plans._complete`,
`batch.py` with tensors). exact.c and steady.c are the two recurrences line for
line, and shape.c the plan's `timing.shape` and the steps they share: the same
operations on the same doubles in the same order, built with -ffp-contract=off
(no fused multiply-add), so the same floats bit for bit
(tests/passes/partition/test_native.py), at a few microseconds a plan instead
of 30 (batch) to 300 (one plan in Python). layouts.c is the cap walk's layout
search (`cap_walk._fewest`, `_even`, `_greedy`: the same layouts). The plans
`partition` returns do not depend on which ran.

It is plain C (no Python or torch headers): the machine's C compiler (`$CC`,
else `cc`) builds it in under half a second (once per machine) into the kernels'
cache folder (`rpcompile.ir.cache.cache_dir`), under a name keyed by the sources, the
flags, the compiler and the platform; later processes only load it. Where no
compiler is found, the build fails, or `RPCOMPILE_PLANNER_KERNEL=0` is set,
`load` returns None and the planner times plans in Python (`Evaluator`) and
with tensors (`batch.py`).

    >>> from rpcompile.ir.costs import CostTable
    >>> from rpcompile.passes.partition.evaluator import Evaluator
    >>> ev = Evaluator(CostTable.from_lists([1.0] * 4, [2.0] * 4), gpus=1, microbatches=2, round_size=2,
    ...                staleness=0, memory=None)
    >>> lib = load()  # None without a C compiler
    >>> lib is None or steady_times(lib, ev, [((3,), 1, (3,)), ((1, 2), 1, (2, 1))]) == [30.0, 30.0]
    True
"""
from __future__ import annotations

import array
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile

from rpcompile.ir.cache import cache_dir
from rpcompile.passes.partition.timing import steady_state_window

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = tuple(os.path.join(_HERE, f) for f in ("shape.c", "steady.c", "exact.c", "layouts.c"))  # compiled
HEADERS = (os.path.join(_HERE, "shape.h"),)  # included: part of the build's key
FLAGS = ("-O2", "-std=c11", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math")  # no FMA: steady.py's floats
SWITCH = "RPCOMPILE_PLANNER_KERNEL"  # set to 0 to time with batch.py instead

_log = logging.getLogger(__name__)


def steady_times(lib: ctypes.CDLL, ev, plans: list[tuple], cutoff: float | None = None) -> list[float]:
    """`steady.steady_time` of each plan (fwd sizes, fused size, bwd sizes) of `ev`'s problem, in one call.

    Args:
        lib: `load()`'s library.
        ev: an `evaluator.Evaluator` (costs, workers, microbatches, round size, staleness).
        plans, cutoff: as `batch.steady_times`.
    Returns:
        Seconds per plan, in order (math.inf: proven above `cutoff`).
    """
    if not plans:
        return []
    # the layouts' stages, each layout once: rows off[k] .. off[k + 1] of (lo, hi, fwd sum, bwd sum)
    off, lo, hi, fsum, bsum = array.array("i", [0]), array.array("i"), array.array("i"), array.array("d"), \
        array.array("d")
    fwd_ids: dict = {}
    bwd_ids: dict = {}

    def side(ids: dict, sizes: tuple, stages) -> int:
        k = ids[sizes] = len(off) - 1
        for _, a, b, x, y in stages:
            lo.append(a)
            hi.append(b)
            fsum.append(x)
            bsum.append(y)
        off.append(len(lo))
        return k

    fwd, bwd, fused = array.array("i"), array.array("i"), array.array("i")  # per plan
    for fs, f, bs in plans:
        k = fwd_ids.get(fs)
        fwd.append(side(fwd_ids, fs, ev.forward(fs)) if k is None else k)
        k = bwd_ids.get(bs)
        bwd.append(side(bwd_ids, bs, ev.backward(bs)) if k is None else k)
        fused.append(f)
    nl, used = ev.nl, set(fused)
    sums = [ev.sums(nl - f, nl) if f in used else (0.0, 0.0) for f in range(nl + 1)]  # per fused size
    fused_f, fused_b = array.array("d", [x for x, _ in sums]), array.array("d", [y for _, y in sums])
    out = array.array("d", bytes(8 * len(plans)))
    rc = lib.rp_steady_times(len(plans), *(a.buffer_info()[0] for a in (
        fwd, bwd, fused, fused_f, fused_b, off, lo, hi, fsum, bsum)),
        nl, ev.n_gpu, ev.m, ev.rr, ev.st, -1.0 if cutoff is None else float(cutoff), out.buffer_info()[0])
    if rc != 0:
        raise MemoryError(f"the planner kernel could not allocate its work space for {len(plans)} plans")
    return out.tolist()


def load() -> ctypes.CDLL | None:
    """The built kernel (built now if this machine has none yet), or None (see the module doc)."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    cc = os.environ.get("CC") or "cc"
    sources = []
    for name in SOURCES + HEADERS:
        with open(name, "rb") as f:
            sources.append(f.read())
    key = b"\0".join([*sources, repr(FLAGS).encode(), cc.encode(), sysconfig.get_platform().encode()])
    path = os.path.join(cache_dir(), f"rpcompile_planner_{hashlib.sha256(key).hexdigest()[:16]}.so")
    if not os.path.exists(path):
        try:
            _build(cc, path)
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            _log.info("the planner kernel is not available (%s); timing plans in Python instead", exc)
            return None
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:  # e.g. built for another machine sharing the cache folder
        _log.info("the planner kernel %s does not load (%s); timing plans in Python instead", path, exc)
        return None
    ptr, i32, f64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_double
    lib.rp_steady_times.restype = i32
    lib.rp_steady_times.argtypes = [i32] + [ptr] * 10 + [i32] * 5 + [f64, ptr]
    lib.rp_time.restype = f64
    lib.rp_time.argtypes = [i32] + [ptr] * 5 + [i32] * 7 + [f64, i32]
    lib.rp_fewest.restype = i32
    lib.rp_fewest.argtypes = [ptr, i32, f64]
    lib.rp_layouts.restype = i32
    lib.rp_layouts.argtypes = [ptr, ptr, i32, f64, i32, ptr, ptr, ptr]
    return lib


def time(lib: ctypes.CDLL, stages: list, *, gpus: int, microbatches: int, round_size: int, staleness: int,
         cutoff: float | None = None, exact: bool = True) -> float:
    """One plan's time, its stages as `timing.shape` takes them ((code, first layer, end layer, fwd sum, bwd
    sum) in slot order): `timing.shape_time` (exact) or `steady.steady_time`, the same float either way.

    Args:
        lib: `load()`'s library.
        gpus, microbatches, round_size, staleness, cutoff: as `timing.shape_time`.
    Returns:
        Seconds, or math.inf once proven above `cutoff`.
    """
    cols = list(zip(*stages))
    code, lo, hi = (array.array("i", c) for c in cols[:3])
    f, b = array.array("d", cols[3]), array.array("d", cols[4])
    iters, window = steady_state_window(gpus, len(stages), microbatches // round_size) if staleness else (1, 1)
    out = lib.rp_time(len(stages), *(a.buffer_info()[0] for a in (code, lo, hi, f, b)), max(hi), gpus,
                      microbatches, round_size, staleness, iters, window, -1.0 if cutoff is None else float(cutoff),
                      int(exact))
    if out != out:
        raise MemoryError(f"the planner kernel could not allocate its work space for {len(stages)} stages")
    return out


class Layouts:
    """The cap walk's layouts of one side in C (layouts.c: `cap_walk._fewest`, `_even` and `_greedy`, the same
    layouts): prefix sums `p` of its n layers, at most `extra` stage counts above the fewest."""

    def __init__(self, lib: ctypes.CDLL, p: list[float], n: int, extra: int):
        self.lib, self.n, self.extra = lib, n, extra
        self.p = array.array("d", p[:n + 1])
        self.rp = array.array("d", [p[n] - x for x in reversed(p[:n + 1])])  # `_Caps.rp`: from the last layer
        self.sizes = array.array("i", bytes(4 * 3 * (extra + 1) * n))
        self.lens = array.array("i", bytes(4 * 3 * (extra + 1)))
        self.work = array.array("i", bytes(4 * (n + 1)))
        self.ptrs = [a.buffer_info()[0] for a in (self.p, self.rp)] + [n]
        self.out = [a.buffer_info()[0] for a in (self.sizes, self.lens, self.work)]

    def fewest(self, cap: float) -> int:
        """`cap_walk._fewest(p, n, cap)`."""
        return self.lib.rp_fewest(self.ptrs[0], self.n, cap)

    def __call__(self, cap: float) -> tuple[int, list]:
        """(k0, the candidates): for k = k0 .. min(n, k0 + extra), `_even`, `_greedy` and the reversed
        `_greedy` on the reversed sums (None where one has no layout), in that order."""
        k0 = self.lib.rp_layouts(*self.ptrs, cap, self.extra, *self.out)
        sizes, lens, n = self.sizes, self.lens, self.n
        count = 3 * (min(n, k0 + self.extra) - k0 + 1)
        return k0, [tuple(sizes[c * n:c * n + lens[c]]) if lens[c] else None for c in range(count)]


def _build(cc: str, path: str) -> None:
    """Compile the C sources into `path`, atomically (another process may build the same file meanwhile)."""
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler: {cc!r} is not on PATH (set CC)")
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, "-o", tmp, *SOURCES], check=True, capture_output=True, timeout=120)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
