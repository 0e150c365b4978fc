"""HostState with sharded masters and moments (`shard=(rank, world)`), in one process: each rank's slice steps the
bits the whole state steps there, and state dicts reslice between any numbers of ranks.

The collectives that make W processes agree (reduce-scatter, statistics, all-gather) are
tests/runtime/test_sharded_state.py's; here every rank gets the same gradients, so no collective is needed.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import rpcompile
from rpcompile.runtime.host.optimizer import HostState

BF16 = torch.bfloat16
SHAPES = {"a": (37,), "b": (5, 20), "c": (3,), "d": (9, 7), "e": (17, 3), "f": (40,)}  # odd: slices cut them
OWNERS = {"a": (0,), "b": (0,), "c": (1,), "d": (1,), "e": (2,), "f": (0,), "z": (0,)}  # z: frozen (LoRA's base)
MIXED = {"b": BF16, "d": torch.float16}  # with dtype=None each parameter keeps its dtype: groups 0 and 1 hold two
# segments, so a segment's compute copies start past 0 in their block
FP32 = rpcompile.AdamW(lr=1e-2, weight_decay=0.1)
LEAN = rpcompile.AdamW(lr=1e-2, weight_decay=0.1, state_dtype=BF16, master_dtype=BF16, grad_dtype=BF16)
SGD = rpcompile.SGD(lr=1e-2, momentum=0.9, weight_decay=0.1)


def state(opt, shard=None, impl: str = "fused", mixed: bool = False) -> HostState:
    g = torch.Generator().manual_seed(0)
    params = {n: torch.randn(s, generator=g).to(MIXED.get(n, torch.float32) if mixed else torch.float32)
              .requires_grad_() for n, s in SHAPES.items()}
    params["z"] = torch.randn(11, generator=g)  # frozen: a compute copy only, nothing to shard
    return HostState(params, OWNERS, 3, optimizer=dataclasses.replace(opt, impl=impl), dtype=None if mixed else BF16,
                     shard=shard)


def train(s: HostState, steps: int = 3, staleness: int = 0) -> HostState:
    """`steps` iterations of the same gradients for every state: writes, then each group's step and copy."""
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grads = {n: torch.randn(sh, generator=g) for n, sh in SHAPES.items()}
        for n, t in grads.items():
            s.accumulate_grad(n, t)
        for l in reversed(range(3)):
            if staleness:
                s.copy(l)
                s.step(l)
            else:
                s.step(l, copy=True)
                s.copy(l)
    return s


def owned(s: HostState, g: int) -> tuple[int, int]:
    return s.flat.owned[g]


