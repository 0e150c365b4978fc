"""The stream layer's building blocks on the host (DESIGN.md 3a): host streams and events, a failure that releases
every waiter, and the buffer pool (reuse after the last users, poison, keyed buffers after a failure).

The runtime over these blocks, in poison mode with each kind of dependency, is in tests/runtime/test_streams.py;
the CUDA side of the stream layer, against a fake `torch.cuda`, in tests/runtime/test_cuda_streams.py.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from rpcompile.runtime.streams.pool import BufferPool  # noqa: E402
from rpcompile.runtime.streams.host import Abort, HostEvent, HostStream, StreamContext  # noqa: E402


def test_host_stream_defers_work_and_orders_it():
    ctx = StreamContext(timeout=5.0)
    a, b = HostStream("a", ctx), HostStream("b", ctx)
    gate, out = threading.Event(), []
    try:
        a.submit(gate.wait, "block", 0)
        a.submit(lambda: out.append("a1"), "a1", 0)
        ev = a.record(0)
        b.wait(ev, 0)  # b's later work waits for a's event without blocking the host
        b.submit(lambda: out.append("b1"), "b1", 0)
        time.sleep(0.05)
        assert out == [] and not ev.query()  # nothing ran yet: submit returned at once
        gate.set()
        b.synchronize()
        assert out == ["a1", "b1"] and ev.query()
    finally:
        a.close(), b.close()


def test_a_failure_releases_every_waiter():
    ctx = StreamContext(timeout=30.0)
    s = HostStream("s", ctx)
    ev = HostEvent(ctx, 3, "never set")
    try:
        s.wait(ev, 3)
        s.submit(lambda: None, "after", 3)
        done = s.record(3)
        t0 = time.perf_counter()
        threading.Timer(0.1, lambda: ctx.failure.fail(2, "w0 F0.m0", RuntimeError("boom"))).start()
        with pytest.raises(Abort):
            done.wait()
        assert time.perf_counter() - t0 < 5 and ev.aborted
    finally:
        s.close()


@pytest.mark.parametrize("kind", ["host", "host-cuda host event", "host-cuda launch event"])
def test_after_recovery_a_live_iteration_waits_past_an_aborted_event_of_the_abandoned_one(kind):
    """Iteration 1 failed (its events aborted) and was recovered (the failure reset); its retry waits on an event
    the abandoned attempt left aborted (a buffer it held, now free): the wait is done, the retry runs."""
    from rpcompile.runtime.streams.launch import HostOps, LaunchStream
    ctx = StreamContext(timeout=5.0)
    host = HostStream("w0/x", ctx)
    s = host if kind == "host" else LaunchStream("w0/x", ctx, HostOps(host))
    other = LaunchStream("w1/x", ctx, HostOps(HostStream("w1/x", ctx)))
    try:
        if kind == "host-cuda launch event":  # recorded behind a wait on host work: in w1's backlog
            other.wait(HostEvent(ctx, 1, "h C.l0"), 1)
            ev = other.record(1, "w1 X.m0")
        else:
            ev = HostEvent(ctx, 1, "w1 X.m0")
        ctx.failure.fail(1, "w1 X.m0", RuntimeError("boom"))  # iteration 1 abandoned: its events aborted
        other.synchronize()
        assert ev.query() and ev.aborted
        ctx.failure.reset()  # recovered: iteration 1 runs again
        out = []
        s.wait(ev, 1)
        s.submit(lambda: out.append("retry"), "retry", 1)
        done = s.record(1)
        done.wait()
        assert out == ["retry"] and not done.aborted
    finally:
        s.close(), other.close()
        if s is not host:
            host.close()


def test_pool_reuses_after_the_last_users_and_poisons():
    ctx = StreamContext(timeout=5.0)
    s = HostStream("s", ctx)
    pool = BufferPool("w0", ctx, poison="take")
    try:
        h = pool.take((2, 3), torch.float32, s, 0)
        s.submit(lambda: h.get().fill_(1.0), "write", 0)
        user = s.record(0)
        pool.give(h, [user])
        h2 = pool.take((2, 3), torch.float32, s, 1)  # same buffer, handed out again: poisoned on s
        s.synchronize()
        assert h2.tensor.data_ptr() == h.tensor.data_ptr() and torch.isnan(h2.tensor).all()
        assert ctx.stats.get(1)["device_allocations"] == 0 and ctx.stats.get(0)["device_allocations"] == 1
        flat = BufferPool("w1", ctx)
        f = flat.take((4,), torch.float32, s, 2, flat=True, key="p", capacity=10)  # sized by the plan's need
        flat.give(f, [])
        g = flat.take((10,), torch.float32, s, 3, flat=True, key="p")  # a larger stage: a prefix of the same
        assert g.base is f.base and ctx.stats.get(3)["device_allocations"] == 0
        flat.give(g, [])
        big = flat.take((16,), torch.float32, s, 4, flat=True, key="p")  # beyond it: the key's buffer grows
        assert big.base.numel() == 16 and flat.reserved == 16 * 4
    finally:
        s.close()


def test_a_buffer_reused_before_its_last_users_finish_stays_in_use_until_its_new_holder_is_done():
    # the first holder's user completes after the buffer was handed out again: it is still in use (counted once,
    # not poisoned under its new holder's data) until that new holder gives it back and its users finish; then
    # it is poisoned (poison mode "release")
    from rpcompile.runtime.streams.devices import Store
    ctx = StreamContext(timeout=5.0)
    s = HostStream("s", ctx)
    store = Store("host")
    pool = BufferPool("host", ctx, store=store, poison="release")
    gate = threading.Event()
    try:
        h = pool.take((1024,), torch.float32, s, 0)
        s.submit(gate.wait, "the first holder's user, still running", 0)
        pool.give(h, [s.record(0)])
        h2 = pool.take((1024,), torch.float32, s, 1)  # the same buffer, before its last user finished
        s.submit(lambda: h2.get().fill_(2.0), "the new holder writes", 1)
        written = s.record(1)
        assert h2.base is h.base and store.bytes == 4096  # counted once
        gate.set()
        written.wait()  # the first holder's user is done
        assert store.bytes == 4096 and torch.equal(h2.get(), torch.full((1024,), 2.0))
        pool.give(h2, [written])  # its last user is done: free, and poisoned now
        assert store.bytes == 0 and pool.reserved == 4096 and torch.isnan(h2.base).all()
    finally:
        gate.set()
        s.close()


def test_after_a_failure_a_keyed_buffer_is_given_up_and_counted_once():
    # recovery forgets the keyed buffers abandoned work holds: the key gets a new buffer, the pool still owns
    # (reserved) and uses one per key, and the old one given back late is dropped, not kept beside the new
    ctx = StreamContext(timeout=5.0)
    s = HostStream("s", ctx)
    pool = BufferPool("host", ctx)
    try:
        old = pool.take((2, 3), torch.float32, s, 0, key="a")
        keep = pool.take((4,), torch.float32, s, 0, key="b")
        pool.give(keep, [])  # given back before the failure: not given up
        pool.forget_keys()
        assert pool.reserved == 4 * 4 and old.lost and not keep.lost
        new = pool.take((2, 3), torch.float32, s, 1, key="a")  # at once: no wait for the abandoned holder
        assert new.base is not old.base and pool.reserved == (6 + 4) * 4
        pool.give(old, [])  # the abandoned work's late release
        pool.give(new, [])
        again = pool.take((2, 3), torch.float32, s, 2, key="a")
        assert again.base is new.base and pool.reserved == (6 + 4) * 4
        assert pool.take((4,), torch.float32, s, 2, key="b").base is keep.base
    finally:
        s.close()
