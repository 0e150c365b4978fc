"""Data parallelism across processes (issue #9): 2 gloo processes on localhost == 1 process on the global batch.

The processes are launched as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the env; compile(..., dist=...) initialises gloo from them).
"""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

import rpcompile
from rpcompile.ir.hardware import Hardware
from rpcompile.runtime.distributed import DistConfig, ring_allreduce_time, shard
from rpcompile.models.zoo import LlamaConfig, TinyLlama
from tests.dist_launch import launch

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=64, max_seq=32)
B, M, STEPS, WORLD = 8, 4, 5, 2  # global batch B in M microbatches; each of WORLD processes: B/2 in M/2


def batch(seed: int, b: int = B) -> dict:
    ids = torch.randint(0, 64, (b, 16), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def make(staleness: int, example: dict, microbatches: int, optimizer=None, **kw) -> rpcompile.Compiled:
    return rpcompile.compile(TinyLlama(CFG), gpus=2, example=example, microbatches=microbatches,
                             staleness=staleness, optimizer=optimizer or rpcompile.AdamW(lr=1e-2, impl="foreach"),
                             memory_budget=2**20, backend="host", **kw)


KERNELS = rpcompile.AdamW(lr=1e-2, max_grad_norm=0.5)  # the C++ kernels, with clipping by the global norm
BF16_GRADS = rpcompile.AdamW(lr=1e-2, max_grad_norm=0.5, grad_dtype=torch.bfloat16)  # bf16 host gradients


def params(c: rpcompile.Compiled) -> dict:
    return {n: p.detach().clone() for n, p in c.model().named_parameters()}


def worker(mode: str, out: str) -> None:
    """One process of a 2-process run (called in a subprocess; the env says which rank)."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    local = lambda i: shard(batch(i), rank, WORLD)  # noqa: E731
    if mode == "equal":
        res = {}
        for st in (0, 1):
            with make(st, local(0), M // WORLD, dist=DistConfig(timeout_s=30)) as c:
                res[f"loss{st}"] = [c.step(local(i)) for i in range(STEPS)]
                res[st] = params(c)
                c.save(f"{out}.ckpt{st}.rank{rank}")  # a no-op on rank 1
        torch.save(res, f"{out}.{rank}")
        return
    if mode in ("kernels", "bf16grads"):  # the averaged gradient is taken in place (bf16: widened); its norm clips
        opt = KERNELS if mode == "kernels" else BF16_GRADS
        with make(0, local(0), M // WORLD, optimizer=opt, dist=DistConfig(timeout_s=30)) as c:
            torch.save({"loss": [c.step(local(i)) for i in range(STEPS)], "params": params(c)}, f"{out}.{rank}")
        return
    c = make(0, local(0), M // WORLD, dist=DistConfig(timeout_s=20))
    c.step(local(0))
    if rank == 1:  # dies inside its second step, in the fused stage's compute
        fused = c._runtime.handlers[rpcompile.Op.FUSED]
        c._runtime.handlers[rpcompile.Op.FUSED] = lambda t, ins, dev: os._exit(3) if t == 1 else fused(t, ins, dev)
    t0, err = time.perf_counter(), None
    try:
        for i in range(1, 4):
            c.step(local(i))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        err = f"{type(exc).__name__}: {exc}"
    try:
        again = c.step(local(4)) and "stepped"
    except Exception as exc:  # noqa: BLE001
        again = str(exc).splitlines()[0]
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"error": err, "seconds": time.perf_counter() - t0, "again": again}, f)
    c.close()


def _launch(mode: str, out: str, timeout: float):
    """Run `worker(mode, out)` as WORLD processes with torchrun's env on a free localhost port."""
    return launch([f"from tests.runtime.test_distributed import worker; worker({mode!r}, {out!r})"] * WORLD, timeout)


def _close(a: dict, b: dict, rel: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for n, v in a.items():
        ref = b[n].float()
        assert torch.allclose(v, ref, rtol=rel, atol=rel * ref.abs().max().item()), \
            f"{n}: max diff {(v - ref).abs().max().item():.3g}"


def test_two_processes_equal_one_process_on_the_global_batch(tmp_path):
    out = str(tmp_path / "r")
    runs = _launch("equal", out, timeout=120)
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    got = [torch.load(f"{out}.{rank}") for rank in range(WORLD)]
    assert os.path.exists(f"{out}.ckpt0.rank0") and os.path.exists(f"{out}.ckpt1.rank0")  # only rank 0 writes
    assert not os.path.exists(f"{out}.ckpt0.rank1") and not os.path.exists(f"{out}.ckpt1.rank1")
    for st in (0, 1):
        for n in got[0][st]:  # the processes hold the same weights (same reduced gradients, same update)
            assert torch.equal(got[0][st][n], got[1][st][n]), n
        with make(st, batch(0), M) as single:
            losses = [single.step(batch(i)) for i in range(STEPS)]
            want = params(single)
        _close(got[0][st], want)
        assert got[0][f"loss{st}"] == pytest.approx(losses, rel=1e-5)  # reported loss: mean over processes


def test_two_processes_with_the_kernels_and_clipping_equal_one_process(tmp_path):
    out = str(tmp_path / "k")
    for r in _launch("kernels", out, timeout=120):
        assert r.returncode == 0, r.stderr[-3000:]
    got = [torch.load(f"{out}.{rank}") for rank in range(WORLD)]
    for n in got[0]["params"]:
        assert torch.equal(got[0]["params"][n], got[1]["params"][n]), n
    with make(0, batch(0), M, optimizer=KERNELS) as single:
        losses = [single.step(batch(i)) for i in range(STEPS)]
        assert single.state.kernels is not None and single.state.norms  # the kernels ran, the norm was taken
        _close(got[0]["params"], params(single))
    assert got[0]["loss"] == pytest.approx(losses, rel=1e-5)


def test_two_processes_with_bf16_gradients_hold_the_same_weights_and_train_like_one_process(tmp_path):
    # the bf16 gradients are widened to fp32 for the all-reduce and the average is stored back rounded
    # stochastically with the same key on every rank: the same bits everywhere
    out = str(tmp_path / "b")
    for r in _launch("bf16grads", out, timeout=120):
        assert r.returncode == 0, r.stderr[-3000:]
    got = [torch.load(f"{out}.{rank}") for rank in range(WORLD)]
    for n in got[0]["params"]:
        assert torch.equal(got[0]["params"][n], got[1]["params"][n]), n
    with make(0, batch(0), M, optimizer=BF16_GRADS) as single:  # its own bf16 sums: other rounding draws
        losses = [single.step(batch(i)) for i in range(STEPS)]
    assert got[0]["loss"] == pytest.approx(losses, rel=1e-3)


def test_a_dead_process_makes_the_other_fail_not_hang(tmp_path):
    out = str(tmp_path / "d")
    runs = _launch("die", out, timeout=80)
    assert runs[1].returncode == 3
    assert runs[0].returncode == 0, runs[0].stderr[-3000:]
    res = json.load(open(f"{out}.0"))
    assert res["error"] is not None, "rank 0 finished its steps although rank 1 died"
    assert "distributed all-reduce" in res["error"], res["error"][:2000]
    assert res["seconds"] < 30
    assert "cannot continue" in res["again"] or "distributed" in res["again"], res["again"]


def test_a_lane_failure_between_steps_reaches_the_caller_as_itself_then_the_run_cannot_continue():
    # the network lane's collective can fail after a step returned (staleness 1: iteration t's reduction runs
    # during step t + 1); the next step's check raises that failure itself, named once on its first line (it
    # raised "cannot continue (cause: distributed ...)" before, a nested name; a CI run of
    # tests/runtime/test_sharded_state.py's dead-rank test hit it); every later step says the run cannot go on
    import threading
    from rpcompile.runtime.distributed import GradReducer
    r = GradReducer.__new__(GradReducer)  # the fields `_failed` / `check` / `fail` use, no process group
    r.rank, r.world, r.iteration, r._cond, r.error, r.broken, r.told = 0, 2, 3, threading.Condition(), None, None, False
    r.check()  # not broken: nothing to raise
    r._failed("reduce-scatter of layer group 4", RuntimeError("Connection reset by peer"))
    with pytest.raises(RuntimeError) as first:
        r.check()
    line = str(first.value).splitlines()[0]
    assert line == ("distributed reduce-scatter of layer group 4 in iteration 3 (rank 0 of 2) failed: RuntimeError: "
                    "Connection reset by peer"), line
    with pytest.raises(RuntimeError, match=r"^distributed training cannot continue after a failure on rank 0; .*"
                                           r"\(cause: distributed reduce-scatter of layer group 4"):
        r.check()
    told = GradReducer.__new__(GradReducer)  # a failure the caller got from the step itself: later, cannot continue
    told.rank, told._cond, told.broken, told.told = 1, threading.Condition(), None, False
    told.fail(RuntimeError("step failed"))
    with pytest.raises(RuntimeError, match=r"^distributed training cannot continue .*\(cause: RuntimeError: step"):
        told.check()


def test_simulator_adds_the_ring_all_reduce_to_each_host_step():
    from rpcompile import CostTable, StagePlan
    from rpcompile.passes import emit
    from rpcompile.runtime import simulate
    hw = Hardware.preset("rtx4090", net_bandwidth=1e9, net_latency=1e-3)
    c = CostTable.from_lists(fwd=[1e-3] * 4, bwd=[2e-3] * 4, param_bytes=[10**8] * 4, grad_bytes=[10**8] * 4)
    prog = emit(StagePlan.from_str("2,1|1|1,2"), gpus=2, microbatches=2, staleness=0)
    one, two = simulate(prog, c, hw), simulate(prog, c, hw, nodes=2)
    per_layer = ring_allreduce_time(2 * 10**8, 2, 1e9, 1e-3)
    assert per_layer == pytest.approx(0.2 + 2e-3)
    steps = lambda t: {r.template: r.end - r.start for r in t.records if r.op == "O"}  # noqa: E731
    for name, d in steps(two).items():
        assert d == pytest.approx(steps(one)[name] + per_layer)
    assert simulate(prog, c, hw.replace(nodes=2)).makespan == pytest.approx(two.makespan)
    assert two.makespan > one.makespan + 3 * per_layer  # staleness 0: the steps are on the critical path
    with pytest.raises(ValueError, match="nodes"):
        Hardware.preset("rtx4090", nodes=0)
