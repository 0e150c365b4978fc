"""The simulator's event loop in C (events.c), built once per machine, loaded with ctypes; with it the memory
loop (memory.c) and the jobs' dependencies and exposed waits (jobs.c).

`simulate` schedules every instruction of K back-to-back iterations (tens of
thousands of jobs for a paper model) through `events.run_jobs`; in Python that
is about a microsecond per heap operation. events.c is the same loop: the same
events popped in the same (time, kind, sequence number) order, times only
compared, maxed and added, so the starts and ends are the Python's floats bit
for bit (tests/runtime/sim/test_sim_kernel.py). It is built like the planner's
kernel (`rpcompile.ir.clib`); where it is not available, or with
`RPCOMPILE_SIM_KERNEL=0`, `run_jobs` runs the Python loop (`events.run_python`).

    >>> lib = load()  # None without a C compiler
    >>> from rpcompile.runtime.sim.events import Job, run_jobs
    >>> run_jobs([Job(0, 0, 0, 1.0, ()), Job(1, 0, 0, 2.0, (0,))])
    ([0.0, 1.0], [1.0, 3.0])
"""
from __future__ import annotations

import array
import ctypes
import os

from rpcompile.ir.clib import CLibrary
from rpcompile.ir.program import Op

_HERE = os.path.dirname(os.path.abspath(__file__))
LIBRARY = CLibrary("rpcompile_sim", sources=tuple(os.path.join(_HERE, f) for f in ("events.c", "memory.c", "jobs.c")),
                   switch="RPCOMPILE_SIM_KERNEL")


def load() -> ctypes.CDLL | None:
    """The built kernel (built now if this machine has none yet), or None (see the module doc)."""
    lib = LIBRARY.load()
    if lib is not None:
        ptr, i32 = ctypes.c_void_p, ctypes.c_int
        lib.rp_run_jobs.restype = ctypes.c_long
        lib.rp_run_jobs.argtypes = [i32] + [ptr] * 6 + [i32, i32] + [ptr] * 3
        lib.rp_peaks.restype = i32
        lib.rp_peaks.argtypes = [i32] * 4 + [ptr] * 12 + [i32, i32] + [ptr] * 3
        lib.rp_expand_deps.restype = ctypes.c_long
        lib.rp_expand_deps.argtypes = [i32, i32] + [ptr] * 6
        lib.rp_exposed_waits.restype = i32
        lib.rp_exposed_waits.argtypes = [i32] + [ptr] * 9 + [i32, ptr]
        lib.rp_totals.restype = None
        lib.rp_totals.argtypes = [i32, i32] + [ptr] * 8
    return lib


def expand_native(lib: ctypes.CDLL, deps_of: list[list[tuple[int, int, int]]], iterations: int,
                  n: int) -> tuple[array.array, array.array]:
    """`simulator._expand_deps_python` in C (jobs.c): the same (ptr, idx), as int arrays."""
    flat = [x for dl in deps_of for x in dl]
    tptr = array.array("i", [0])
    for dl in deps_of:
        tptr.append(tptr[-1] + len(dl))
    cols = [array.array("i", [x[c] for x in flat] or [0]) for c in range(3)]  # back, since, d
    ptr, idx = array.array("i", bytes(4 * (iterations * n + 1))), array.array("i", bytes(4 * max(1, iterations * len(flat))))
    got = lib.rp_expand_deps(n, iterations, tptr.buffer_info()[0], *(c.buffer_info()[0] for c in cols),
                             ptr.buffer_info()[0], idx.buffer_info()[0])
    del idx[got:]
    return ptr, idx


def exposed_native(lib: ctypes.CDLL, jobs, starts, ends, transfer, compute) -> list[float]:
    """`events.exposed_waits_python` in C (jobs.c): the same floats."""
    return _exposed(lib, jobs, _doubles(starts), _doubles(ends), bytes(transfer), bytes(compute)).tolist()


def totals_native(lib: ctypes.CDLL, jobs, starts, ends, wk: list[int], compute: list[bool], transfer: list[bool],
                  iterations: int, gpus: int) -> tuple[list[float], list[float], list[float]]:
    """`simulator._totals_python` in C (jobs.c): (busy per worker, the latest compute end per iteration, exposed
    wait per worker), the same floats."""
    starts, ends = _doubles(starts), _doubles(ends)
    waits = _exposed(lib, jobs, starts, ends, bytes(transfer) * iterations, bytes(compute) * iterations)
    busy, exposed, ends_t = (array.array("d", bytes(8 * k)) for k in (gpus, gpus, iterations))
    workers = _ints(wk)  # held while C reads it
    addr = lambda a: a.buffer_info()[0]  # noqa: E731
    lib.rp_totals(len(jobs), len(compute), bytes(compute), addr(workers), addr(starts), addr(ends), addr(waits),
                  addr(busy), addr(exposed), addr(ends_t))
    return busy.tolist(), ends_t.tolist(), exposed.tolist()


