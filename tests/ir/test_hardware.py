"""Hardware: presets from spec sheets, lookups, the roofline and a fast measurement of this machine."""
import dataclasses
import pickle
import time

import pytest
import torch

from rpcompile import CostTable, Hardware, StagePlan
from rpcompile.ir.hardware import blas_workspace_bytes
from rpcompile.passes import partition
from rpcompile.passes.cost.stage_memory import memory_refusal


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


# -- the cuBLAS workspace: its bytes, and their place in the stage budget ---------------------------------
KIB, MIB = 2**10, 2**20


def test_blas_workspace_follows_torchs_rule():
    assert blas_workspace_bytes((9, 0), env={}) == 32 * MIB + MIB  # Hopper: 32 MiB cuBLAS + 1 MiB cuBLASLt
    assert blas_workspace_bytes((8, 9), env={}) == 8 * MIB + 128 * KIB + MIB  # ":4096:2:16:8" + 1 MiB
    assert blas_workspace_bytes((8, 0), env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 33 * MIB
    assert blas_workspace_bytes((9, 0), env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 2 * 128 * KIB  # Lt capped
    assert blas_workspace_bytes((8, 0), env={"CUBLASLT_WORKSPACE_SIZE": "4096"}) == 8 * MIB + 128 * KIB + 4 * MIB
    assert blas_workspace_bytes((9, 0), env={"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 32 * MIB
    assert Hardware.preset("h100").blas_workspace == 33 * MIB and Hardware.preset("cpu").blas_workspace == 0
    for name in ("rtx4090", "rtx5090", "a800"):
        assert Hardware.preset(name).blas_workspace == blas_workspace_bytes((8, 9), env={})
    with pytest.raises(ValueError, match="blas_workspace"):
        Hardware.preset("cpu", blas_workspace=-1)


def test_a_blas_workspace_takes_exactly_its_bytes_off_the_budget_the_stages_must_fit():
    cpu, h100 = Hardware.preset("cpu"), Hardware.preset("h100")
    assert cpu.stage_budget() == int(0.9 * cpu.device_memory) and cpu.stage_budget(12345) == 12345  # unchanged
    assert h100.stage_budget() == int(0.9 * h100.device_memory) - 33 * MIB
    assert h100.stage_budget(2**30) == 2**30 - h100.blas_workspace and h100.stage_budget(MIB) == 0
    n, p = 4, 64 * MIB
    costs = CostTable.from_lists([1e-3] * n, [2e-3] * n, param_bytes=[p] * n, grad_bytes=[p] * n,
                                 peak_bytes=[p // 2] * n, saved_bytes=[MIB] * n, act_bytes=[MIB] * n)
    one = StagePlan.from_sizes([1] * (n - 1), 1, [1] * (n - 1))
    budget = max(one.stage_memory(costs)) + h100.blas_workspace // 2  # fits the stages, not the workspace too
    assert memory_refusal(costs, budget) is None and cpu.stage_budget(budget) == budget
    assert "memory budget" in memory_refusal(costs, h100.stage_budget(budget))
    partition(costs, gpus=2, microbatches=2, memory_budget=budget)
    with pytest.raises(ValueError, match="budget"):
        partition(costs, gpus=2, microbatches=2, memory_budget=h100.stage_budget(budget))


@pytest.mark.parametrize("name", ["rtx4090", "rtx5090"])
def test_geforce_prices_bf16_at_fp32_accumulate_and_fp16_accumulation_at_twice_that(name):
    h = Hardware.preset(name)
    assert h.flops("bf16") == h.flops("fp16") == h.flops(torch.float16, torch.float32)  # training's default
    assert h.flops("fp16", accumulate="fp16") == pytest.approx(2 * h.flops("bf16"), rel=1e-3)  # 330.3 vs 165.2
    assert h.flops("bf16", accumulate="bf16") == h.flops("bf16")  # no such rate: bf16's own
    assert h.roofline(h.flops("bf16") * h.efficiency, 0, "float16/float16") == pytest.approx(0.5, rel=1e-3)


def test_each_rate_quotes_its_source():
    import inspect
    import rpcompile.ir.hardware_presets as presets_mod
    text = inspect.getsource(presets_mod)
    for quote in ("Ada GPU Architecture whitepaper", "Peak BF16 Tensor TFLOPS with FP32 Accumulate   165.2",
                  "Peak FP16 Tensor TFLOPS with FP16 Accumulate   330.3", "RTX Blackwell GPU Architecture whitepaper",
                  "Peak BF16 Tensor TFLOPS with FP32 Accumulate   209.5", "A100 Tensor Core GPU datasheet",
                  "H100 Tensor Core GPU datasheet"):
        assert quote in text, quote


def test_data_center_cards_gain_nothing_from_fp16_accumulation():
    for name in ("a800", "h100"):
        h = Hardware.preset(name)
        assert h.flops("fp16", "fp16") == h.flops("fp16") == h.flops("bf16")



def pickled_as_before(hw: Hardware, newest: int, monkeypatch) -> bytes:
    """`hw` pickled as a version without its `newest` last fields wrote it (what an old checkpoint holds):
    a frozen slots dataclass pickles the list of its field values and unpickles through `__setstate__`."""
    with monkeypatch.context() as m:
        m.setattr(Hardware, "__getstate__", lambda self: [getattr(self, f.name) for f in dataclasses.fields(self)][
            :-newest])
        return pickle.dumps(hw)


@pytest.mark.parametrize("name,kind", [("rtx4090", "cuda"), ("h100", "cuda"), ("cpu", "cpu")])
def test_a_hardware_pickled_before_kind_existed_loads(name, kind, monkeypatch):
    hw = Hardware.preset(name)
    old = pickle.loads(pickled_as_before(hw, 1, monkeypatch))  # before issue 33's `kind`
    assert old == hw and old.kind == kind  # the cpu preset described host workers, every other one GPUs
    older = pickle.loads(pickled_as_before(hw, 2, monkeypatch))  # before `blas_workspace` too: its default, 0
    assert older == hw.replace(blas_workspace=0) and older.kind == kind
    assert pickle.loads(pickle.dumps(hw)) == hw


@pytest.mark.parametrize("name", ["rtx4090", "rtx5090"])
def test_consumer_presets_are_the_paper_s_eight_card_servers(name):
    hw = Hardware.preset(name)
    assert hw.gpus == 8 and hw.host_memory == 512 * 2**30 and hw.kind == "cuda"
