"""The host lanes' undo copies (runtime/host_lanes.py): at staleness 1 an iteration's COPYs overwrite compute
copies before it commits; what they overwrite (each group's trainable parameters' copies, never a frozen one's)
is kept in buffers allocated with the runtime, and `undo_from` puts it back bit for bit.
(The end-to-end check, a backward fault undone and retried, is tests/runtime/test_faults.py's.) The copy pass and
its undo copies are what sharded state runs; an unsharded state's copies alternate between two buffers instead
(tests/runtime/test_alternate.py), so these tests switch that off."""
from __future__ import annotations

import pytest
import torch

import models
from rpcompile import AdamW, StagePlan
from rpcompile.hostmem import host_bytes
from rpcompile.passes import emit, trace
from rpcompile.runtime.executor import Runtime
from rpcompile.runtime.host_lanes import copied_regions
import rpcompile.runtime.host.layout as host_layout
from rpcompile.runtime.host.optimizer import HostState

PLAN, GPUS, MBS = "2,2|1|1,3", 2, 4  # llama: 5 layers


@pytest.fixture(autouse=True)
def copy_pass(monkeypatch):
    """Every state takes the copy pass and its undo copies (not the alternating copies)."""
    monkeypatch.setattr(host_layout, "eligible", lambda state: False)


def _runtime(staleness: int, dtype: torch.dtype | None, frozen: bool, impl: str = "fused"):
    """A host Runtime of the test llama (with `frozen`, only its 1-D weights train; `impl`: AdamW's) and its graph."""
    model = models.llama()
    if frozen:
        for p in model.parameters():
            p.requires_grad_(p.dim() == 1)
    graph = trace(model, models.lm_batch(batch=4, seq=8))
    state = HostState.from_graph(graph, optimizer=AdamW(lr=1e-2, impl=impl), dtype=dtype)
    prog = emit(StagePlan.from_str(PLAN), gpus=GPUS, microbatches=MBS, staleness=staleness)
    return Runtime(graph, prog, state, backend="host", timeout=20), graph


@pytest.mark.parametrize("frozen", [False, True])
def test_the_regions_a_copy_writes_are_the_trainable_parameters_copies_at_the_start_of_each_block(frozen):
    rt, graph = _runtime(1, torch.bfloat16, frozen)
    with rt:
        state = rt.state
        regions = {k: r for layer in range(len(state.groups)) for k, r in copied_regions(state, layer).items()}
        for (layer, dtype), region in regions.items():
            assert state.groups[layer] and region.data_ptr() == state.blocks[(layer, dtype)].data_ptr()
        for name in state.master:  # every trainable copy lies in its group's region; no frozen one does
            (key, at), n = state.where[name], state.compute[name].numel()
            assert key in regions and at + n <= regions[key].numel(), name
        for name in set(state.compute) - set(state.master):
            (key, at) = state.where[name]
            assert key not in regions or at >= regions[key].numel(), name
        need = host_bytes(graph, microbatches=MBS, staleness=1, optimizer=state.config, dtype=torch.bfloat16)
        assert sum(r.nbytes for r in regions.values()) == need.trainable_weights == need.undo
        assert need.undo < need.weights if frozen else need.undo == need.weights


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_undo_buffers_are_allocated_with_a_staleness_1_runtime_one_per_region(staleness):
    rt, _ = _runtime(staleness, torch.bfloat16, frozen=False)
    with rt:
        bufs = rt.host._backup_bufs
        if staleness == 0:
            assert bufs == {}  # nothing is undone there: a COPY follows its own iteration's commit
            return
        regions = {k: r for layer in range(len(rt.state.groups)) for k, r in copied_regions(rt.state, layer).items()}
        assert set(bufs) == set(regions)
        assert all(len(b) == 1 and b[0].shape == regions[k].shape and b[0].dtype == regions[k].dtype
                   for k, b in bufs.items())


@pytest.mark.parametrize("dtype, impl", [(None, "fused"), (torch.bfloat16, "fused"), (torch.bfloat16, "foreach")],
                         ids=["fp32-torch-copy", "bf16-kernels", "bf16-no-kernels"])
def test_undo_puts_back_what_an_uncommitted_iterations_copies_overwrote_and_nothing_else(dtype, impl):
    rt, _ = _runtime(1, dtype, frozen=True, impl=impl)
    with rt:
        rt.step(models.lm_batch(batch=4, seq=8, seed=0))
        rt.flush()
        lanes, state = rt.host, rt.state
        before = {k: b.clone() for k, b in state.blocks.items()}
        t = lanes.committed  # not committed yet: its COPYs would be undone
        layer = next(l for l, g in enumerate(state.groups) if g)
        lanes._backups[t] = {k: lanes._backup_buffer(k, r, t) for k, r in copied_regions(state, layer).items()}
        for block in state.blocks.values():  # the COPY's writes, and (never done) writes past its regions
            block.add_(1)
        lanes.undo_from(t)
        regions = copied_regions(state, layer)
        for k, block in state.blocks.items():
            n = regions[k].numel() if k in regions else 0  # restored: the regions the COPY wrote
            assert torch.equal(block[:n], before[k][:n]), k
            assert torch.equal(block[n:], before[k][n:] + 1), k  # the rest is not the undo's to touch
        assert t not in lanes._backups
        for k, b in before.items():  # leave the state as it was for the runtime's close
            state.blocks[k].copy_(b)