def _exposed(lib: ctypes.CDLL, jobs, starts: array.array, ends: array.array, transfer: bytes,
             compute: bytes) -> array.array:
    """The exposed wait of every job (jobs.c), as a double array."""
    n = len(jobs)
    lanes = _ints(jobs.lane)
    n_lanes = max(lanes, default=-1) + 1
    ins = [_ints(jobs.dep_ptr), _ints(jobs.dep_idx or [0]), transfer, compute, lanes, starts, ends]
    work, prev, out = array.array("d", bytes(8 * n)), array.array("d", bytes(8 * max(1, n_lanes))), array.array("d", bytes(8 * n))
    addr = [a.buffer_info()[0] if isinstance(a, array.array) else a for a in ins]
    rc = lib.rp_exposed_waits(n, *addr, work.buffer_info()[0], prev.buffer_info()[0], n_lanes, out.buffer_info()[0])
    if rc < 0:
        raise ValueError(f"job {-1 - rc}'s lane {lanes[-1 - rc]} is not one of 0 .. {n_lanes - 1}")
    return out


def _doubles(v) -> array.array:
    """`v` as a C double array (itself when it is one already)."""
    return v if isinstance(v, array.array) and v.typecode == "d" else array.array("d", v)


def _ints(v) -> array.array:
    """`v` as a C int array (itself when it is one already)."""
    return v if isinstance(v, array.array) and v.typecode == "i" else array.array("i", v)


def run_native(lib: ctypes.CDLL, n: int, lanes, chans, cols, n_lanes: int, n_chans: int):
    """`events.run_python` in C: (starts, ends, done), or the first job whose lane is already on another channel."""
    ins = [array.array("i", lanes), array.array("i", chans), array.array("i", cols.priority),
           array.array("d", cols.duration), _ints(cols.dep_ptr), _ints(cols.dep_idx or [0])]
    starts, ends, done = array.array("d", bytes(8 * n)), array.array("d", bytes(8 * n)), bytearray(n)
    done_buf = (ctypes.c_ubyte * n).from_buffer(done) if n else None
    rc = lib.rp_run_jobs(n, *(a.buffer_info()[0] for a in ins), n_lanes, n_chans, starts.buffer_info()[0],
                         ends.buffer_info()[0], ctypes.addressof(done_buf) if n else None)
    if rc == -1:
        raise MemoryError(f"the simulator kernel could not allocate its work space for {n} jobs")
    if rc < -1:
        return int(-2 - rc)
    return starts.tolist(), ends.tolist(), done


def peaks_native(lib: ctypes.CDLL, program, costs, resident: list[set[int]], sizes: list[tuple[int, int]],
                 consumers: dict, wk: list[int], jobs, starts: list[float], ends: list[float]) -> list[int]:
    """`memory._peaks_python` in C (memory.c): each worker's peak bytes, without its resident state.

    Args:
        program, costs: what was simulated; resident: per worker, the layers whose optimizer runs on it.
        sizes: per template instruction, (bytes of the buffer it makes, bytes of workspace while it runs).
        consumers: op -> the ops that use (and free) a same-worker buffer it makes.
        wk, jobs, starts, ends: per job, its physical worker (-1: the host), the jobs, their simulated times.
    """
    instrs, nw, stages = program.instrs, program.gpus, program.plan.stages
    kinds = list(dict.fromkeys(i.op for i in instrs))
    code = {op: c for c, op in enumerate(kinds)}
    frees = bytes(used in consumers.get(made, ()) for used in kinds for made in kinds)
    slots = [(i.stage, i.round if i.op is Op.GRAD_DOWN else i.mb // program.round_size)
             if i.op in (Op.FUSED, Op.BACKWARD, Op.GRAD_DOWN) else (-1, 0) for i in instrs]
    rounds = max((r for _, r in slots), default=0) + 1
    layer_sets = [frozenset(st.layers) for st in stages]
    home = bytes(layer_sets[s] <= resident[w] for w in range(nw) for s in range(len(stages)))
    ints = {k: _ints(v) for k, v in (("op", [code[i.op] for i in instrs]), ("wk", wk),
                                              ("ptr", jobs.dep_ptr), ("idx", jobs.dep_idx or [0]),
                                              ("stage", [s for s, _ in slots]), ("round", [r for _, r in slots]))}
    longs = {k: array.array("q", v) for k, v in (("size", [a for a, _ in sizes]), ("work", [b for _, b in sizes]),
                                               ("grad", [sum(costs.grad_bytes[l] for l in st.layers) for st in stages]))}
    times = array.array("d", starts), array.array("d", ends)
    counted = bytes(i.op not in (Op.STEP, Op.COPY) for i in instrs)
    out = array.array("q", bytes(8 * nw))
    addr = lambda a: a.buffer_info()[0]  # noqa: E731
    rc = lib.rp_peaks(len(instrs), len(wk), nw, len(kinds), addr(ints["op"]), frees, addr(ints["wk"]), addr(times[0]),
                      addr(times[1]), addr(ints["ptr"]), addr(ints["idx"]), addr(longs["size"]), addr(longs["work"]),
                      counted, addr(ints["stage"]), addr(ints["round"]), len(stages), rounds, home,
                      addr(longs["grad"]), addr(out))
    if rc != 0:
        raise MemoryError(f"the simulator's memory kernel could not allocate its work space for {len(wk)} jobs")
    return out.tolist()
