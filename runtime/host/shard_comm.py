"""Collectives of sharded host state: reduce-scatter and all-gather of flat host buffers over gloo.

With the optimizer state sharded over W data-parallel processes, each rank owns one contiguous slice
of every layer group's flat buffers (`slices`). A step then needs two collectives instead of one
all-reduce: `reduce_scatter_` leaves on each rank the sum (or mean) of the fp32 gradient over its own
slice, and `all_gather_` gives every rank every slice of the updated compute copies (bf16/fp16: two
bytes an element). Both run on host tensors over a gloo group, as the all-reduce of
`runtime/distributed.py` does.

Both are built from point-to-point messages (`dist.isend` / `dist.irecv`): at step k = 1 .. W-1, rank r
sends to rank (r + k) mod W and receives from rank (r - k) mod W, so every rank sends (W-1)/W of the
buffer in each collective: the bytes of the reduce-scatter (and of the all-gather) half of a ring
all-reduce. (gloo in torch 2.14 has `reduce_scatter_tensor`, but for equal slices only and with a
summation order of its own.) The reduce-scatter's owner sums the W contributions to its slice in
rank order, ((c_0 + c_1) + c_2) + ..., whichever rank owns the slice: the result is the same bits in
every run, and the same as that sum taken in one process (`canonical_sum`). A ring would add each
slice starting from a different rank, so its bits would depend on which rank owns the slice.

    >>> slices(100, 4)  # 16-element units: 7 units, 2 + 2 + 2 + 1
    [(0, 32), (32, 64), (64, 96), (96, 100)]
    >>> reduce_scatter_bytes(100, 4), all_gather_bytes(100, 4, itemsize=2), ring_allreduce_bytes(100, 4)
    (1200, 600, 2400)

Bytes on the wire per step, all ranks together, for a group of n trainable elements: the
reduce-scatter of the fp32 gradient sends 4(W-1)n and the all-gather of a 2-byte compute copy 2(W-1)n,
together 0.75x the 8(W-1)n of a ring all-reduce of the fp32 gradient (`ring_allreduce_bytes`). A
`WireBytes` counter handed to either collective counts what it actually sends.

Ordering: every rank must call the collectives of one group in the same order, from one thread at a
time (the messages carry no collective id), as the gradient all-reduce's network lane does.

Failures: a peer that dies (gloo sees the closed connection) or hangs (the group's timeout) makes the
collective raise a RuntimeError of one line naming the collective and `what` (e.g. "layer group 3");
afterwards the group can no longer be used (gloo closes the pairs): restart from a checkpoint.
"""
from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rpcompile.ir.host_layout import SEGMENT, shard_slices as slices

__all__ = ["slices", "reduce_scatter_", "all_gather_", "canonical_sum", "WireBytes", "reduce_scatter_bytes",
           "all_gather_bytes", "ring_allreduce_bytes", "CHUNK"]

CHUNK = 1 << 22  # elements: the reduce-scatter's largest message (16 MiB of fp32); it holds 2(W-1) such receives


def reduce_scatter_bytes(numel: int, world: int, rank: int | None = None, itemsize: int = 4,
                         align: int = SEGMENT) -> int:
    """Bytes `reduce_scatter_` sends: rank `rank`'s (every slice but its own), or all ranks' (None)."""
    if rank is None:
        return (world - 1) * numel * itemsize
    lo, hi = slices(numel, world, align)[rank]
    return (numel - (hi - lo)) * itemsize


def all_gather_bytes(numel: int, world: int, rank: int | None = None, itemsize: int = 2,
                     align: int = SEGMENT) -> int:
    """Bytes `all_gather_` sends: rank `rank`'s (its slice, to each of the others), or all ranks' (None)."""
    if rank is None:
        return (world - 1) * numel * itemsize
    lo, hi = slices(numel, world, align)[rank]
    return (world - 1) * (hi - lo) * itemsize


def ring_allreduce_bytes(numel: int, world: int, itemsize: int = 4) -> int:
    """Bytes all ranks together send in a ring all-reduce of `numel` elements: 2(W-1) * numel * itemsize.

    Each rank sends 2(W-1)/W of the buffer (W-1 chunks in the reduce-scatter half, W-1 in the
    all-gather half); `runtime.distributed.ring_allreduce_time` prices the same bytes.
    """
    return 2 * (world - 1) * numel * itemsize


