"""The simulator's event loop in C (events.c), built once per machine, loaded with ctypes.

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

LIBRARY = CLibrary("rpcompile_sim", sources=(os.path.join(os.path.dirname(os.path.abspath(__file__)), "events.c"),),
                   switch="RPCOMPILE_SIM_KERNEL")


def load() -> ctypes.CDLL | None:
    """The built kernel (built now if this machine has none yet), or None (see the module doc)."""
    lib = LIBRARY.load()
    if lib is not None:
        ptr, i32 = ctypes.c_void_p, ctypes.c_int
        lib.rp_run_jobs.restype = ctypes.c_long
        lib.rp_run_jobs.argtypes = [i32] + [ptr] * 6 + [i32, i32] + [ptr] * 3
    return lib


def run_native(lib: ctypes.CDLL, n: int, lanes, chans, cols, n_lanes: int, n_chans: int):
    """`events.run_python` in C: (starts, ends, done), or the first job whose lane is already on another channel."""
    ins = [array.array("i", lanes), array.array("i", chans), array.array("i", cols.priority),
           array.array("d", cols.duration), array.array("i", cols.dep_ptr), array.array("i", cols.dep_idx or [0])]
    starts, ends, done = array.array("d", bytes(8 * n)), array.array("d", bytes(8 * n)), bytearray(n)
    done_buf = (ctypes.c_ubyte * n).from_buffer(done) if n else None
    rc = lib.rp_run_jobs(n, *(a.buffer_info()[0] for a in ins), n_lanes, n_chans, starts.buffer_info()[0],
                         ends.buffer_info()[0], ctypes.addressof(done_buf) if n else None)
    if rc == -1:
        raise MemoryError(f"the simulator kernel could not allocate its work space for {n} jobs")
    if rc < -1:
        return int(-2 - rc)
    return starts.tolist(), ends.tolist(), done
