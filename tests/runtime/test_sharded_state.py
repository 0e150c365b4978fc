"""Sharded host state (`compile(..., dist=True, shard_state=True)`): W gloo processes, each holding 1/W of the
masters and optimizer moments, train like one process on the global batch (runtime/sharded/).

The processes are launched as torchrun would (tests/dist_launch.py).
"""
from __future__ import annotations

import dataclasses
import os
import re
import time

import pytest
import torch

import rpcompile
from rpcompile import checkpoint
from rpcompile.runtime.distributed import DistConfig, shard
from rpcompile.runtime.host.shard_comm import ring_allreduce_bytes
from rpcompile.models.zoo import LlamaConfig, TinyLlama
from tests.dist_launch import launch
from tests.runtime.test_distributed import _close, batch

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=64, max_seq=32)
B, M, STEPS, WORLD = 8, 4, 6, 2  # global batch B in M microbatches; each of WORLD processes: B/2 in M/2
ADAMW = rpcompile.AdamW(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)  # the C++ kernels, decay, global-norm clip


def make(staleness: int, example: dict, microbatches: int, optimizer=ADAMW, model=None,
         **kw) -> rpcompile.Compiled:
    return rpcompile.compile(model or TinyLlama(CFG), gpus=2, example=example, microbatches=microbatches,
                             staleness=staleness, optimizer=optimizer, memory_budget=2**20, backend="host", **kw)


def other_start(rank: int) -> TinyLlama:
    """The model, its weights moved on ranks other than 0: the run must start from rank 0's (broadcast)."""
    model = TinyLlama(CFG)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * rank)
    return model


LEAN = rpcompile.AdamW(lr=1e-2, weight_decay=0.1, state_dtype=torch.bfloat16, master_dtype=torch.bfloat16,
                       grad_dtype=torch.bfloat16)  # 10 B per parameter, every bf16 value rounded stochastically


def same_bits(out: str) -> None:
    """One rank: the same 4 steps with whole and with sharded state (data parallel both, bf16 compute copies), fp32
    and lean state; the bytes it sends in the sharded steps."""
    torch.set_num_threads(1)
    rank, res = int(os.environ["RANK"]), {}
    for name, opt in (("fp32", rpcompile.AdamW(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)), ("lean", LEAN)):
        for sharded in (False, True):
            with make(1, shard(batch(0), rank, WORLD), M // WORLD, optimizer=opt, dist=DistConfig(timeout_s=60),
                      shard_state=sharded, dtype=torch.bfloat16) as c:
                with Wire() as wire:
                    for i in range(4):
                        c.step(shard(batch(i), rank, WORLD))
                    c._runtime.flush()
                res[name, sharded, "wire"] = (wire.sent, c._dist.wire.total() if sharded else 0)
                res[name, sharded] = {n: p.detach().clone() for n, p in c.model().named_parameters()}
                res[name, "flat"] = sum(c.state.layout.flat)
                res[name, sharded, "bytes"] = sum(t.numel() * t.element_size() for t in c.state.flat.masters) + sum(
                    t.numel() * t.element_size() for m in c.state.flat.moments for t in m.values())
    torch.save(res, f"{out}.{rank}")


def allocated(state) -> dict:
    """Bytes a HostState holds, by HostBytes' categories (its tensors, counted)."""
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return {"weights": size(state.blocks.values()), "masters": size(state.flat.masters), "grads": size(state.flat.grads),
            "optimizer": size(t for m in state.flat.moments for t in m.values())}


class Wire:
    """Counts the bytes this process hands to torch.distributed's point-to-point sends and all-gathers."""

    def __init__(self) -> None:
        self.sent, self._isend, self._all_gather = 0, torch.distributed.isend, torch.distributed.all_gather

    def __enter__(self) -> "Wire":
        def isend(t, *a, **k):
            self.sent += t.numel() * t.element_size()
            return self._isend(t, *a, **k)

        def all_gather(rows, t, *a, **k):
            self.sent += (len(rows) - 1) * t.numel() * t.element_size()
            return self._all_gather(rows, t, *a, **k)
        torch.distributed.isend, torch.distributed.all_gather = isend, all_gather
        return self

    def __exit__(self, *exc) -> None:
        torch.distributed.isend, torch.distributed.all_gather = self._isend, self._all_gather


