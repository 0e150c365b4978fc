"""Flat memory layouts (runtime/host/layout.py): host blocks per layer group, device slots per stage."""
from __future__ import annotations

import torch

import models
from rpcompile import AdamW, StagePlan
from rpcompile.passes import emit, trace
from rpcompile.runtime.executor import Runtime
from rpcompile.runtime.host.layout import host_blocks
from rpcompile.runtime.host.optimizer import HostState


def test_parameter_views_are_16_byte_aligned():
    """Odd tensor sizes (hidden 30): host blocks and device slots place every view at a 16-byte offset,
    and training still matches the runtime's results (the runtime tests check equality with eager)."""
    model = models.llama(hidden_size=30, intermediate_size=45, num_attention_heads=3, num_key_value_heads=3)
    batch = models.lm_batch(batch=4, seq=8)
    graph = trace(model, batch)
    state = HostState.from_graph(graph, optimizer=AdamW(lr=1e-2))
    sizes = [p.numel() for p in state.compute.values()]
    assert any(n % 4 for n in sizes)  # unaligned sizes exist: packing them back to back would misalign
    for name, v in state.compute.items():
        block = state.blocks[state.where[name][0]]
        assert (v.data_ptr() - block.data_ptr()) % 16 == 0, name
    blocks, where = host_blocks({"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.ones(5, dtype=torch.bfloat16),
                                 "c": torch.ones(1, dtype=torch.int8), "d": torch.ones(2, dtype=torch.int8)},
                                {"a": 0, "b": 0, "c": 0, "d": 0})
    assert [where[n][1] for n in "abcd"] == [0, 8, 0, 16]
    prog = emit(StagePlan.from_str("2,2|1|1,3"), gpus=2, microbatches=2, staleness=0)
    with Runtime(graph, prog, state, backend="host", timeout=20) as rt:
        for lay in rt.layouts.values():
            for slots in (lay.params, lay.grads):
                for name, s in slots.items():
                    assert s.offset * s.dtype.itemsize % 16 == 0, name
        losses = [rt.step(models.lm_batch(batch=4, seq=8, seed=k)) for k in range(2)]
        rt.flush()
    assert all(torch.isfinite(torch.tensor(losses)))
