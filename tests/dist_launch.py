"""Launch Python snippets as the ranks of one torch.distributed job on localhost, as torchrun would.

    >>> runs = launch(["from tests.x import worker; worker()"] * 2, timeout=60)   # doctest: +SKIP
    >>> [r.returncode for r in runs]                                             # doctest: +SKIP
    [0, 0]

Each process gets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (a free port) and
LOCAL_RANK, one CPU thread, and the repository and tests/ on its path.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(codes: list[str], timeout: float) -> list[subprocess.CompletedProcess]:
    """Run `codes[r]` as rank r of len(codes) processes; their results, in rank order (killed at the timeout)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world, procs = len(codes), []
    path = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])
    for rank, code in enumerate(codes):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", PYTHONPATH=path)
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return done
