"""This machine as a Hardware: the optimizer lane is priced at the rate of the optimizer that runs."""
import pytest
import torch

import rpcompile
from rpcompile.ir.program import Op
from rpcompile.machine import hardware_of, measure_hardware
from rpcompile.models.zoo import LlamaConfig, TinyLlama
from rpcompile.runtime.host import kernels

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=64, max_seq=32)
RATE = 3.0e9  # what the kernels' timing reports here (patched: a rate no real timing gives exactly)


@pytest.fixture
def kernel_rate(monkeypatch):
    """The kernels' AdamW timing, replaced by one that returns RATE; the list of budgets it was given."""
    calls = []
    monkeypatch.setattr(kernels, "optimizer_rate", lambda budget: calls.append(budget) or RATE)
    return calls


def test_measure_hardware_times_the_optimizer_that_runs(kernel_rate):
    hw = measure_hardware("cpu", budget_s=0.3)
    assert hw.optimizer_bytes_per_s == RATE and len(kernel_rate) == 1 and 0 < kernel_rate[0] <= 0.3
    torch_hw = measure_hardware("cpu", budget_s=0.3, impl="foreach")  # torch's AdamW runs: timed, not the kernels
    assert torch_hw.optimizer_bytes_per_s != RATE and len(kernel_rate) == 1


def test_simulate_measured_prices_each_step_at_the_kernels_rate(kernel_rate):
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    with rpcompile.compile(TinyLlama(CFG), gpus=2, example={"input_ids": ids, "labels": ids}, microbatches=2,
                           memory_budget=2**20, backend="host", optimizer=rpcompile.AdamW(lr=1e-2)) as c:
        t = c.simulate("measured")
        steps = [r for r in t.records if r.op == Op.STEP.value]
        grad_bytes = [c.costs.grad_bytes[int(r.template.split("l")[-1])] for r in steps]
    assert steps and all(b > 0 for b in grad_bytes)
    for r, b in zip(steps, grad_bytes):  # 2 B of fp32 master per byte of 16-bit gradient, at the kernels' rate
        assert r.end - r.start == pytest.approx(2 * b / RATE, rel=1e-9), r.name


def test_a_hardware_name_is_a_preset_or_measured():
    assert hardware_of("rtx4090").name == "rtx4090"
    with pytest.raises(ValueError, match="unknown hardware preset 'rtx9999'.*'measured'"):
        hardware_of("rtx9999")
