"""Alternating copies (runtime/host/layout.py `Alternation`): at staleness 1 the compute copies trade places
between two buffers every step (a bf16 master with bf16 copies is one of the two) instead of a copy pass and an
undo copy. The oracle is the same run with alternation off (the copy lane's cast and the undo copies, what
sharded state runs): every loss, master, compute copy and moment bit for bit."""
from __future__ import annotations


import pytest
import torch

import models
import rpcompile.runtime.host.layout as host_layout
import rpcompile.runtime.host.optimizer as host_optimizer
from rpcompile import SGD, AdamW, StagePlan
from rpcompile.hostmem import host_bytes
from rpcompile.passes import emit, trace
from rpcompile.runtime.executor import Runtime
from rpcompile.runtime.host.layout import upload_sources as _sources
from rpcompile.runtime.host.optimizer import HostState
from tests.runtime.test_faults import (BATCHES, GPUS, MBS, PLAN, _graph, _inject, _same, _snapshot,
                                      clean_snapshots, fail_iteration_2)

BF16 = torch.bfloat16
LEAN = AdamW(lr=1e-2, weight_decay=0.1, state_dtype=BF16, master_dtype=BF16)
MODES = {"fp32": AdamW(lr=1e-2, weight_decay=0.1), "fp32-torch": AdamW(lr=1e-2, impl="foreach"),
         "bf16-moments": AdamW(lr=1e-2, state_dtype=BF16), "bf16-master": LEAN,
         "bf16-master-grads": AdamW(lr=1e-2, state_dtype=BF16, master_dtype=BF16, grad_dtype=BF16),
         "bf16-master-torch": AdamW(lr=1e-2, master_dtype=BF16, impl="foreach"),
         "sgd-bf16-master": SGD(lr=0.1, momentum=0.9, master_dtype=BF16), "sgd": SGD(lr=0.1, momentum=0.9)}


def _runtime(graph, optimizer, *, frozen=False, staleness=1, start=0, state=None, dtype=BF16, **kw):
    if state is None:
        if frozen:  # LoRA-style: only the 1-D weights (norms) train; the rest is a frozen base after them
            model = models.llama()
            for p in model.parameters():
                p.requires_grad_(p.dim() == 1)
            graph = trace(model, models.lm_batch(batch=4, seq=8))
        state = HostState.from_graph(graph, optimizer=optimizer, dtype=dtype)
    prog = emit(StagePlan.from_str(PLAN), gpus=GPUS, microbatches=MBS, staleness=staleness)
    return Runtime(graph, prog, state, backend="host", timeout=20, start_iteration=start, **kw), state


def _off(monkeypatch):
    """Alternation off: every state takes the copy lane's cast and the undo copies (the oracle)."""
    monkeypatch.setattr(host_layout, "eligible", lambda state: False)


def _train(graph, optimizer, steps, *, frozen=False, evaluate_at=None, dtype=BF16):
    """(losses, evaluation loss or None, snapshot after a flush, whether it alternated) of `steps` steps."""
    rt, state = _runtime(graph, optimizer, frozen=frozen, dtype=dtype)
    with rt:
        losses, ev = [], None
        for i in range(steps):
            losses.append(rt.step(BATCHES[i % len(BATCHES)]))
            if i == evaluate_at:
                ev = rt.evaluate(BATCHES[0])
        alternated = rt.host.alternating and rt.host._backup_bufs == {}
        rt.flush()
        return losses, ev, _snapshot(state), alternated


CASES = [(m, f, BF16) for m in MODES for f in (False, True)] + [("fp32", False, None), ("bf16-master", False, None)]


@pytest.mark.parametrize("mode, frozen, dtype", CASES,
                         ids=[f"{m}-{'frozen' if f else 'full'}-{'bf16' if d else 'own-dtype'}" for m, f, d in CASES])
