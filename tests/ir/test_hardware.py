"""Hardware: presets from spec sheets, lookups, the roofline and a fast measurement of this machine."""
import dataclasses
import time

import pytest
import torch

from rpcompile import Hardware


def test_presets_have_the_public_numbers():
    h = Hardware.preset("rtx4090")
    assert h.flops("bf16") == 330e12 and h.device_memory == 24 * 10 ** 9
    assert h.h2d_bandwidth == h.d2h_bandwidth == 32e9 and h.mem_bandwidth == 1008e9 and h.gpus == 8
    assert Hardware.preset("rtx5090").flops(torch.bfloat16) == 419e12
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
