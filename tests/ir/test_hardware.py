"""Hardware: presets from spec sheets, lookups, the roofline and a fast measurement of this machine."""
import dataclasses
import time

import pytest
import torch

from rpcompile import Hardware


def test_presets_have_the_public_numbers():
    h = Hardware.preset("rtx4090")
    assert h.flops("bf16") == 165.2e12 and h.device_memory == 24 * 10 ** 9
    assert h.h2d_bandwidth == h.d2h_bandwidth == 32e9 and h.mem_bandwidth == 1008e9 and h.gpus == 8
    assert Hardware.preset("rtx5090").flops(torch.bfloat16) == 209.5e12
    assert Hardware.preset("rtx5090").flops(torch.float16, torch.float16) == 419e12
    assert Hardware.preset("rtx5090").h2d_bandwidth == 64e9
    assert Hardware.preset("a800").flops("bfloat16") == 312e12
    assert Hardware.preset("h100").flops("fp16") == 989.5e12
    assert Hardware.preset("a800").device_memory == Hardware.preset("h100").device_memory == 80 * 10 ** 9
    for name in Hardware.presets():
        hw = Hardware.preset(name)
        assert hw.optimizer_bytes_per_s > 0 and hw.host_memory > hw.device_memory and hw.link_latency >= 0


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError) as e:
        Hardware.preset("rtx9999")
    for name in ("rtx4090", "rtx5090", "a800", "h100", "cpu"):
        assert name in str(e.value)


def test_preset_overrides_and_is_frozen():
    h = Hardware.preset("RTX-4090", gpus=4)
    assert h.gpus == 4 and h.replace(gpus=2).gpus == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.gpus = 3
    assert hash(h) == hash(Hardware.preset("rtx4090", gpus=4))


def test_flops_lookup_falls_back_to_float32_and_roofline():
    h = Hardware.preset("rtx4090")
    assert h.flops(torch.float64) == h.flops("float32")
    assert h.roofline(h.flops("bf16") * h.efficiency, 0, torch.bfloat16) == pytest.approx(1.0)
    assert h.roofline(0, h.mem_bandwidth) == pytest.approx(1.0)


def test_bad_fields_raise():
    with pytest.raises(ValueError, match="device_memory"):
        Hardware.preset("cpu", device_memory=0)


def test_measure_this_machine_is_fast_and_sane():
    t0 = time.perf_counter()
    h = Hardware.measure("cpu", budget_s=0.8)
    assert time.perf_counter() - t0 < 6.0  # ~1 s when the machine is idle
    assert 1e8 < h.flops("float32") < 1e14 and h.mem_bandwidth > 1e8 and h.h2d_bandwidth > 1e8
    assert h.host_memory > 2 ** 28 and h.gpus == 1 and h.optimizer_bytes_per_s > 1e6 and h.name == "measured-cpu"


@pytest.mark.parametrize("name", ["rtx4090", "rtx5090"])
def test_geforce_prices_bf16_at_fp32_accumulate_and_fp16_accumulation_at_twice_that(name):
    h = Hardware.preset(name)
    assert h.flops("bf16") == h.flops("fp16") == h.flops(torch.float16, torch.float32)  # training's default
    assert h.flops("fp16", accumulate="fp16") == pytest.approx(2 * h.flops("bf16"), rel=1e-3)  # 330.3 vs 165.2
    assert h.flops("bf16", accumulate="bf16") == h.flops("bf16")  # no such rate: bf16's own
    assert h.roofline(h.flops("bf16") * h.efficiency, 0, "float16/float16") == pytest.approx(0.5, rel=1e-3)


def test_each_rate_quotes_its_source():
    import inspect
    import rpcompile.ir.hardware as hw_mod
    text = inspect.getsource(hw_mod)
    for quote in ("Ada GPU Architecture whitepaper", "Peak BF16 Tensor TFLOPS with FP32 Accumulate   165.2",
                  "Peak FP16 Tensor TFLOPS with FP16 Accumulate   330.3", "RTX Blackwell GPU Architecture whitepaper",
                  "Peak BF16 Tensor TFLOPS with FP32 Accumulate   209.5", "A100 Tensor Core GPU datasheet",
                  "H100 Tensor Core GPU datasheet"):
        assert quote in text, quote


def test_data_center_cards_gain_nothing_from_fp16_accumulation():
    for name in ("a800", "h100"):
        h = Hardware.preset(name)
        assert h.flops("fp16", "fp16") == h.flops("fp16") == h.flops("bf16")
