"""Measure mode's timing (issue 14 item 2): outliers re-measured, fwd/bwd interleaved, identical layers timed once."""
import torch

from rpcompile.passes import estimate_costs, trace
from rpcompile.zoo import LlamaConfig, TinyLlama


class FakeClock:
    """A clock whose every call to `work` takes the next of `durations` milliseconds (then 1.0)."""

    def __init__(self, durations):
        self.now, self.durations, self.calls = 0.0, [d / 1e3 for d in durations], []

    def __call__(self):
        return self.now

    def work(self, name):
        def fn():
            self.calls.append(name)
            self.now += self.durations.pop(0) if self.durations else 1e-3
        return fn


def test_outliers_are_timed_again_and_the_median_skips_them():
    from rpcompile.passes.cost import _robust_times
    # 5 passes: 3 of them slow (a loaded machine); the plain median would be 9.0
    clock = FakeClock([1.0, 9.0, 9.0, 1.1, 9.0, 1.0, 1.2, 1.0, 1.0])
    [t] = _robust_times([clock.work("f")], torch.device("cpu"), 0, 5, clock=clock)
    assert round(t * 1e3, 9) == 1.0 and len(clock.calls) == 5 + 3  # the 3 slow passes ran again


def test_forward_and_backward_alternate_and_warm_up_is_not_timed():
    from rpcompile.passes.cost import _robust_times
    clock = FakeClock([100.0, 100.0] + [1.0, 2.0] * 5)  # the warm-up pass is slow: not counted
    f, b = _robust_times([clock.work("f"), clock.work("b")], torch.device("cpu"), 1, 5, clock=clock)
    assert (round(f * 1e3, 9), round(b * 1e3, 9)) == (1.0, 2.0) and clock.calls == ["f", "b"] * 6


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