@pytest.mark.parametrize("opt", [FP32, LEAN, SGD], ids=["fp32", "lean", "sgd"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("mixed", [False, True], ids=["bf16", "mixed"])
def test_each_ranks_slice_steps_the_bits_of_the_whole_state_and_the_slices_cover_it(opt, world, staleness, mixed):
    whole = train(state(opt, mixed=mixed), staleness=staleness)
    ranks = [train(state(opt, (r, world), mixed=mixed), staleness=staleness) for r in range(world)]
    assert not mixed or len(whole.layout.segments[0]) == len(whole.layout.segments[1]) == 2
    for g in range(3):
        assert [owned(r, g) for r in ranks] == [(lo, hi) for lo, hi in zip(
            [0] + [owned(r, g)[1] for r in ranks[:-1]], [owned(r, g)[1] for r in ranks])]  # contiguous, in order
        assert owned(ranks[-1], g)[1] == whole.layout.flat[g]
        assert torch.equal(torch.cat([r.flat.masters[g] for r in ranks]), whole.flat.masters[g])
        for k, t in whole.flat.moments[g].items():
            assert torch.equal(torch.cat([r.flat.moments[g][k] for r in ranks]), t), k
        for r in ranks:  # each rank's compute copy holds the update of its own slice (the rest: the gather's)
            lo, hi = owned(r, g)
            for seg in whole.layout.segments[g]:
                a, b = max(lo, seg.start), min(hi, seg.stop)
                if a < b:
                    mine, ref = r.blocks[(g, seg.dtype)], whole.blocks[(g, seg.dtype)]
                    assert torch.equal(mine[a - seg.start:b - seg.start], ref[a - seg.start:b - seg.start])
    for n, t in whole.master.items():  # a parameter's parts, in rank order, are its master
        assert torch.equal(torch.cat([r.master[n].reshape(-1) for r in ranks]), t.reshape(-1)), n
    assert "z" not in whole.master and all(torch.equal(r.compute["z"], whole.compute["z"]) for r in ranks)


def test_the_torch_fallback_steps_the_slices_as_the_kernels_do():
    ranks = [train(state(FP32, (r, 2), impl="foreach")) for r in range(2)]
    kernels = [train(state(FP32, (r, 2))) for r in range(2)]
    assert all(r._lean is not None and r.kernels is None for r in ranks)  # sliced: the flat update in torch
    for a, b in zip(ranks, kernels):
        for g in range(3):
            assert torch.allclose(a.flat.masters[g], b.flat.masters[g], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("opt", [FP32, LEAN], ids=["fp32", "lean"])
def test_state_dicts_reslice_between_any_numbers_of_ranks(opt):
    whole = train(state(opt))
    three = [train(state(opt, (r, 3))) for r in range(3)]
    saved = [s.state_dict() for s in three]
    assert [sd["shard"] for sd in saved] == [[0, 3], [1, 3], [2, 3]]
    for world in (1, 2, 4):  # three ranks' slices into whole state and into 2 or 4 ranks
        for r in range(world):
            s = state(opt, None if world == 1 else (r, world))
            s.load_state_dict(saved[r % 3], slices=[sd for k, sd in enumerate(saved) if k != r % 3])
            for n, t in whole.master.items():
                a, b = s.flat.part(n)
                assert torch.equal(s.master[n].reshape(-1), t.reshape(-1)[a:b]), (world, r, n)
                for k, m in whole.flat.moment[n].items():
                    assert torch.equal(s.flat.moment[n][k].reshape(-1), m.reshape(-1)[a:b]), (world, r, n, k)
            assert s.counts == whole.counts
    one = whole.state_dict()  # and the whole state into three ranks
    for r in range(3):
        s = state(opt, (r, 3))
        s.load_state_dict(one)
        assert all(torch.equal(s.master[n], three[r].master[n]) for n in s.master)


def test_a_slice_alone_or_with_one_missing_is_refused():
    saved = [train(state(FP32, (r, 3))).state_dict() for r in range(3)]
    s = state(FP32, (0, 2))
    with pytest.raises(ValueError, match=r"holds rank 1 of 3's slice .* the other ranks' slices are needed"):
        s.check_state_dict(saved[1])
    before = {n: t.clone() for n, t in s.master.items()}
    with pytest.raises(ValueError, match=r"holds rank 1 of 3's slice .* the other ranks' slices are needed"):
        s.load_state_dict(saved[1])
    assert all(torch.equal(s.master[n], t) for n, t in before.items())  # refused before anything changed
    with pytest.raises(ValueError, match=r"the slices of ranks \[2\] are missing"):
        s.load_state_dict(saved[0], slices=[saved[1]])
    other = train(state(FP32, (1, 2))).state_dict()
    with pytest.raises(ValueError, match="does not belong to a checkpoint of 3 ranks"):
        s.load_state_dict(saved[0], slices=[saved[1], other])


def test_what_a_state_dict_holds_decides_how_it_loads():
    trained = train(state(FP32))
    one = train(state(FP32, (0, 1))).state_dict()  # a one-rank "slice" is the whole state: it loads alone
    assert one["shard"] == [0, 1]
    whole = state(FP32)
    whole.load_state_dict(one)
    assert all(torch.equal(whole.master[n], t) for n, t in trained.master.items())
    fresh = state(FP32).state_dict()  # never stepped: no moments saved, so loading it zeroes them
    whole.load_state_dict(fresh)
    assert all(not t.any() for m in whole.flat.moment.values() for t in m.values())
    slices = [train(state(FP32, (r, 2))).state_dict() for r in range(2)]
    with pytest.raises(ValueError, match="does not belong to a checkpoint of None ranks"):
        whole.load_state_dict(one, slices=[slices[1]])  # whole state and a slice
    bad = dict(slices[1], optim={**slices[1]["optim"], "a": {**slices[1]["optim"]["a"], "exp_avg": torch.zeros(3)}})
    with pytest.raises(ValueError, match=r"optim\['a'\]\['exp_avg'\] is not a torch.float32 tensor of shape"):
        state(FP32, (0, 3)).load_state_dict(slices[0], slices=[bad])
    bad = dict(slices[1], optim={**slices[1]["optim"], "a": {**slices[1]["optim"]["a"],
                                                            "exp_avg": slices[1]["optim"]["a"]["exp_avg"].half()}})
    with pytest.raises(ValueError, match=r"optim\['a'\]\['exp_avg'\] is not a torch.float32 tensor"):
        state(FP32, (0, 3)).load_state_dict(slices[0], slices=[bad])


@pytest.mark.parametrize("opt", [FP32, LEAN], ids=["fp32 gradients", "bf16 gradients"])
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_the_reduce_scatter_leaves_each_rank_the_average_of_its_slice_and_its_part_of_the_statistics(opt, impl):
    ranks = [state(opt, (r, 2), impl=impl) for r in range(2)]
    alike = [state(opt, impl=impl) for _ in range(2)]  # whole state, data parallel: the all-reduce's average
    g = torch.Generator().manual_seed(2)
    grads = [{n: torch.randn(sh, generator=g) for n, sh in SHAPES.items() if n != "c"} for _ in ranks]  # c: none
    for s, w, gs in zip(ranks, alike, grads):
        for n, t in gs.items():
            s.accumulate_grad(n, t)
            w.accumulate_grad(n, t)
    wide = [[s.flat.grads[l].float().clone() for l in range(3)] for s in ranks]  # what each rank contributes
    parts = []
    for r, s in enumerate(ranks):
        for l in range(3):
            def scatter(flat, l=l, r=r):  # the collective: the rank-order sum lands on this rank's slice
                lo, hi = s.flat.owned[l]
                flat[lo:hi] = (wide[0][l] + wide[1][l])[lo:hi]
            parts.append(s.reduce_scatter_grads(l, 2, scatter))
            lo, hi = s.flat.owned[l]
            alike[r].average_grads(l, 2, lambda flat: flat.copy_(wide[0][l] + wide[1][l]))
            assert torch.equal(s.flat.grads[l][lo:hi], alike[r].flat.grads[l][lo:hi])  # the same bits
            want = (wide[0][l] + wide[1][l]) / 2
            got = s.flat.grads[l][lo:hi].float()
            if opt is FP32:
                assert torch.equal(got, want[lo:hi])
            else:  # stored with stochastic rounding: within one bf16 ulp
                assert torch.allclose(got, want[lo:hi], rtol=2 ** -7, atol=0)
    total = sum(sq for sq, _ in parts)  # every rank's parts: the sum of squares of the whole average
    ref = sum(float(((wide[0][l] + wide[1][l]) / 2).double().square().sum()) for l in range(3))
    assert total == pytest.approx(ref, rel=1e-2 if opt is LEAN else 1e-6) and not any(bad for _, bad in parts)
    s = ranks[0]
    s.accumulate_grad("c", torch.tensor([float("nan"), 0.0, 0.0]))
    assert s.reduce_scatter_grads(1, 2, lambda flat: None)[1]  # a non-finite average is reported