def worker(out: str) -> None:
    """One rank: 6 steps at staleness 0 and 1 with sharded state; saves weights, copies, slice sizes and bytes."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    res = {}
    for st in (0, 1):
        with make(st, shard(batch(0), rank, WORLD), M // WORLD, dist=DistConfig(timeout_s=60), shard_state=True,
                  model=other_start(rank)) as c:
            res[f"loss{st}"] = [c.step(shard(batch(i), rank, WORLD)) for i in range(STEPS)]
            res[f"need{st}"], res[f"allocated{st}"] = dataclasses.asdict(c.host_bytes()), allocated(c.state)
            res[st] = {n: p.detach().clone() for n, p in c.model().named_parameters()}  # gathered: a collective
            res[f"compute{st}"] = {n: t.clone() for n, t in c.state.compute.items()}
            res[f"owned{st}"] = [hi - lo for lo, hi in c.state.flat.owned]
            res[f"flat{st}"] = list(c.state.layout.flat)
            if rank == 1:  # then rank 1's part of the averaged gradient alone reports a non-finite value (as a
                real = c.state.reduce_scatter_grads  # NaN in the other rank's contribution would): the
                c.state.reduce_scatter_grads = lambda *a: (real(*a)[0], True)  # statistics are global, so
            c.step(shard(batch(STEPS), rank, WORLD))  # both ranks skip the step, as fp16's overflow
            c._runtime.flush()
            res[f"after{st}"] = {n: p.detach().clone() for n, p in c.model().named_parameters()}
    torch.save(res, f"{out}.{rank}")


def _run(fn: str, out: str, world: int = WORLD, *args) -> list[dict]:
    """Run `fn(out, *args)` of this module as `world` processes; what each rank saved."""
    call = f"from tests.runtime.test_sharded_state import {fn}; {fn}({out!r}, *{args!r})"
    for r in launch([call] * world, 300):
        assert r.returncode == 0, r.stderr[-3000:]
    return [torch.load(f"{out}.{rank}") for rank in range(world)]


def die(out: str) -> None:
    """Rank 1 dies inside its second step; rank 0 reports what its steps raised."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    c = make(1, shard(batch(0), rank, WORLD), M // WORLD, dist=DistConfig(timeout_s=20, average_loss=False),
             shard_state=True)  # each rank its own loss: the first collective to fail is one of the lanes
    c.step(shard(batch(0), rank, WORLD))
    if rank == 1:  # dies in the fused stage's compute of iteration 1
        fused = c._runtime.handlers[rpcompile.Op.FUSED]
        c._runtime.handlers[rpcompile.Op.FUSED] = lambda t, ins, dev: os._exit(3) if t == 1 else fused(t, ins, dev)
    t0, err = time.perf_counter(), None
    try:
        for i in range(1, 4):
            c.step(shard(batch(i), rank, WORLD))
        c._runtime.flush()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        err = f"{type(exc).__name__}: {exc}"
    torch.save({"error": err, "seconds": time.perf_counter() - t0}, f"{out}.{rank}")
    c.close()


def write_at_3(out: str, world: int) -> None:
    """One of `world` ranks: 3 sharded steps, then a checkpoint (each rank writes its slice), then steps 4-6 (the
    uninterrupted run's weights)."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    with make(1, shard(batch(0), rank, world), M // world, dist=DistConfig(timeout_s=60), shard_state=True) as c:
        for i in range(STEPS):
            c.step(shard(batch(i), rank, world))
            if i == 2:
                c.save(f"{out}.ckpt")
        torch.save({n: p.detach().clone() for n, p in c.model().named_parameters()}, f"{out}.{rank}")


def resume_at_3(out: str, path: str, world: int) -> None:
    """One of `world` ranks: load the checkpoint at `path` sharded over `world`, steps 4-6; the weights."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    with rpcompile.load(path, TinyLlama(CFG), dist=DistConfig(timeout_s=60), shard_state=True) as c:
        for i in range(3, STEPS):
            c.step(shard(batch(i), rank, world))
        torch.save({n: p.detach().clone() for n, p in c.model().named_parameters()}, f"{out}.{rank}")


def test_two_processes_with_sharded_state_train_like_one_process_on_the_global_batch(tmp_path):
    got = _run("worker", str(tmp_path / "s"))  # rank 1 built its model with other weights: rank 0's are broadcast
    for st in (0, 1):
        for r in range(WORLD):  # the statistics are global: rank 0 skips the step rank 1's part made non-finite
            assert all(torch.equal(got[r][f"after{st}"][n], v) for n, v in got[r][st].items()), r
        owned = [got[r][f"owned{st}"] for r in range(WORLD)]
        assert [sum(x) for x in zip(*owned)] == got[0][f"flat{st}"]  # the slices cover every group once
        assert all(0 < a < f for a, f in zip(owned[0], got[0][f"flat{st}"]) if f > 16)  # and are real slices
        for n in got[0][st]:  # the ranks hold the same weights, bit for bit (masters and compute copies)
            assert torch.equal(got[0][st][n], got[1][st][n]), n
        for n in got[0][f"compute{st}"]:
            assert torch.equal(got[0][f"compute{st}"][n], got[1][f"compute{st}"][n]), n
        with make(st, batch(0), M) as single:
            losses = [single.step(batch(i)) for i in range(STEPS)]
            want = {n: p.detach().clone() for n, p in single.model().named_parameters()}
            whole, whole_need = allocated(single.state), single.host_bytes()
        _close(got[0][st], want)
        assert got[0][f"loss{st}"] == pytest.approx(losses, rel=1e-5)
        for r in range(WORLD):  # host_bytes() is what the rank allocated; the parameter state follows
            need, have = got[r][f"need{st}"], got[r][f"allocated{st}"]  # (copies + gradients) + (masters + moments)/W
            assert {k: need[k] for k in have} == have
            assert (need["weights"], need["grads"]) == (whole["weights"], whole["grads"]) == (whole_need.weights,
                                                                                     whole_need.grads)
            assert need["masters"] + need["optimizer"] <= 0.6 * (whole["masters"] + whole["optimizer"])
        assert sum(got[r][f"need{st}"]["masters"] + got[r][f"need{st}"]["optimizer"] for r in range(WORLD)) == \
            whole["masters"] + whole["optimizer"]



