"""The planner's hot loops in C (shape.c, steady.c, exact.c, layouts.c, caps.c), built once per machine, loaded with
ctypes.

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
search (`cap_walk._fewest`, `_even`, `_greedy`: the same layouts), and caps.c
its walk over caps (`CapWalks`: each side's heap of contiguous sums, the set of
layouts it found, `Evaluator.side_fits` in 64-bit integers), so that a step
costs one call and only the new layouts that may fit come back to Python. The
plans `partition` returns do not depend on which ran.

It is plain C (no Python or torch headers): the machine's C compiler (`$CC`,
else `cc`) builds it in under half a second (once per machine) into the kernels'
cache folder (`rpcompile.ir.clib`: `rpcompile.ir.cache.cache_dir`), under a name keyed by the sources,
the flags, the compiler and the platform; later processes only load it. Where no
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
import os

from rpcompile.ir.clib import CLibrary
from rpcompile.passes.partition.timing import steady_state_window

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = tuple(os.path.join(_HERE, f) for f in ("shape.c", "steady.c", "exact.c", "layouts.c", "caps.c"))  # compiled
HEADERS = (os.path.join(_HERE, "shape.h"),)  # included: part of the build's key
SWITCH = "RPCOMPILE_PLANNER_KERNEL"  # set to 0 to time with batch.py instead
# built with `clib.FLAGS`: -ffp-contract=off (no FMA) and no fast math, so steady.py's floats
LIBRARY = CLibrary("rpcompile_planner", sources=SOURCES, headers=HEADERS, switch=SWITCH)


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
    lib = LIBRARY.load()
    if lib is None:
        return None
    ptr, i32, f64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_double
    lib.rp_steady_times.restype = i32
    lib.rp_steady_times.argtypes = [i32] + [ptr] * 10 + [i32] * 5 + [f64, ptr]
    lib.rp_time.restype = f64
    lib.rp_time.argtypes = [i32] + [ptr] * 5 + [i32] * 7 + [f64, i32]
    lib.rp_side_new.restype = ptr
    lib.rp_side_new.argtypes = [i32, i32] + [ptr] * 6 + [ctypes.c_longlong]
    lib.rp_side_free.restype = None
    lib.rp_side_free.argtypes = [ptr]
    lib.rp_walk_start.restype = None
    lib.rp_walk_start.argtypes = [ptr, i32, f64, f64]
    lib.rp_step.restype = i32
    lib.rp_step.argtypes = [ptr, ptr, i32, ptr, ptr]
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


_INT64 = 2 ** 62  # bytes below this are counted in C, in 64-bit integers (no difference of them overflows)


def cap_walks(lib: ctypes.CDLL, ev, pf: list[float], pb: list[float], extra: int) -> CapWalks | None:
    """The cap walk's sides in C for `ev`'s problem (an `evaluator.Evaluator`; pf, pb: the prefix sums of the
    layers' fwd and fwd + bwd), or None where a memory budget's bytes are not Python ints below `_INT64`
    (then the walk runs in Python, `cap_walk._Caps`: the same layouts)."""
    q = [a + b for a, b in zip(ev.p_param, ev.p_work)]  # a backward stage holds its parameters, grads, workspace
    if ev.memory is not None and not (isinstance(ev.memory, int) and isinstance(q[-1], int) and q[-1] < _INT64):
        return None  # (a float anywhere makes the last prefix sum a float)
    return CapWalks(lib, ev, pf, pb, extra, q)


class CapWalks:
    """The cap walk's sides in C (caps.c) for one problem: per fused size and side (forward, backward) its two
    cap walks (`cap_walk._Caps`, up and down), its layouts at each cap (layouts.c: `cap_walk._fewest`, `_even`,
    `_greedy`) and the set of those seen, so that only the new layouts that may fit (`Evaluator.side_fits`) come
    back. `close` frees them."""

    def __init__(self, lib: ctypes.CDLL, ev, pf: list[float], pb: list[float], extra: int, q: list[int]):
        self.lib, self.nl = lib, ev.nl
        self.p = (array.array("d", pf), array.array("d", pb))
        self.mem = None if ev.memory is None else (array.array("q", ev.p_param), array.array("q", q))
        self.budget = 0 if ev.memory is None else min(ev.memory, _INT64)  # a stage's bytes are below _INT64 anyway
        width = 3 * (extra + 1)  # candidates per cap
        # what each step writes, read right after it, so shared by every walk: per side the buffers of the last
        # cap's candidates (candidate c: sizes[c * n:], lens[c] stages; work; fresh), and rp_step's outputs
        self.scratch = tuple((array.array("i", bytes(4 * width * self.nl)), array.array("i", bytes(4 * width)),
                              array.array("i", bytes(4 * (self.nl + 1))), array.array("i", bytes(4 * width)))
                             for _ in range(2))
        self.cap, self.out = array.array("d", [0.0]), array.array("i", bytes(4 * 5))
        self.args = tuple((self.p[i].buffer_info()[0], *(a.buffer_info()[0] for a in self.scratch[i]),
                           None if self.mem is None else self.mem[i].buffer_info()[0], self.budget) for i in (0, 1))
        self.extra, self.sides = extra, []

    def pair(self, n: int) -> tuple[int, int]:
        """A new (forward, backward) pair of C sides over layers 0..n-1 (n >= 1)."""
        out = []
        for i in (0, 1):
            ptr = self.lib.rp_side_new(n, self.extra, *self.args[i])
            if not ptr:
                raise MemoryError("the planner kernel could not allocate a side of the cap walk")
            self.sides.append(ptr)
            out.append(ptr)
        return out[0], out[1]

    def walk(self, sides: tuple[int, int], n: int, down: bool, lo: tuple[float, float], hi: float) -> Walk:
        """Both sides of a `pair` walking up from lo (per side; hi: math.inf) or down from the largest sum below
        hi to lo, as `_Caps(p, n, lo, hi)`."""
        for ptr, x in zip(sides, lo):
            self.lib.rp_walk_start(ptr, int(down), x, hi)
        return Walk(self, sides, n, down)

    def close(self) -> None:
        """Free every C side (the walks made from them must not step again)."""
        for ptr in self.sides:
            self.lib.rp_side_free(ptr)
        self.sides = []


class Walk:
    """Both sides of one fused size walking one way in C: `cap_walk._PyWalk` (caps.c, rp_step)."""

    def __init__(self, walks: CapWalks, sides: tuple[int, int], n: int, down: bool):
        self.rp_step, self.scratch, self.n = walks.lib.rp_step, walks.scratch, n
        self.cap, self.out = walks.cap, walks.out
        self.args = (*sides, int(down), self.cap.buffer_info()[0], self.out.buffer_info()[0])

    def step(self) -> tuple | None:
        """As `cap_walk._PyWalk.step`: None when no cap is left, else ([(k0, new layouts that may fit) forward,
        backward], (next cap, the backward side's fewest stages under it) or None); k0 is the fewest stages at
        the cap, -1 for a side whose caps do not include it."""
        rc = self.rp_step(*self.args)
        if rc <= 0:
            if rc < 0:
                raise MemoryError("the planner kernel could not grow the cap walk's set of layouts")
            return None
        out = self.out
        fresh = [(out[0], self._layouts(0, out[1]) if out[1] else []),
                 (out[2], self._layouts(1, out[3]) if out[3] else [])]
        return fresh, None if rc == 2 else (self.cap[0], out[4])

    def _layouts(self, i: int, count: int) -> list[tuple[int, ...]]:
        """The first `count` new layouts of side i at the last cap, as stage sizes."""
        sizes, lens, _, fresh = self.scratch[i]
        n = self.n
        return [tuple(sizes[c * n:c * n + lens[c]]) for c in fresh[:count]]
