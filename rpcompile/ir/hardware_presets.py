"""The spec-sheet numbers behind `Hardware.preset`, each next to the source it is quoted from.

`PRESETS` maps a preset name to the fields of its `Hardware`: the vendor's dense peak rates per
(input dtype, accumulation) with the datasheet or whitepaper rows quoted beside them, memory and
link bandwidths, and host-side assumptions. `blas_workspace_bytes` is torch's rule for the BLAS
workspace each worker's compute stream holds (quoted from torch's source); the GPU presets and
`Hardware.measure` both use it. Nothing here measures anything or imports torch.

    >>> PRESETS["rtx4090"]["peak_flops"]["float16/float16"] / 1e12
    330.3
"""
from __future__ import annotations

import os
import re
from types import MappingProxyType
from typing import Mapping

__all__ = ["PRESETS", "blas_workspace_bytes"]


def blas_workspace_bytes(capability: tuple[int, int], env: Mapping[str, str] | None = None) -> int:
    """Bytes of BLAS workspace torch allocates for one (cuBLAS handle, stream) that runs matmuls.

    Args:
        capability: the GPU's compute capability (major, minor), e.g. `torch.cuda.get_device_capability()`.
        env: the environment to read the overrides from (default `os.environ`, read at call time).
    Returns:
        The cuBLAS workspace plus the cuBLASLt one, in bytes.

    Note: torch's rule (aten/src/ATen/cuda/CublasHandlePool.cpp). The cuBLAS workspace is
    `CUBLAS_WORKSPACE_CONFIG` (":SIZE:COUNT" pairs in KiB, summed), by default ":4096:2:16:8"
    (8 MiB + 128 KiB), 32 MiB on sm90 (Hopper); the cuBLASLt workspace (bias epilogues, bf16
    GEMMs) is `CUBLASLT_WORKSPACE_SIZE` KiB (default 1 MiB), at most the cuBLAS one, and none when
    `TORCH_CUBLASLT_UNIFIED_WORKSPACE=1` makes it share the cuBLAS one. Both come from the caching
    allocator the first time a handle meets a stream and stay allocated, so `memory_allocated`
    counts them once per worker: each worker runs its matmuls from one thread on its compute stream.

    >>> blas_workspace_bytes((8, 9), env={}) // 1024, blas_workspace_bytes((9, 0), env={}) // 2**20
    (9344, 33)
    """
    env = os.environ if env is None else env
    pairs = re.findall(r":([0-9]+):([0-9]+)", env.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        blas = sum(int(size) * 1024 * int(count) for size, count in pairs)
    else:
        blas = 32 * 2**20 if tuple(capability) == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8
    lt_env = env.get("CUBLASLT_WORKSPACE_SIZE", "")
    lt = int(lt_env) * 1024 if lt_env.isdigit() else 2**20
    unified = env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "").lower() in ("1", "true", "yes", "on")
    return blas + (0 if unified else min(lt, blas))