def test_alternating_copies_train_bit_for_bit_as_the_copy_pass(monkeypatch, mode, frozen, dtype):
    # 5 steps: an odd number of flips, so the flush swaps the buffers back; an evaluation after step 2 (odd too).
    # frozen: LoRA-style, a frozen base after the trainable part of each block; own-dtype: fp32 compute copies
    g = _graph()
    got = _train(g, MODES[mode], 5, frozen=frozen, evaluate_at=2, dtype=dtype)
    _off(monkeypatch)
    want = _train(_graph(), MODES[mode], 5, frozen=frozen, evaluate_at=2, dtype=dtype)
    assert got[3] and not want[3]
    assert got[0] == want[0] and got[1] == want[1]
    _same(got[2], want[2])


def test_a_bf16_master_with_bf16_copies_is_the_second_buffer_else_the_copies_get_one_of_their_own():
    g = _graph()
    for opt, dtype, shared in ((LEAN, BF16, True), (AdamW(lr=1e-2, state_dtype=BF16), BF16, True),  # split
                               (AdamW(lr=1e-2), BF16, False), (LEAN, None, False),
                               (AdamW(lr=1e-2, state_dtype=BF16), None, False), (AdamW(lr=1e-2), None, False)):
        rt, state = _runtime(g, opt, dtype=dtype)
        with rt:
            assert rt.host.alternating and rt.host._backup_bufs == {}
            for grp, pairs in state.alt.pairs.items():
                assert state.alt.shared[grp] == shared
                for (a, b), s in zip(pairs, state.layout.segments[grp]):
                    assert a.data_ptr() == state.blocks[(grp, s.dtype)].data_ptr() and a.shape == b.shape
                    assert a.dtype == b.dtype == s.dtype
                    assert (b.data_ptr() == state.flat.masters[grp][s.start:].data_ptr()) == shared
    rt, _ = _runtime(g, LEAN, staleness=0)
    with rt:
        assert not rt.host.alternating and rt.state.alt is None and rt.host._backup_bufs == {}
    sharded = HostState.from_graph(g, optimizer=LEAN, dtype=BF16, shard=(0, 2))
    assert not sharded.alternate(0) and sharded.alt is None  # sharded: the copy pass and the undo copies


def test_the_buffers_alternate_each_step_and_a_flush_puts_them_back():
    g = _graph()
    rt, state = _runtime(g, LEAN)
    with rt:
        name = next(n for n in state.master if state.master[n].numel() > 64)
        master, compute = state.master[name], state.compute[name]
        rt.step(BATCHES[0])
        rt.flush()  # one flip: the new master was written into the compute copy's buffer, then swapped back
        w1, c1 = master.clone(), compute.clone()
        assert not torch.equal(w1, c1)  # the copy is a step behind (staleness 1)
        assert state.upload_alternates(1) == {} and state.upload_alternates(2)  # iteration 2 reads the masters
        rt.step(BATCHES[1])
        rt.flush()
        assert torch.equal(compute, w1)  # iteration 2 uploads the master step 0 made ...
        assert not torch.equal(master, w1)  # ... while step 1 made the next one


@pytest.mark.parametrize("opt", [LEAN, AdamW(lr=1e-2)], ids=["bf16-master", "fp32"])
def test_a_fault_before_the_commit_needs_no_undo_and_the_retry_is_bit_for_bit(opt):
    g = _graph()
    want, final = clean_snapshots(*_runtime(g, opt))
    rt, state = _runtime(g, opt, lane_delay=5)
    _inject(rt, 2, iteration=2)
    with rt:
        assert rt.host.alternating
        err, took = fail_iteration_2(rt)
        assert took < 5.0 and err.iteration == 2
        _same(_snapshot(state), want)
        rt.step(BATCHES[2]), rt.step(BATCHES[3])
        rt.flush()
        _same(_snapshot(state), final)


