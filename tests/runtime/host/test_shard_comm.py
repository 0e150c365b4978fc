"""The collectives of sharded host state: slices, reduce-scatter and all-gather over gloo, their wire bytes.

The multi-process tests launch W gloo processes as torchrun would (`tests/dist_launch.py`); each rank
runs `worker` and saves what it got, and the parent compares the ranks with one process's sums.
"""
from __future__ import annotations

import datetime
import json
import os
import time

import pytest
import torch

from rpcompile.runtime.host.shard_comm import (WireBytes, all_gather_, all_gather_bytes, reduce_scatter_,
                                               reduce_scatter_bytes, ring_allreduce_bytes, slices)
from tests.dist_launch import launch

# (numel, align, chunk): odd sizes, fewer elements than ranks, pieces smaller than a slice
CASES = [(1000, 16, 1 << 22), (37, 1, 5), (3, 1, 1 << 22), (1, 16, 1 << 22), (0, 16, 4), (517, 16, 64), (1024, 16, 7)]
CHUNKS = (0, 1, 7, 1 << 22)  # the reduce-scatter's largest message, in elements, over 100 elements


def shard_of(case: int, rank: int, numel: int) -> torch.Tensor:
    """Rank `rank`'s fp32 contribution in case `case`: magnitudes 1, 1e3, 1e6 by rank, so the order of a sum shows."""
    g = torch.Generator().manual_seed(1000 * case + rank)
    return torch.randn(numel, generator=g) * 10.0 ** (3 * (rank % 3))


def ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """One process's sum of the ranks' parts, rank 0 first: ((p0 + p1) + p2) + ..."""
    acc = parts[0].clone()
    for p in parts[1:]:
        acc += p
    return acc