class WireBytes:
    """Counts the bytes a rank sends, per collective and per step (hand it to the collectives as `counter`).

    >>> w = WireBytes()
    >>> w.add("reduce-scatter", 400); w.add("all-gather", 200); w.add("reduce-scatter", 40)
    >>> w.step()
    {'reduce-scatter': 440, 'all-gather': 200}
    >>> w.add("all-gather", 8)
    >>> w.steps, w.current, w.total(), w.total("all-gather"), w.messages
    ([{'reduce-scatter': 440, 'all-gather': 200}], {'all-gather': 8}, 648, 208, 4)
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []   # each finished step's bytes per collective
        self.current: dict[str, int] = {}       # the step being counted
        self.messages = 0                       # point-to-point messages sent, all steps

    def add(self, collective: str, nbytes: int) -> None:
        """One message of `nbytes` sent by `collective` in the current step."""
        self.current[collective] = self.current.get(collective, 0) + nbytes
        self.messages += 1

    def step(self) -> dict[str, int]:
        """Close the current step; its bytes per collective."""
        done, self.current = self.current, {}
        self.steps.append(done)
        return done

    def total(self, collective: str | None = None) -> int:
        """Bytes sent over all steps (the current one included), by `collective` or by all."""
        return sum(n for s in (*self.steps, self.current) for c, n in s.items() if collective in (None, c))


def canonical_sum(parts: Sequence[Tensor]) -> Tensor:
    """((parts[0] + parts[1]) + parts[2]) + ...: the order in which `reduce_scatter_` sums the ranks' parts.

    >>> canonical_sum([torch.tensor([1e8]), torch.tensor([-1e8]), torch.tensor([1.0])]).item()
    1.0
    """
    acc = parts[0].clone()
    for p in parts[1:]:
        acc.add_(p)
    return acc


def _check(flat: Tensor, name: str) -> None:
    if flat.dim() != 1 or not flat.is_contiguous() or flat.device.type != "cpu":
        raise ValueError(f"{name}: needs a 1-D contiguous host tensor (got shape {tuple(flat.shape)} on "
                         f"{flat.device}, contiguous={flat.is_contiguous()})")


def _failed(collective: str, what: str, rank: int, world: int, exc: BaseException) -> RuntimeError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return RuntimeError(f"distributed {collective} of {what} (rank {rank} of {world}) failed: "
                        f"{type(exc).__name__}: {first}")


class _Wire:
    """One collective's messages on `group`: posts them (counting the bytes sent) and waits with a one-line error."""

    def __init__(self, group: Any, collective: str, what: str, counter: WireBytes | None,
                 timeout: datetime.timedelta | None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.collective, self.what, self.counter, self.timeout = collective, what, counter, timeout
        self.pending: list[Any] = []

    def peer(self, r: int) -> int:
        """The global rank of the group's rank `r` (what isend / irecv address)."""
        return r if self.group is dist.group.WORLD else dist.get_global_rank(self.group, r)

    def send(self, t: Tensor, to: int) -> None:
        if t.numel():
            self._post(dist.isend, t, to)
            if self.counter is not None:
                self.counter.add(self.collective, t.numel() * t.element_size())

    def recv(self, t: Tensor, frm: int) -> None:
        if t.numel():
            self._post(dist.irecv, t, frm)

    def _post(self, fn: Any, t: Tensor, r: int) -> None:
        try:
            self.pending.append(fn(t, self.peer(r), group=self.group))
        except Exception as exc:  # noqa: BLE001 - re-raised naming the collective
            raise _failed(self.collective, self.what, self.rank, self.world, exc) from exc

    def take(self) -> list[Any]:
        """The messages posted since the last take (to wait for later)."""
        works, self.pending = self.pending, []
        return works

    def wait(self, works: list[Any] | None = None) -> None:
        """Wait for `works` (default: every message posted and not taken); a dead peer raises at once, a
        hung one after the timeout."""
        works = self.take() if works is None else works
        try:
            for w in works:
                w.wait() if self.timeout is None else w.wait(self.timeout)
        except Exception as exc:  # noqa: BLE001 - re-raised naming the collective
            raise _failed(self.collective, self.what, self.rank, self.world, exc) from exc


def _sum_into(dst: Tensor, rows: Tensor, rank: int, world: int, mean: bool) -> None:
    """dst <- (c_0 + c_1 + ... + c_{W-1}) [/ W], left to right, where c_rank = dst and the other c_j are
    `rows[(rank - j) % W - 1]` (row k-1 came from the rank k steps behind)."""
    part = [dst if j == rank else rows[(rank - j) % world - 1] for j in range(world)]
    acc = part[0]  # a receive buffer, or dst itself on rank 0: summed in place
    for c in part[1:]:
        acc.add_(c)
    if mean:
        acc.div_(world)
    if acc is not dst:
        dst.copy_(acc)


def reduce_scatter_(flat: Tensor, group: Any = None, *, mean: bool = False, what: str = "a flat buffer",
                    align: int = SEGMENT, counter: WireBytes | None = None, chunk: int = CHUNK,
                    timeout: datetime.timedelta | None = None) -> tuple[int, int]:
    """Sum `flat` over the ranks of the gloo `group` into this rank's slice of it, in place; that slice.

    On return `flat[lo:hi]` (`slices(flat.numel(), W, align)[rank]`) holds the sum of every rank's
    `flat[lo:hi]`, taken in rank order (`canonical_sum`), divided by W when `mean`; the rest of `flat`
    is unchanged (this rank's contributions to the other slices). Every rank must call it with a
    buffer of the same numel and dtype, in the same order as its other collectives on `group`.

    Cost: each rank sends and receives (W-1)/W of the buffer (`reduce_scatter_bytes`), in messages of
    at most `chunk` elements; it holds 2(W-1) receive buffers of up to `chunk` elements and adds the
    chunks it has while the next ones travel (W-1 additions over 1/W of the buffer).

    Args:
        flat: a 1-D contiguous host tensor (the fp32 gradient of a layer group).
        group: a gloo process group (default: the default group).
        mean: divide the sum by W (the average of the ranks' gradients).
        what: what the buffer is, for the error message (e.g. "layer group 3").
        align: the slice unit (`slices`).
        counter: a WireBytes that counts the bytes this rank sends, as "reduce-scatter".
        chunk: the largest message, in elements.
        timeout: how long to wait for each message (default: the group's timeout).

    Raises:
        RuntimeError: one line, "distributed reduce-scatter of {what} (rank r of W) failed: ...", when a
            peer died or did not answer within the timeout.
    """
    _check(flat, "reduce_scatter_")
    wire = _Wire(group, "reduce-scatter", what, counter, timeout)
    rank, world = wire.rank, wire.world
    parts = slices(flat.numel(), world, align)
    lo, hi = parts[rank]
    if world == 1:  # the sum (and the mean) of one rank's buffer is the buffer
        return lo, hi
    chunk = max(1, chunk)
    pieces = max(-(-(b - a) // chunk) for a, b in parts)
    rows = min(chunk, hi - lo)
    scratch = [flat.new_empty((world - 1, rows)) for _ in range(min(2, pieces))]
    prev: tuple[int, int, Tensor, list[Any]] | None = None
    for p in range(pieces):
        buf = scratch[p % 2]  # piece p: my part of each other slice to its owner, the others' parts of mine
        for k in range(1, world):
            to, frm = (rank + k) % world, (rank - k) % world
            a, b = parts[to]
            wire.send(flat[min(b, a + p * chunk):min(b, a + (p + 1) * chunk)], to)
            wire.recv(buf[k - 1, :max(0, min(chunk, hi - lo - p * chunk))], frm)
        cur = (min(hi, lo + p * chunk), min(hi, lo + (p + 1) * chunk), buf, wire.take())
        if prev is not None:  # add piece p-1 while piece p travels
            _add(wire, flat, prev, mean)
        prev = cur
    if prev is not None:
        _add(wire, flat, prev, mean)
    return lo, hi


def _add(wire: _Wire, flat: Tensor, piece: tuple[int, int, Tensor, list[Any]], mean: bool) -> None:
    """Wait for one piece's messages, then sum it into `flat`."""
    a, b, buf, works = piece
    wire.wait(works)
    _sum_into(flat[a:b], buf[:, :b - a], wire.rank, wire.world, mean)


def all_gather_(flat: Tensor, group: Any = None, *, what: str = "a flat buffer", align: int = SEGMENT,
                counter: WireBytes | None = None, timeout: datetime.timedelta | None = None,
                parts: Sequence[tuple[int, int]] | None = None) -> tuple[int, int]:
    """Give every rank of the gloo `group` every rank's slice of `flat`, in place; this rank's slice.

    Rank r contributes `flat[lo:hi]` (`slices(flat.numel(), W, align)[r]`) and on return every slice of
    `flat` holds its owner's values, bit for bit, on every rank. Any dtype gloo sends (the bf16/fp16
    compute copies: 2 bytes an element). Each rank sends its slice to each of the others: (W-1)/W of
    the buffer when the slices are equal (`all_gather_bytes`), one message per peer.

    Args:
        flat: a 1-D contiguous host tensor of the same numel and dtype on every rank.
        group, what, align, counter, timeout: as `reduce_scatter_` (the counter counts "all-gather").
        parts: each rank's [lo, hi) of `flat`, in rank order (default `slices(flat.numel(), W, align)`), e.g.
            the owned slices of a group's flat buffers cut to one segment's view of the compute copies.

    Raises:
        RuntimeError: one line, "distributed all-gather of {what} (rank r of W) failed: ...", when a peer
            died or did not answer within the timeout.
    """
    _check(flat, "all_gather_")
    wire = _Wire(group, "all-gather", what, counter, timeout)
    rank, world = wire.rank, wire.world
    parts = slices(flat.numel(), world, align) if parts is None else list(parts)
    lo, hi = parts[rank]
    for k in range(1, world):
        to, frm = (rank + k) % world, (rank - k) % world
        wire.send(flat[lo:hi], to)
        wire.recv(flat[parts[frm][0]:parts[frm][1]], frm)
    wire.wait()
    return lo, hi