def test_sharded_state_steps_the_same_bits_as_whole_state_with_each_rank_holding_half(tmp_path):
    # the reduce-scatter sums in rank order (c0 + c1, as gloo's all-reduce of two) and each slice is stepped at the
    # group's own element offsets, so the stochastic rounding of bf16 masters, moments and gradients draws the
    # same bits as one rank stepping the whole group
    got = _run("same_bits", str(tmp_path / "b"))
    for name in ("fp32", "lean"):
        for n, want in got[0][name, False].items():
            assert torch.equal(got[0][name, True][n], want), (name, n)
            assert torch.equal(got[1][name, True][n], want), (name, n)
        # bytes on the wire per step, counted at torch.distributed: at most what each rank sends in today's ring
        # all-reduce of the fp32 gradient (3/4 of it: 4 bytes a gradient element over, 2 a compute copy's back)
        allreduce = ring_allreduce_bytes(got[0][name, "flat"], WORLD) // WORLD * 4
        for r in range(WORLD):
            sent, counted = got[r][name, True, "wire"]
            assert 0 < sent == counted <= 0.76 * allreduce, (sent, counted, allreduce)
        whole, halves = got[0][name, False, "bytes"], [got[r][name, True, "bytes"] for r in range(WORLD)]
        assert sum(halves) == whole and max(halves) <= 0.6 * whole, (whole, halves)


def test_a_sharded_checkpoint_loads_on_one_process_and_on_another_number_of_ranks(tmp_path):
    with make(1, batch(0), M) as single:  # the reference: 6 steps of one process on the global batch
        for i in range(STEPS):
            single.step(batch(i))
        want = {n: p.detach().clone() for n, p in single.model().named_parameters()}
    uninterrupted = {}  # written -> rank 0's weights after 6 uninterrupted steps on that many ranks
    for written, resumed in ((2, 4), (2, 2)):  # resharding down is W=2 -> one process below
        out = str(tmp_path / f"w{written}")
        if written not in uninterrupted:
            uninterrupted[written] = _run("write_at_3", out, written, written)[0]
        assert all(os.path.exists(f"{out}.ckpt" + ("" if r == 0 else f".shard{r}-of-{written}"))  # each rank's slice
                   for r in range(written))
        if written == 2:  # W=2 -> one process, not sharded
            with rpcompile.load(f"{out}.ckpt", TinyLlama(CFG)) as one:
                with pytest.raises(ValueError, match=r"rank 0 of 2.s slice .* other ranks. slices are needed"):
                    one.load_state_dict(checkpoint.load(f"{out}.ckpt"))  # rank 0's slice alone
                for i in range(3, STEPS):
                    one.step(batch(i))
                _close({n: p.detach().clone() for n, p in one.model().named_parameters()}, want)
            os.rename(f"{out}.ckpt.shard1-of-2", f"{out}.away")
            with pytest.raises(ValueError, match=r"written by 2 ranks, but the slices \[.*shard1-of-2'\] are missing"):
                rpcompile.load(f"{out}.ckpt", TinyLlama(CFG))
            os.rename(f"{out}.away", f"{out}.ckpt.shard1-of-2")
        got = _run("resume_at_3", str(tmp_path / f"r{resumed}{written}"), resumed, f"{out}.ckpt", resumed)
        for r in range(resumed):
            _close(got[r], want)
            assert all(torch.equal(got[r][n], got[0][n]) for n in got[0])
        if resumed == written:  # a restart on as many ranks continues bit for bit
            assert all(torch.equal(got[0][n], v) for n, v in uninterrupted[written].items())


def test_a_dead_rank_makes_the_other_fail_in_one_line_naming_the_collective_and_the_layer_group(tmp_path):
    out = str(tmp_path / "d")
    runs = launch([f"from tests.runtime.test_sharded_state import die; die({out!r})"] * WORLD, 120)
    assert runs[1].returncode == 3
    assert runs[0].returncode == 0, runs[0].stderr[-3000:]
    res = torch.load(f"{out}.0")
    assert res["error"] is not None, "rank 0 finished its steps although rank 1 died"
    assert re.search(r"distributed (reduce-scatter|all-gather) of layer group \d+ in iteration \d+ \(rank 0 of 2\) "
                     r"failed: ", res["error"]), res["error"][:2000]
    assert res["error"].splitlines()[0].count("distributed") == 1, res["error"][:2000]  # named once, not nested
    assert res["seconds"] < 60