def worker(out: str) -> None:
    """One rank: every case's reduce-scatter (sum twice, mean), the all-gathers, the bytes; saved to out.{rank}."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    wire, res = WireBytes(), {"cases": [], "steps": []}
    for case, (numel, align, chunk) in enumerate(CASES):
        got = {}
        for key in ("sum", "again", "mean"):
            flat = shard_of(case, rank, numel)
            lo, hi = reduce_scatter_(flat, mean=key == "mean", align=align, chunk=chunk, counter=wire,
                                     what=f"layer group {case}")
            got[key], got["rest"] = flat[lo:hi].clone(), torch.cat([flat[:lo], flat[hi:]])
            res["steps"].append(wire.step())
        full = shard_of(case, rank, numel)  # reduce-scatter + all-gather: an all-reduce
        reduce_scatter_(full, align=align, chunk=chunk)
        all_gather_(full, align=align)
        got["allreduced"] = full
        for dtype in (torch.bfloat16, torch.float16):
            flat = torch.full((numel,), float(-1 - rank), dtype=dtype)  # garbage outside this rank's slice
            lo, hi = slices(numel, world, align)[rank]
            flat[lo:hi] = shard_of(case, rank, numel)[lo:hi].to(dtype)
            all_gather_(flat, align=align, counter=wire)
            got[str(dtype)] = flat
            res["steps"].append(wire.step())
        res["cases"].append(got)
    res["chunks"] = {}  # messages of at most `chunk` elements (at least 1: chunk 0 sends one element a message)
    for chunk in CHUNKS:
        counted, flat = WireBytes(), shard_of(98, rank, 100)
        lo, hi = reduce_scatter_(flat, align=1, chunk=chunk, counter=counted)
        res["chunks"][chunk] = (counted.messages, flat[lo:hi].clone())
    # groups of some ranks only (W=4: ranks 0, 2 and ranks 1, 3 address their peers by global rank; W=2: alone)
    sub = [dist.new_group(list(range(i, world, 2))) for i in range(2)][rank % 2]
    flat = shard_of(99, rank, 50)
    lo, hi = reduce_scatter_(flat, sub, align=1)
    res["sub"] = (lo, hi, flat[lo:hi])
    torch.save(res, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=["W2", "W4"])
def ranks(request, tmp_path_factory):
    """What each of W ranks saved from `worker`, in rank order (one launch per W for all the tests below)."""
    world, out = request.param, str(tmp_path_factory.mktemp(f"shard{request.param}") / "r")
    runs = launch([f"from tests.runtime.host.test_shard_comm import worker; worker({out!r})"] * world, timeout=120)
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    return [torch.load(f"{out}.{r}") for r in range(world)]


def test_slices_own_every_element_once_in_balanced_aligned_runs():
    assert slices(100, 4) == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert slices(3, 4, align=1) == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert slices(0, 3) == [(0, 0)] * 3
    assert slices(7, 1, align=16) == [(0, 7)]
    for world in range(1, 6):
        for align in (1, 3, 16):
            for numel in range(0, 150):
                parts = slices(numel, world, align)
                assert len(parts) == world and parts[0][0] == 0 and parts[-1][1] == numel
                assert all(a == b_prev for (_, b_prev), (a, _) in zip(parts, parts[1:]))  # contiguous, rank order
                assert all(lo <= hi and (lo % align == 0 or lo == numel) for lo, hi in parts)
                units = [-(-(hi - lo) // align) for lo, hi in parts]
                assert max(units) - min(units) <= 1 and units == sorted(units, reverse=True)
    with pytest.raises(ValueError, match="world >= 1"):
        slices(10, 0)


def test_reduce_scatter_sums_each_slice_in_rank_order_on_its_owner(ranks):
    world = len(ranks)
    for case, (numel, align, _) in enumerate(CASES):
        parts = [shard_of(case, r, numel) for r in range(world)]
        want, exact = ordered_sum(parts), torch.stack(parts).double().sum(0)
        for r, (lo, hi) in enumerate(slices(numel, world, align)):
            got = ranks[r]["cases"][case]
            assert torch.equal(got["sum"], want[lo:hi]), (case, r)       # the same bits as one process's sum
            assert torch.equal(got["again"], got["sum"]), (case, r)     # and as a second run
            assert torch.allclose(got["sum"].double(), exact[lo:hi], rtol=1e-6, atol=1e-6 * exact.abs().max().item()
                                  if numel else 0)
            assert torch.equal(got["mean"], want[lo:hi] / world), (case, r)
            assert torch.equal(got["rest"], torch.cat([parts[r][:lo], parts[r][hi:]]))  # the rest untouched
            assert torch.equal(got["allreduced"], want), (case, r)        # every rank: the same bits, whole


def test_all_gather_gives_every_rank_every_slice_bit_for_bit(ranks):
    world = len(ranks)
    for case, (numel, align, _) in enumerate(CASES):
        for dtype in (torch.bfloat16, torch.float16):
            want = torch.cat([shard_of(case, r, numel)[lo:hi].to(dtype)
                              for r, (lo, hi) in enumerate(slices(numel, world, align))])
            for r in range(world):
                got = ranks[r]["cases"][case][str(dtype)]
                assert got.dtype == dtype and torch.equal(got, want), (case, dtype, r)


def test_reduce_scatter_sends_each_slice_in_messages_of_at_most_chunk_elements(ranks):
    world = len(ranks)
    parts = slices(100, world, 1)
    want = ordered_sum([shard_of(98, r, 100) for r in range(world)])
    for chunk in CHUNKS:
        for r, (lo, hi) in enumerate(parts):
            messages, got = ranks[r]["chunks"][chunk]
            per = max(chunk, 1)  # a chunk below one element is one element
            assert messages == sum(-(-(b - a) // per) for k, (a, b) in enumerate(parts) if k != r), (chunk, r)
            assert torch.equal(got, want[lo:hi]), (chunk, r)


def test_a_group_of_some_ranks_reduces_among_them(ranks):
    world = len(ranks)
    for first in (0, 1):
        members = list(range(first, world, 2))
        want = ordered_sum([shard_of(99, r, 50) for r in members])
        for i, r in enumerate(members):
            lo, hi, got = ranks[r]["sub"]
            assert (lo, hi) == slices(50, len(members), 1)[i] and torch.equal(got, want[lo:hi]), (members, r)


def test_counted_wire_bytes_are_the_formulas_and_at_most_an_all_reduce(ranks):
    world, per_case = len(ranks), 5  # steps per case: 3 reduce-scatters, 2 all-gathers
    for case, (numel, align, _) in enumerate(CASES):
        for r in range(world):
            steps = ranks[r]["steps"][per_case * case:per_case * (case + 1)]
            rs = reduce_scatter_bytes(numel, world, r, itemsize=4, align=align)
            ag = all_gather_bytes(numel, world, r, itemsize=2, align=align)
            assert [s.get("reduce-scatter", 0) for s in steps[:3]] == [rs] * 3 and not any(
                "all-gather" in s for s in steps[:3])
            assert [s.get("all-gather", 0) for s in steps[3:]] == [ag] * 2 and not any(
                "reduce-scatter" in s for s in steps[3:])
        total_rs = sum(reduce_scatter_bytes(numel, world, r, align=align) for r in range(world))
        total_ag = sum(all_gather_bytes(numel, world, r, align=align) for r in range(world))
        assert total_rs == reduce_scatter_bytes(numel, world) == (world - 1) * numel * 4
        assert total_ag == all_gather_bytes(numel, world) == (world - 1) * numel * 2
        # sharded state's step (fp32 gradients reduce-scattered, bf16 copies gathered): 3/4 of an all-reduce
        assert 4 * (total_rs + total_ag) == 3 * ring_allreduce_bytes(numel, world, itemsize=4)
        if numel >= world * align:  # and on each rank, at most its share of the ring all-reduce
            assert all(reduce_scatter_bytes(numel, world, r, align=align) + all_gather_bytes(numel, world, r, align=align)
                       <= ring_allreduce_bytes(numel, world) / world for r in range(world))


def failing(mode: str, out: str) -> None:
    """Rank 0 of 2: collectives after rank 1 died ("die") or stopped answering ("hang"); saves what they raised."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1))
    reduce_scatter_(torch.ones(64), short)  # both ranks connected and answering
    reduce_scatter_(torch.ones(64))
    if rank == 1:
        if mode == "die":
            os._exit(3)
        while not os.path.exists(f"{out}.done"):  # a hung peer: alive, in no collective, until rank 0 is done
            time.sleep(0.05)
        return
    res = []
    calls = [("layer group 3", lambda w: reduce_scatter_(torch.ones(64), short, what=w)),
             ("layer group 2", lambda w: all_gather_(torch.ones(64, dtype=torch.bfloat16), what=w,
                                                     timeout=datetime.timedelta(seconds=1)))]
    for what, call in calls:
        t0 = time.perf_counter()
        try:
            call(what)
            res.append({"error": None})
        except RuntimeError as exc:
            res.append({"error": str(exc), "seconds": time.perf_counter() - t0})
    with open(f"{out}.0", "w") as f:
        json.dump(res, f)
    open(f"{out}.done", "w").close()
    os._exit(0)  # the process group cannot be torn down cleanly after a failure


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_a_dead_or_hung_peer_makes_the_collective_raise_one_line_naming_it(tmp_path, mode):
    out = str(tmp_path / "f")
    code = f"from tests.runtime.host.test_shard_comm import failing; failing({mode!r}, {out!r})"
    t0 = time.perf_counter()
    runs = launch([code] * 2, timeout=60)
    assert runs[0].returncode == 0, runs[0].stderr[-3000:]
    assert runs[1].returncode == (3 if mode == "die" else 0), runs[1].stderr[-3000:]
    res = json.load(open(f"{out}.0"))
    for (collective, what), r in zip([("reduce-scatter", "layer group 3"), ("all-gather", "layer group 2")], res):
        assert r["error"] is not None, f"{collective} returned although its peer was {mode}"
        assert r["error"].startswith(f"distributed {collective} of {what} (rank 0 of 2) failed: "), r["error"]
        assert "\n" not in r["error"]
        assert r["seconds"] < 5  # the group's 1 s timeout / the call's own: never the main group's 30 s
    assert time.perf_counter() - t0 < 30


def test_collectives_refuse_a_buffer_they_cannot_send_in_slices():
    with pytest.raises(ValueError, match="reduce_scatter_: needs a 1-D contiguous host tensor"):
        reduce_scatter_(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="all_gather_: needs a 1-D contiguous host tensor"):
        all_gather_(torch.zeros(8)[::2])
