"""A pure function's value computed in a forked child process while the caller goes on.

`plan_model` finds the longest trainable sequence (a second trace and four
counts of the model) this way while it plans and simulates: on two or more
cores the two overlap. The child starts with the caller's memory as it was at
the fork (the model already built, nothing copied) and sends the value back
through a pipe. Where no child can run at the same time (not Linux, one core,
or not asked), or when the child dies before it answers, the value is computed
in this process when it is asked for: the same value either way.

While the child runs (on one torch thread) this process uses one torch thread
fewer than it had: two processes on all the cores would oversubscribe them, and
each parallel region of this one would then wait at its barrier for a thread
the child's work descheduled (about a time slice: tens of milliseconds a region
on a 2-core machine). The count is restored when the child is done.

    >>> with Background(True, pow, 2, 10) as job:
    ...     job.result()
    1024
"""
from __future__ import annotations

import multiprocessing
import os
import sys
from typing import Any, Callable

import torch


class Background:
    """`fn(*args, **kw)`: in a forked child when `parallel` and it can run alongside, else on `result()`."""

    def __init__(self, parallel: bool, fn: Callable[..., Any], *args: Any, **kw: Any):
        self.call, self.proc, self.pipe, self.threads = (fn, args, kw), None, None, None
        if parallel and sys.platform == "linux" and len(os.sched_getaffinity(0)) > 1:
            ctx = multiprocessing.get_context("fork")  # the child needs the caller's objects, not pickles of them
            self.pipe, send = ctx.Pipe(duplex=False)
            self.proc = ctx.Process(target=_send, args=(send, fn, args, kw), daemon=True)
            self.proc.start()
            send.close()
            self.threads = torch.get_num_threads()  # the child's core is not this process's (module docstring)
            torch.set_num_threads(max(1, min(self.threads, len(os.sched_getaffinity(0)) - 1)))

    def result(self) -> Any:
        """The value: the child's, or computed now (no child, or it died before sending its value)."""
        if self.proc is not None:
            try:
                got = self.pipe.recv()
                self.proc.join()  # it exits once it has sent
                return got
            except (EOFError, OSError):  # it died first (killed, out of memory, a value that does not pickle)
                pass
            finally:
                self.close()
        fn, args, kw = self.call
        return fn(*args, **kw)

    def close(self) -> None:
        """Stop the child if it still runs (the caller failed, or no longer needs it) and wait for it; this
        process gets its torch threads back."""
        if self.proc is not None:
            self.pipe.close()
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join()
            self.proc = None
        if self.threads is not None:
            torch.set_num_threads(self.threads)
            self.threads = None

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _send(send, fn: Callable[..., Any], args: tuple, kw: dict) -> None:
    """In the child: compute the value and send it.

    The child runs torch single-threaded, as torch's DataLoader workers do: an OpenMP thread pool the
    caller started does not survive the fork, and the child's first parallel region would wait on it forever.
    """
    torch.set_num_threads(1)
    send.send(fn(*args, **kw))
    send.close()