@pytest.mark.parametrize("opt", [LEAN, AdamW(lr=1e-2)], ids=["bf16-master", "fp32"])
def test_a_skipped_step_writes_the_unchanged_copies_across(monkeypatch, opt):
    # iteration 1's gradient of layer 1 is NaN: the iteration is skipped, its steps copy the masters across
    g = _graph()

    def run():
        rt, state = _runtime(g, opt, on_nonfinite="skip")
        with rt:
            for b in BATCHES:
                rt.step(b)
            rt.flush()
            return rt.skipped, _snapshot(state)
    monkeypatch.setattr(host_optimizer.HostState, "accumulate_grad", _poisoning(1))
    got = run()
    _off(monkeypatch)
    want = run()
    assert got[0] == want[0] == [1]
    _same(got[1], want[1])


def _poisoning(layer):
    """HostState.accumulate_grad that writes NaN into one parameter's gradient in iteration 1's (the second) writes."""
    orig = host_optimizer.HostState.accumulate_grad

    def accumulate_grad(self, name, grad, *a, **k):
        canon = self.canonical(name)
        if self.group_of.get(canon) == layer and self._stepped[layer] == 1:
            grad = torch.full_like(grad, float("nan"))
        return orig(self, name, grad, *a, **k)
    return accumulate_grad


@pytest.mark.parametrize("opt", [LEAN, AdamW(lr=1e-2)], ids=["bf16-master", "fp32"])
def test_a_state_dict_after_an_odd_step_resumes_bit_for_bit(opt):
    g = _graph()
    ref, s_ref = _runtime(g, opt)
    with ref:
        for i in range(6):
            ref.step(BATCHES[i % 4])
        ref.flush()
        want = _snapshot(s_ref)
    first, s1 = _runtime(g, opt)
    with first:
        for i in range(3):
            first.step(BATCHES[i % 4])
        first.flush()
        sd = s1.state_dict()
    s2 = HostState.from_graph(g, optimizer=opt, dtype=BF16)
    s2.load_state_dict(sd)
    resumed, _ = _runtime(g, opt, state=s2, start=3)
    with resumed:
        for i in range(3, 6):
            resumed.step(BATCHES[i % 4])
        resumed.flush()
    _same(_snapshot(s2), want)


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("opt", [LEAN, AdamW(lr=1e-2, state_dtype=BF16), AdamW(lr=1e-2)],
                         ids=["bf16-master", "split-master", "fp32-master"])
def test_the_second_buffers_are_what_host_bytes_counts_and_no_undo_copy_is_kept(frozen, opt):
    g = _graph()
    rt, state = _runtime(g, opt, frozen=frozen)
    with rt:
        rt.step(BATCHES[0])
        rt.flush()
        assert rt.host._backup_bufs == {}
        need = host_bytes(rt.graph, microbatches=MBS, staleness=1, optimizer=opt, dtype=BF16)
        own = sum(b.nbytes for g_, pairs in state.alt.pairs.items() if not state.alt.shared[g_] for _, b in pairs)
        second = 0 if opt.master_dtype == BF16 or opt.state_dtype == BF16 else need.trainable_weights
        assert need.undo == own == second and need.trainable_weights > 0
        lows = sum(t.nbytes for t in state.flat.lows if t is not None)  # a split master's other halves
        assert need.masters == sum(m.nbytes for m in state.flat.masters) + lows
        assert (lows > 0) == (opt.state_dtype == BF16 and opt.master_dtype == torch.float32)


def test_an_upload_reads_the_alternate_buffer_for_the_blocks_trainable_part_only():
    block, alt = torch.arange(10), torch.arange(100, 104)
    assert _sources(block, None, 2, 8) == [(block, 2, 8)]
    assert _sources(block, alt, 5, 9) == [(block, 5, 9)]
    assert _sources(block, alt, 4, 9) == [(block, 4, 9)]
    assert _sources(block, alt, 1, 3) == [(alt, 1, 3)]
    assert _sources(block, alt, 0, 4) == [(alt, 0, 4)]
    assert _sources(block, alt, 2, 7) == [(alt, 2, 4), (block, 4, 7)]


