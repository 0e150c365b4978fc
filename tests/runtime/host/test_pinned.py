"""Pinned host memory at its exact size (runtime/host/pinned.py): what is registered is what admission counts."""
from __future__ import annotations

import gc

import pytest
import torch

import models as M
import rpcompile
from rpcompile.hostmem import host_bytes
from rpcompile.passes import trace
from rpcompile.passes.cost.host_bytes import compute_blocks
from rpcompile.runtime.host.optimizer import HostState
from rpcompile.runtime.host.pinned import PAGE, PinnedAllocator


class Recording:
    """A registrar that records the ranges instead of page-locking them."""

    def __init__(self, fail_above: int | None = None) -> None:
        self.live: dict[int, int] = {}
        self.calls: list[int] = []
        self.fail_above = fail_above

    def register(self, ptr: int, nbytes: int) -> None:
        if self.fail_above is not None and nbytes > self.fail_above:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed")
        assert ptr % PAGE == 0 and ptr not in self.live
        self.live[ptr] = nbytes
        self.calls.append(nbytes)

    def unregister(self, ptr: int) -> None:
        del self.live[ptr]


def _graph(kind: str):
    if kind == "gpt2":  # tied embedding / head: one block holds them
        pytest.importorskip("transformers")
        return trace(M.gpt2(), M.lm_batch())
    model = M.sequential(width=5)  # 5-element biases: views padded to 16-byte boundaries inside the blocks
    return trace(model, M.regression_batch(width=5), loss_fn=M.mse_loss)


@pytest.mark.parametrize("kind", ["gpt2", "odd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_registered_bytes_are_the_compute_blocks_host_bytes_counts(dtype, kind):
    graph = _graph(kind)
    reg = Recording()
    state = HostState.from_graph(graph, optimizer=rpcompile.AdamW(), dtype=dtype, pin_memory=PinnedAllocator(reg))
    blocks = compute_blocks(graph, dtype)
    assert sorted(reg.calls) == sorted(blocks.values()) == sorted(b.nbytes for b in state.blocks.values())
    need = host_bytes(graph, microbatches=2, optimizer=rpcompile.AdamW(), dtype=dtype)
    assert sum(reg.live.values()) == need.weights  # admission counts exactly what is pinned
    for name, p in graph.parameters().items():  # the compute copies hold the weights
        torch.testing.assert_close(state.read(name), p.detach().to(dtype), atol=0, rtol=0)
    del state
    gc.collect()
    assert reg.live == {}  # unregistered before the memory went back


def test_close_unregisters_and_a_refusal_leaves_nothing_registered():
    reg = Recording(fail_above=4096)
    alloc = PinnedAllocator(reg)
    small = alloc.zeros(1000, torch.float32)
    assert alloc.registered == 4000 and small.data_ptr() % PAGE == 0 and not small.any()
    with pytest.raises(RuntimeError, match="5000 bytes"):
        alloc.zeros(2500, torch.float16)
    assert list(reg.live.values()) == [4000]
    alloc.close()
    assert reg.live == {} and alloc.registered == 0
    small += 1  # the memory stays valid (pageable again)
    del small
    gc.collect()
    assert reg.live == {}  # no second unregister
