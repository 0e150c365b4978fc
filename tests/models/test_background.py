"""Background: a value computed in a forked child while the caller goes on, the same value as computed here,
and computed here when the child cannot answer."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from rpcompile.models.background import Background

forks = pytest.mark.skipif(sys.platform != "linux" or len(os.sched_getaffinity(0)) < 2,
                           reason="a child runs alongside only on Linux with two cores or more")


@forks
def test_the_value_is_computed_in_a_child_when_parallel_else_here():
    with Background(True, os.getpid) as job:
        assert job.result() != os.getpid()
    with Background(False, os.getpid) as job:
        assert job.result() == os.getpid()


def unpicklable(parent: int):
    return lambda: parent


def killed_unless_in(parent: int) -> str:
    if os.getpid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    return "here"


@forks
def test_a_child_that_cannot_answer_leaves_the_value_to_this_process():
    # a value that does not pickle, and a child killed before it answers: both computed here instead
    with Background(True, unpicklable, os.getpid()) as job:
        assert job.result()() == os.getpid()
    with Background(True, killed_unless_in, os.getpid()) as job:
        assert job.result() == "here"


@forks
def test_closing_stops_a_child_still_at_work():
    start = time.perf_counter()
    with Background(True, time.sleep, 60) as job:
        proc = job.proc
        assert proc.is_alive()
    assert job.proc is None and not proc.is_alive() and proc.exitcode == -signal.SIGKILL
    assert time.perf_counter() - start < 30


@forks
def test_a_child_runs_torch_after_the_caller_started_its_thread_pool():
    # an OpenMP pool does not survive a fork: a child entering a parallel region would wait on it forever
    import subprocess
    code = ("import torch; from rpcompile.models.background import Background\n"
            "torch.set_num_threads(2); torch.ones(1 << 22).add_(1)  # the caller's pool, started\n"
            "with Background(True, torch.ones, 1 << 22) as job:\n"
            "    assert job.result().sum() == 1 << 22 and job.proc is None\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@forks
def test_on_one_core_the_value_is_computed_here():
    # no second core to run a child alongside: forking would only add its cost
    import subprocess
    code = ("import os; from rpcompile.models.background import Background\n"
            "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "with Background(True, os.getpid) as job:\n"
            "    assert job.proc is None and job.result() == os.getpid()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _threads() -> int:
    import torch
    return torch.get_num_threads()


@forks
def test_while_the_child_runs_this_process_leaves_it_a_core():
    """Two processes on all the cores would oversubscribe them: the caller runs one torch thread fewer (at least
    one) while the child works, and gets its threads back when the child is done, or closed, or if it dies."""
    import torch
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    try:
        with Background(True, _threads) as job:
            assert torch.get_num_threads() == max(1, cores - 1)
            assert job.result() == 1  # the child's one thread
        assert torch.get_num_threads() == cores
        with Background(True, time.sleep, 60):
            assert torch.get_num_threads() == max(1, cores - 1)
        assert torch.get_num_threads() == cores
        with Background(True, killed_unless_in, os.getpid()) as job:
            assert job.result() == "here" and torch.get_num_threads() == cores
    finally:
        torch.set_num_threads(before)
