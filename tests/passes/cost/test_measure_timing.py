"""Measure mode's timing (issue 14 item 2): outliers re-measured, fwd/bwd interleaved, identical layers timed once."""
import torch

from rpcompile.passes import estimate_costs, trace
from rpcompile.models.zoo import LlamaConfig, TinyLlama


def canned(samples):
    """A sampler returning the next of `samples` (tuples of seconds) at each call, counting its calls."""
    it = iter(samples)

    def sample():
        sample.calls += 1
        return next(it)
    sample.calls = 0
    return sample


def test_outliers_are_sampled_again_and_the_median_skips_them():
    from rpcompile.passes.cost import _robust_times
    # 5 passes, 3 of them slow (a loaded machine): the plain median would be 9 ms
    ms = [(1.0,), (9.0,), (9.0,), (1.1,), (9.0,), (1.0,), (1.2,), (1.0,)]
    s = canned([tuple(t / 1e3 for t in x) for x in ms])
    [[t]] = _robust_times([s], 0, 5)
    assert round(t * 1e3, 9) == 1.0 and s.calls == 5 + 3  # the 3 slow passes ran again


def test_passes_take_every_sampler_in_turn_and_warm_up_is_not_counted():
    from rpcompile.passes.cost import _robust_times
    order = []

    def layer(name, fwd, bwd, warm):
        first = [True]

        def sample():
            order.append(name)
            slow, first[0] = first[0], False
            return (warm, warm) if slow else (fwd, bwd)
        return sample
    (f1, b1), (f2, b2) = _robust_times([layer("a", 1e-3, 2e-3, 1.0), layer("b", 3e-3, 5e-3, 1.0)], 1, 4)
    assert (f1, b1, f2, b2) == (1e-3, 2e-3, 3e-3, 5e-3) and order == ["a", "b"] * 5


def test_identical_decoder_blocks_get_equal_measured_times():
    model = TinyLlama(LlamaConfig(vocab=64, dim=32, layers=3, heads=4, kv_heads=2, ffn=64, max_seq=16), seed=0)
    ids = torch.randint(0, 64, (2, 16))
    batch = {"input_ids": ids, "labels": ids}
    t = estimate_costs(trace(model, batch), batch, mode="measure", device="cpu", progress=False)
    blocks = [i for i, n in enumerate(t.names) if n.startswith("layers.")]
    assert len(blocks) == 3 and len({t.fwd[i] for i in blocks}) == 1 and len({t.bwd[i] for i in blocks}) == 1
    assert all(x > 0 for x in t.fwd[1:4] + t.bwd[1:4])


def test_the_callers_thread_count_is_restored():
    before = torch.get_num_threads()
    model = TinyLlama(LlamaConfig(vocab=64, dim=32, layers=1, heads=4, kv_heads=2, ffn=64, max_seq=16), seed=0)
    ids = torch.randint(0, 64, (2, 16))
    batch = {"input_ids": ids, "labels": ids}
    estimate_costs(trace(model, batch), batch, mode="measure", device="cpu", progress=False, repeats=1)
    assert torch.get_num_threads() == before
