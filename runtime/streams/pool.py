"""A stream-aware buffer pool: a buffer returns only after the events of every stream that used it.

The runtime takes its transfer buffers from a pool (parameter and gradient
slots, uploaded activations on a worker; landing buffers for downloads on the
host, pinned with CUDA), so that in the steady state nothing is allocated per
transfer. `give(handle, events)` returns a buffer at issue time, together with
the events of its last users; the next `take` makes its stream wait for them
on the device, so reuse never blocks the host and the pool does not grow with
how far the issuing threads run ahead of the GPU.

A handle may be created before its buffer exists (`handle()`, bound later by
`bind`): on the host backend a producer runs on a stream thread after its
consumers have been issued and have already released the buffer.

Poison mode (tests): device buffers are filled with NaN (integers: the
smallest value) when handed out, host buffers when their last user is done
(its event *completed*, not merely issued), so a missing dependency reads
poison instead of the right numbers.

    >>> from rpcompile.runtime.streams.host import Abort, DeadlineExceeded, StreamContext, wait_all, HostStream
    >>> ctx = StreamContext(); s = HostStream("w0/x", ctx)
    >>> pool = BufferPool("w0", ctx, device="cpu"); h = pool.take((4,), torch.float32, s, 0)
    >>> pool.give(h, []); pool.take((4,), torch.float32, s, 1).tensor is h.tensor   # reused, not allocated
    True
    >>> s.close()
"""
from __future__ import annotations

import itertools
import threading
from typing import Any

import torch

from rpcompile.runtime.host.pinned import pinned_zeros
from rpcompile.runtime.streams.host import Abort, DeadlineExceeded, StreamContext, wait_all

__all__ = ["Handle", "BufferPool", "poison"]