_GB = 10 ** 9
_BLAS_DEFAULT = blas_workspace_bytes((8, 0), env={})  # torch's default workspaces off Hopper (9.1 MiB)
# Public spec-sheet numbers. Dense (no sparsity) tensor-core peaks, per (input dtype, accumulation): a bare
# dtype key is fp32 accumulation (what training uses by default), "float16/float16" fp16 accumulation. Host
# side: a typical 8-GPU server (host memory and the CPU AdamW rate are our assumptions, not vendor figures).
PRESETS = MappingProxyType({
    "rtx4090": dict(
        name="rtx4090", efficiency=0.6, device_memory=24 * _GB, mem_bandwidth=1008 * _GB,
        # NVIDIA Ada GPU Architecture whitepaper (v2.1), Appendix A, Table 2 (GeForce RTX 4090), dense / sparse:
        #   "Peak FP16 Tensor TFLOPS with FP16 Accumulate   330.3 / 660.6"
        #   "Peak FP16 Tensor TFLOPS with FP32 Accumulate   165.2 / 330.4"
        #   "Peak BF16 Tensor TFLOPS with FP32 Accumulate   165.2 / 330.4"
        #   "Peak TF32 Tensor TFLOPS                         82.6 / 165.2"
        #   "Peak FP32 TFLOPS (non-Tensor)                   82.6"
        # Cross-checked against a third-party spec page (not NVIDIA's text, which we could not retrieve):
        # hmc-tech.com/gpus/nvidia-geforce-rtx-4090-vs-nvidia-rtx-pro-5000-blackwell lists for the 4090, dense,
        # "Tensor FP16-16 330.3", "Tensor FP16-32 165.2", "Tensor BF16 165.2", "Tensor TF32 82.58" TFLOPS.
        peak_flops={"bfloat16": 165.2e12, "float16": 165.2e12, "float16/float16": 330.3e12, "tf32": 82.6e12,
                    "float32": 82.6e12},
        h2d_bandwidth=32 * _GB, d2h_bandwidth=32 * _GB,  # PCIe 4.0 x16, per direction
        host_memory=512 * 2 ** 30, gpus=8, optimizer_bytes_per_s=20 * _GB,
        blas_workspace=_BLAS_DEFAULT,  # sm89
        notes="NVIDIA Ada GPU architecture whitepaper (RTX 4090, dense, per accumulation); PCIe 4.0 x16"),
    "rtx5090": dict(
        name="rtx5090", efficiency=0.6, device_memory=32 * _GB, mem_bandwidth=1792 * _GB,
        # NVIDIA RTX Blackwell GPU Architecture whitepaper, Appendix A, Table 1 (GeForce RTX 5090), dense / sparse:
        #   "Peak FP16 Tensor TFLOPS with FP16 Accumulate   419 / 838"
        #   "Peak FP16 Tensor TFLOPS with FP32 Accumulate   209.5 / 419"
        #   "Peak BF16 Tensor TFLOPS with FP32 Accumulate   209.5 / 419"
        #   "Peak TF32 Tensor TFLOPS                        104.8 / 209.5"
        #   "Peak FP32 TFLOPS (non-Tensor)                  104.8"
        # These rows were quoted from memory of the whitepaper, whose text we could not retrieve. Cross-checked:
        # fp16 with fp16 accumulation, "FP16 Tensor Performance (sparse) 838.4 TFLOPS" (spheron.network/blog/
        # nvidia-rtx-5090-specs), i.e. 419.2 dense; fp16 with fp32 accumulation, "FP16 dense 209.5 TFLOPS"
        # (codesota.com/hardware/rtx-5090). The bf16 and tf32 rows are not confirmed by any source we could read;
        # the 2:1 fp16-/fp32-accumulate ratio of GeForce Blackwell (sm_120) is measured on an RTX 5060 Ti by
        # github.com/QuantumDrizzy/BLACKWALL (cuBLAS: bf16/fp16 fp32-accumulate 47.0, fp16 fp16-accumulate 87.9).
        peak_flops={"bfloat16": 209.5e12, "float16": 209.5e12, "float16/float16": 419e12, "tf32": 104.8e12,
                    "float32": 104.8e12},
        h2d_bandwidth=64 * _GB, d2h_bandwidth=64 * _GB,  # PCIe 5.0 x16, per direction
        host_memory=512 * 2 ** 30, gpus=8, optimizer_bytes_per_s=20 * _GB,
        blas_workspace=_BLAS_DEFAULT,  # sm120
        notes="NVIDIA RTX Blackwell GPU architecture whitepaper (RTX 5090, dense, per accumulation); PCIe 5.0 x16"),
    "a800": dict(
        name="a800", efficiency=0.7, device_memory=80 * _GB, mem_bandwidth=2039 * _GB,
        # NVIDIA A100 Tensor Core GPU datasheet (A800 80GB has A100 80GB compute), dense: "BFLOAT16 Tensor Core
        # 312 TFLOPS", "FP16 Tensor Core 312 TFLOPS", "TF32 Tensor Core 156 TFLOPS", "FP32 19.5 TFLOPS". The
        # data-center tensor cores accumulate fp16 in fp32 at full rate (NVIDIA A100 architecture whitepaper,
        # Table 1: FP16/FP32-accumulate = FP16/FP16-accumulate = 312), so fp16 accumulation buys nothing here.
        peak_flops={"bfloat16": 312e12, "float16": 312e12, "float16/float16": 312e12, "tf32": 156e12,
                    "float32": 19.5e12},
        h2d_bandwidth=32 * _GB, d2h_bandwidth=32 * _GB,  # PCIe 4.0 x16
        host_memory=1024 * 2 ** 30, gpus=8, optimizer_bytes_per_s=30 * _GB,
        blas_workspace=_BLAS_DEFAULT,  # sm80
        notes="A800 80GB = A100 80GB compute (NVIDIA A100 datasheet); PCIe 4.0 x16"),
    "h100": dict(
        name="h100", efficiency=0.7, device_memory=80 * _GB, mem_bandwidth=3350 * _GB,
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5), dense = half the with-sparsity figures: "BFLOAT16 Tensor
        # Core 1,979 TFLOPS*", "FP16 Tensor Core 1,979 TFLOPS*", "TF32 Tensor Core 989 TFLOPS*", "FP32 67 TFLOPS"
        # (* with sparsity); one fp16 rate for either accumulation (NVIDIA H100 architecture whitepaper, Table 2).
        peak_flops={"bfloat16": 989.5e12, "float16": 989.5e12, "float16/float16": 989.5e12, "tf32": 494.7e12,
                    "float32": 66.9e12},
        h2d_bandwidth=64 * _GB, d2h_bandwidth=64 * _GB,  # PCIe 5.0 x16
        host_memory=2048 * 2 ** 30, gpus=8, optimizer_bytes_per_s=40 * _GB,
        blas_workspace=blas_workspace_bytes((9, 0), env={}),  # sm90: a 32 MiB cuBLAS workspace
        notes="NVIDIA H100 SXM5 datasheet (dense); PCIe 5.0 x16 host link"),
    "cpu": dict(
        name="cpu", efficiency=0.8, device_memory=16 * 2 ** 30, mem_bandwidth=20 * _GB,
        peak_flops={"float32": 200e9, "bfloat16": 200e9, "float16": 5e9},
        h2d_bandwidth=10 * _GB, d2h_bandwidth=10 * _GB,  # memcpy between host workers
        host_memory=64 * 2 ** 30, gpus=2, optimizer_bytes_per_s=4 * _GB, link_latency=2e-6, op_latency=10e-6,
        kind="cpu",
        notes="rough host-worker defaults (a few modern cores); use Hardware.measure() for real numbers"),
})
