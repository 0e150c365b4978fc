"""Chunk loops whose iterations are alike are counted from their first two iterations on meta
(`passes.meta.regions._Loop.over`): the counts equal those of running every iteration."""
from __future__ import annotations

import pytest
import torch

import models as M
from rpcompile.passes import shard_lm_head, trace
from rpcompile.passes.cost.count import count_layers
from rpcompile.passes.cost.recorder import Recorder
from rpcompile.passes.meta import regions

pytest.importorskip("transformers")


def _every_iteration(self, items, **_):
    """`_Loop.over` without skipping."""
    yield from items


@pytest.mark.parametrize("case", ["chunked head", "fused head", "MoE experts", "uneven chunks"])
def test_alike_iterations_skipped_on_meta_count_the_same(case, monkeypatch):
    """64 tokens: the chunked head's shards run 8 chunks of 8 tokens, the fused head's token shards 4 each;
    62 tokens make chunks of 7 and 8. The MoE experts' loop runs every expert: autograd records each."""
    model = M.qwen3_moe() if case == "MoE experts" else M.llama()
    batch = M.lm_batch(batch=2, seq=31 if case == "uneven chunks" else 32)
    graph = shard_lm_head(trace(model, batch), shards=2, chunk=8, fused=case == "fused head")
    inputs = graph.flatten_inputs(batch)
    repeats = []
    fold_repeat = Recorder.fold_repeat

    def spy(self, k):
        repeats.append(k)
        fold_repeat(self, k)
    monkeypatch.setattr(Recorder, "fold_repeat", spy)
    skipped = count_layers(graph, inputs, progress=False)
    monkeypatch.setattr(regions._Loop, "over", _every_iteration)
    full = count_layers(graph, inputs, progress=False)
    assert skipped == full
    if case == "uneven chunks":
        assert not repeats
    else:  # each head loop ran 2 of its iterations; the MoE layers' expert loops all of theirs
        assert repeats and set(repeats) == {2 if case == "fused head" else 6}
        head = [c for layer, c in zip(graph.layers, full) if "shard" in layer.name]
        assert head and {o.launches for c in head for o in c.fwd_ops} >= {1, 4 if case == "fused head" else 8}


def test_loops_on_real_tensors_run_every_iteration():
    """Off meta the loop's iterations compute values: none is skipped."""
    runs = []
    with Recorder() as rec:
        with regions.chunk_loop() as loop:
            for k in loop.over(range(5), alike=True, meta=False):
                with loop.iteration():
                    runs.append(k)
                    torch.ones(3) + k
    assert runs == [0, 1, 2, 3, 4] and [o.launches for o in rec.ops] == [5, 5]
