"""fp16 accumulation (`compile(fp16_accumulation=True)`): checked, recorded, priced; accepted on host workers.

On CUDA the flag is set around the workers' compute launches (tests/runtime/test_runtime_cuda.py); here the
host workers run it (where it changes nothing) and the cost model prices it.
"""
from __future__ import annotations

import pytest
import torch

import models as M
import rpcompile
from rpcompile import Hardware
from rpcompile.passes import estimate_costs, trace
from rpcompile.passes.cost import count_layers, layer_times, split_microbatch
from rpcompile.passes.cost.recorder import GEMMS, op_rate

pytest.importorskip("transformers")


def _compile(**kw):
    model = M.llama().half()
    batch = M.lm_batch(batch=4, seq=16)
    kw.setdefault("dtype", torch.float16)
    return rpcompile.compile(model, gpus=2, example=batch, microbatches=2, staleness=0, backend="host",
                             optimizer=rpcompile.SGD(lr=0.1), loss_scale=rpcompile.DynamicLossScale(), **kw), batch


def test_the_option_is_checked_recorded_and_priced():
    with pytest.raises(ValueError, match="fp16_accumulation=True needs dtype=torch.float16"):
        rpcompile.compile(M.llama(), gpus=2, example=M.lm_batch(batch=4, seq=16), dtype=torch.bfloat16,
                          fp16_accumulation=True, backend="host")
    with pytest.raises(ValueError, match="fp16_accumulation must be True or False"):
        rpcompile.compile(M.llama(), gpus=2, example=M.lm_batch(batch=4, seq=16), dtype=torch.float16,
                          fp16_accumulation="yes", backend="host")
    on, batch = _compile(fp16_accumulation=True)
    off, _ = _compile()
    try:
        assert on.options.fp16_accumulation and not off.options.fp16_accumulation
        assert on.state_dict()["options"]["fp16_accumulation"] is True  # the checkpoint keeps it
        losses = [on.step(batch) for _ in range(2)]  # host workers: accepted, no effect on CPU matmuls
        assert all(torch.isfinite(torch.tensor(losses)))
        # a slow device, so that the tiny model's GEMMs are compute-bound: twice the rate, half their time
        slow = Hardware.preset("rtx4090").replace(peak_flops={"float32": 1e9, "float16": 1e9, "float16/float16": 2e9})
        t_on, t_off = on.simulate(slow).iteration_time, off.simulate(slow).iteration_time
        assert t_on < 0.8 * t_off
    finally:
        on.close()
        off.close()


def test_predicted_gemms_use_the_fp16_accumulate_rate_and_nothing_else_changes():
    model = M.llama().half()
    batch = M.lm_batch(batch=4, seq=16)
    graph = trace(model, batch)
    gpu = Hardware.preset("rtx4090")
    counts = count_layers(graph, split_microbatch(graph, batch, 1), progress=False)
    ops = [o for c in counts for o in (*c.fwd_ops, *c.bwd_ops)]
    gemms = [o for o in ops if o.name in GEMMS and o.dtype == "float16"]
    assert gemms and all(op_rate(o, True) == "float16/float16" for o in gemms)
    assert all(op_rate(o, True) == o.dtype for o in ops if o not in gemms)
    for o in gemms:  # a compute-bound GEMM takes half the time
        big = o.__class__(o.name, o.flops * 10**6, o.bytes, o.dtype)
        assert layer_times([big], gpu, True) - gpu.op_latency == pytest.approx(
            (layer_times([big], gpu) - gpu.op_latency) / 2, rel=1e-3)
    slow = gpu.replace(peak_flops={"float32": 1e9, "float16": 1e9, "float16/float16": 2e9})  # compute-bound
    plain = estimate_costs(graph, batch, mode="predict", hardware=slow, progress=False)
    fast = estimate_costs(graph, batch, mode="predict", hardware=slow, progress=False, fp16_accumulation=True)
    assert all(f <= p for f, p in zip(fast.fwd, plain.fwd)) and sum(fast.fwd) < sum(plain.fwd)
    assert fast.fwd_flops == plain.fwd_flops and fast.peak_bytes == plain.peak_bytes
    bf16 = trace(M.llama().to(torch.bfloat16), batch)  # bf16 GEMMs never accumulate in fp16
    a = estimate_costs(bf16, batch, mode="predict", hardware=gpu, progress=False)
    b = estimate_costs(bf16, batch, mode="predict", hardware=gpu, progress=False, fp16_accumulation=True)
    assert a.fwd == b.fwd and a.bwd == b.bwd