def poison(t: torch.Tensor) -> None:
    """Fill `t` with NaN (floating), the smallest value (integers) or True (bool)."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).min)


class Handle:
    """A pool buffer as the runtime refers to it; `tensor` is None until the buffer is bound."""

    __slots__ = ("tensor", "base", "flat", "key", "released", "events", "stream", "seq", "freed_at", "lost")

    def __init__(self, seq: int = 0) -> None:
        self.tensor: torch.Tensor | None = None
        self.base: torch.Tensor | None = None  # the pool buffer `tensor` is (a prefix of)
        self.flat = False  # bound as a prefix of a flat buffer
        self.key: Any = None  # bound to the one buffer of a key (see BufferPool.bind)
        self.released = False  # given back (possibly before it was bound)
        self.events: list = []  # the last users' events, from `give`
        self.stream: Any = None  # the stream it was bound on
        self.seq = seq  # issue order of its creation: it may reuse only buffers released before
        self.freed_at = 0  # issue order of its release
        self.lost = False  # a keyed buffer given up after a failure (`BufferPool.forget_keys`): not taken back

    def get(self) -> torch.Tensor:
        """The buffer; raises if nothing was written to it yet (a missing dependency)."""
        if self.tensor is None:
            raise RuntimeError("read a buffer before its producer ran (a missing dependency)")
        return self.tensor


class BufferPool:
    """Buffers keyed by (shape, dtype), each free one with the events it must wait for.

    Args:
        name: for the store's accounting and messages ("w0", "host").
        ctx: the runtime's StreamContext (stats, failure).
        device: where buffers live ("cpu" for host workers and the host side).
        pin: False, or pin the host buffers at their exact size: a `runtime.host.pinned.PinnedAllocator`
            (True: a new one per buffer); each is unregistered when freed or when the allocator closes.
        store: a `Store` that accounts the bytes in use (bound, and not yet free after its last users).
        poison: None, "take" (fill when handed out) or "release" (fill when the last user is done).
        counter: the Stats counter a new buffer increments ("device_allocations" or "host_allocations").
        views: key -> the tensor that key's one buffer is (the host arena's views, `runtime.host.assign`):
            bound there instead of allocated, not counted in `reserved` (the arena is), and not poisoned
            when released (buffers of other keys may share its bytes: the runtime poisons a view at the
            end of its live range, in the stream of its last reader).

    Note:
        Accounting is what is in use, like `torch.cuda.memory_allocated`: a flat buffer counts the
        prefix its current user needs, and a buffer reused before its last users finished is not
        counted twice. `reserved` is everything the pool owns, like `memory_reserved`.
    """

    def __init__(self, name: str, ctx: StreamContext, *, device: Any = "cpu", pin: Any = False,
                 store: Any = None, poison: str | None = None, counter: str = "device_allocations",
                 views: dict | None = None) -> None:
        self.name, self.ctx, self.device, self.pin = name, ctx, torch.device(device), pin
        self.views = dict(views or {})
        self._viewed = {id(v) for v in self.views.values()}
        self.store, self.poison, self.counter = store, poison, counter
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # a keyed buffer was given back
        self._out: set = set()  # keys whose one buffer is handed out
        self._held: dict[tuple, Handle] = {}  # key -> the handle its buffer is handed out to (`forget_keys`)
        ctx.failure.on_fail.append(self._wake)
        self._free: dict[tuple, list[tuple[torch.Tensor, list, int]]] = {}  # key -> (buffer, events, freed at)
        self._seq = itertools.count(1)  # issue order of handle creations and releases
        self._gen: dict[int, int] = {}  # id(buffer) -> how many times it was handed out
        self._live: dict[int, int] = {}  # id(buffer) -> bytes accounted for it (buffers in use)
        self.reserved = 0  # bytes of every buffer the pool owns
        self._made: dict[tuple, int] = {}  # (shape, dtype) -> plain buffers the pool owns of it

    def handle(self) -> Handle:
        """A handle whose buffer is bound later (`bind`), at this point of the issue order."""
        with self._lock:
            return Handle(next(self._seq))

    def take(self, shape: tuple, dtype: torch.dtype, stream: Any, it: int | None, flat: bool = False,
             key: Any = None, capacity: int = 0) -> Handle:
        """A bound handle: a free buffer (`stream` waits for its last users) or a new one."""
        h = self.handle()
        self.bind(h, shape, dtype, stream, it, flat, key, capacity)
        return h

    def bind(self, h: Handle, shape: tuple, dtype: torch.dtype, stream: Any, it: int | None,
             flat: bool = False, key: Any = None, capacity: int = 0) -> torch.Tensor:
        """Give handle `h` a buffer of (shape, dtype) for `stream` (called at issue, or inside the producer).

        Only a buffer released before `h` was created qualifies: its last users were issued
        before `h`'s producer, so waiting for them cannot wait for that producer. With `flat`
        (a 1-D request) any free flat buffer of that dtype at least as long serves (a prefix).
        With `key`, the key has one buffer: while it is handed out, `bind` waits (on the host)
        until its holder gives it back; the pool then never grows however far issue runs ahead.
        A keyed flat buffer grows when a request is larger: the host waits for its last users,
        then a larger one replaces it, so it settles at the largest request of its key.
        A new flat buffer holds max(request, `capacity`) elements (the plan's largest need for it).
        """
        shape = tuple(shape)
        n = _numel(shape)
        plain = ("flat", dtype) if flat else (shape, dtype)
        buf, events, small = None, [], None
        with self._cond:
            if key is not None:  # only from an issuing thread: the holder's releases are issued, not run
                fkey = ("key", key)
                while not self._free.get(fkey) and fkey in self._out:
                    if self.ctx.failure.abandoned(it):
                        raise Abort(f"{self.name}: buffer {key}")
                    if not self._cond.wait(self.ctx.timeout):
                        raise DeadlineExceeded(self.ctx.timeout, f"buffer {key} to be released", f" ({self.name})")
                if self._free.get(fkey):
                    buf, events, _ = self._free[fkey].pop()
                    if flat and buf.numel() < n:  # grow: the next user needs more than the last one
                        small, buf = buf, None
                self._out.add(fkey)
            if buf is None:  # a plain buffer released before `h` was created (a keyed one adopts it)
                free = self._free.get(plain, [])
                fits = [k for k in range(len(free)) if free[k][2] < h.seq and (not flat or free[k][0].numel() >= n)]
                if fits:
                    k = min(fits, key=lambda k: (free[k][0].numel(), -k)) if flat else fits[-1]
                    buf, events, _ = free.pop(k)
        if small is not None:  # a keyed buffer too small: free it once its last users are done
            wait_all(events, self.ctx, it)
            events = []
            with self._lock:
                gone = self._live.pop(id(small), 0)
                self.reserved -= _nbytes(small)
            if self.store is not None:
                self.store.add(-gone)
            del small
        if buf is None and key in self.views:
            buf = self.views[key]
        if buf is None:
            counted = plain if not flat and key is None else None  # `made` counts the plain shaped buffers
            buf = self._new((max(n, capacity),) if flat else shape, dtype, it, counted)
        for e in events:
            stream.wait(e, it)
        if key is not None:
            with self._lock:
                self._held[("key", key)] = h
        view = buf[:n] if flat else buf
        if self.poison == "take":
            stream.submit(lambda b=view: poison(b), "poison", it)
        used = n * buf.element_size()
        with self._lock:  # account physical buffers: a reuse before the last users finished is not new memory
            self._gen[id(buf)] = self._gen.get(id(buf), 0) + 1
            delta = used - self._live.get(id(buf), 0)
            self._live[id(buf)] = used
        if self.store is not None:
            self.store.add(delta)
        h.tensor, h.base, h.stream, h.flat, h.key = view, buf, stream, flat, key
        if h.released:
            self._put_back(h)
        return view

    def recast(self, h: Handle, shape: tuple, dtype: torch.dtype) -> torch.Tensor | None:
        """View bound handle `h`'s buffer as (shape, dtype) from its first byte; None if it holds fewer bytes.

        For a value whose shape or dtype at run time is not the one its buffer was planned at (the
        host pool's downloads, `IssueHandlers`): the buffer stays the one it is, counted at its size.

        >>> from rpcompile.runtime.streams.host import StreamContext, HostStream
        >>> ctx = StreamContext(); s = HostStream("w0/x", ctx); pool = BufferPool("host", ctx)
        >>> h = pool.take((2, 4), torch.float32, s, 0)
        >>> pool.recast(h, (4, 2), torch.bfloat16).shape, pool.recast(h, (5, 4), torch.float32)
        (torch.Size([4, 2]), None)
        >>> s.close()
        """
        shape = tuple(shape)
        raw = h.base.reshape(-1).view(torch.uint8)
        n = _numel(shape) * dtype.itemsize
        if n > raw.numel():
            return None
        h.tensor = raw[:n].view(dtype).view(shape)
        return h.tensor

    def give(self, h: Handle, events: list) -> None:
        """Return `h`'s buffer for reuse once `events` (its last users) complete; at issue time."""
        h.released, h.events = True, [e for e in events if e is not None]
        with self._lock:
            h.freed_at = next(self._seq)
        if h.tensor is not None:
            self._put_back(h)

    def _put_back(self, h: Handle) -> None:
        buf, events = h.base, h.events  # work queued before the release may still read it through `h`
        key = ("key", h.key) if h.key is not None else ("flat", buf.dtype) if h.flat else (tuple(buf.shape), buf.dtype)
        with self._cond:
            if h.lost:  # given up by `forget_keys`: its key has a new buffer, this one goes
                return
            if self._held.get(key) is h:
                del self._held[key]
            self._free.setdefault(key, []).append((buf, events, h.freed_at))
            self._out.discard(key)
            gen = self._gen[id(buf)]
            self._cond.notify_all()
        left = [len(events)]
        lock = threading.Lock()

        def done() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._idle(buf, gen)

        if not events:
            self._idle(buf, gen)
        for e in events:
            e.then(done)

    def made(self) -> dict[tuple, int]:
        """(shape, dtype) -> how many plain (unkeyed, shaped) buffers the pool owns of it."""
        with self._lock:
            return dict(self._made)

    def stock(self, counts: dict[tuple, int], it: int | None) -> None:
        """Own at least counts[(shape, dtype)] plain buffers of each: new ones are free at once.

        Workers play every template worker's part over a rotation, each part first in a later
        iteration, and a plain buffer is made when a part first needs one: stocking every worker's
        pool to the most any worker needed makes those buffers during the warm-up (see
        `Runtime._stock_pools`, after each step). The new buffers count as allocations of iteration `it`.
        """
        for (shape, dtype), want in counts.items():
            for _ in range(want - self.made().get((shape, dtype), 0)):
                buf = self._new(shape, dtype, it, (shape, dtype))
                with self._cond:
                    self._gen[id(buf)] = 0
                    self._free.setdefault((shape, dtype), []).append((buf, [], 0))

    def _new(self, shape: tuple, dtype: torch.dtype, it: int | None, plain: tuple | None) -> torch.Tensor:
        """A new buffer, counted as an allocation of iteration `it` (and in `made` under `plain` if given)."""
        if self.pin:  # exact size, registered (runtime/host/pinned.py): what host-memory admission counts
            buf = pinned_zeros(_numel(shape), dtype, self.pin).view(shape)
        else:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
        self.ctx.stats.add(it, self.counter)
        with self._lock:
            self.reserved += _nbytes(buf)
            if plain is not None:
                self._made[plain] = self._made.get(plain, 0) + 1
        return buf

    def forget_keys(self) -> None:
        """After a failure: keyed buffers handed out to abandoned work are given up (a new one is made when
        their key is next bound): they no longer count in `reserved` or in use, and one given back late is
        dropped, so the pool still owns one buffer per key."""
        gone = 0
        with self._cond:
            for fkey in self._out:
                h = self._held.pop(fkey, None)
                if h is not None:
                    h.lost = True
                    self.reserved -= 0 if id(h.base) in self._viewed else _nbytes(h.base)
                    gone += self._live.pop(id(h.base), 0)
            self._out.clear()
        if self.store is not None:
            self.store.add(-gone)

    def _wake(self) -> None:
        """A failure: wake every `bind` waiting for a keyed buffer (it re-checks for abandonment)."""
        with self._cond:
            self._cond.notify_all()

    def _idle(self, buf: torch.Tensor, gen: int) -> None:
        """The buffer's last user finished: stop accounting it (and poison it, host side), unless retaken.

        Called from the events' `then` once they completed (a CUDA event's `then` runs on the worker's
        watcher when the GPU has reached it, not when it was issued). The poison is written under the
        pool's lock: a `bind` that retakes the buffer meanwhile sees it either before (and skips it)
        or after the fill, so the next user's writes, queued after `bind` returns, come after it.
        """
        with self._lock:
            if self._gen.get(id(buf)) != gen or id(buf) not in self._live:
                return
            used = self._live.pop(id(buf))
            if self.poison == "release" and id(buf) not in self._viewed:
                poison(buf)
        if self.store is not None:
            self.store.add(-used)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