def test_the_masters_changed_outside_a_step_are_cast_into_the_second_buffers_and_copy_waits_for_a_settle():
    # a data-parallel broadcast writes rank 0's masters into every process (`masters_changed`); `copy`, which
    # finetune calls at the end of a run, needs the buffers settled
    state = HostState.from_graph(_graph(), optimizer=AdamW(lr=1e-2), dtype=BF16)
    assert state.alternate(0)
    grp = next(iter(state.alt.pairs))
    for n in state.groups[grp]:
        state.master[n].add_(1.0)
    state.masters_changed()
    for (a, b), s in zip(state.alt.pairs[grp], state.layout.segments[grp]):
        assert torch.equal(b, state.flat.masters[grp][s.start:s.stop].to(BF16)) and not torch.equal(a, b)
    state.alt.flip(grp)
    with pytest.raises(RuntimeError, match="not settled"):
        state.copy(grp)
    state.settle()
    state.copy(grp)
    assert all(torch.equal(state.compute[n], state.master[n].to(BF16)) for n in state.groups[grp])


def test_a_later_runtime_on_the_same_state_keeps_its_second_buffers_and_recasts_them():
    # a replan or a load makes a new runtime on the same state: the buffers (pinned on CUDA) are not made again
    g = _graph()
    state = HostState.from_graph(g, optimizer=AdamW(lr=1e-2), dtype=BF16)
    rt, _ = _runtime(g, None, state=state)
    with rt:
        rt.step(BATCHES[0])
        rt.flush()
    alt, ptrs = state.alt, [b.data_ptr() for b in state.alt.buffers()]
    for n in state.master:
        state.master[n].mul_(0.5)  # changed between the runs (a load)
    rt, _ = _runtime(g, None, state=state, start=1)
    with rt:
        assert state.alt is alt and [b.data_ptr() for b in alt.buffers()] == ptrs and set(alt.base.values()) == {1}
        for grp, pairs in alt.pairs.items():
            for (_, b), s in zip(pairs, state.layout.segments[grp]):
                assert torch.equal(b, state.flat.masters[grp][s.start:s.stop].to(BF16))


@pytest.mark.parametrize("mode", ["fp32", "bf16-moments"])
def test_a_group_with_compute_copies_of_two_dtypes_alternates_each_segment_bit_for_bit(monkeypatch, mode):
    # the norms in bf16, the rest fp32, each parameter training in its own dtype; the key projections and the
    # post-attention norms frozen: a block's group holds one segment per dtype, the second one starting past the
    # first, and each dtype's block has frozen weights after its trainable part. Each segment alternates with a
    # buffer of its own length
    def graph():
        model = models.llama()
        for name, p in model.named_parameters():
            if "norm" in name:
                p.data = p.data.to(BF16)
            p.requires_grad_("k_proj" not in name and "post_attention_layernorm" not in name)
        return trace(model, models.lm_batch(batch=4, seq=8))

    g = graph()
    rt, state = _runtime(g, MODES[mode], dtype=None)
    with rt:
        mixed = [grp for grp, segs in enumerate(state.layout.segments) if len(segs) > 1]
        assert mixed and all(segs[1].start > 0 for segs in map(state.layout.segments.__getitem__, mixed))
        assert all(state.blocks[(grp, s.dtype)].numel() > s.stop - s.start  # frozen weights after the segment
                   for grp in mixed for s in state.layout.segments[grp])
        for grp in mixed:
            for (a, b), s in zip(state.alt.pairs[grp], state.layout.segments[grp]):
                assert a.dtype == b.dtype == s.dtype and a.numel() == b.numel() == s.stop - s.start
    got = _train(g, MODES[mode], 5, evaluate_at=2, dtype=None)
    _off(monkeypatch)
    want = _train(graph(), MODES[mode], 5, evaluate_at=2, dtype=None)
    assert got[3] and not want[3]
    assert got[0] == want[0] and got[1] == want[1]
    _same(got[2], want[2])
