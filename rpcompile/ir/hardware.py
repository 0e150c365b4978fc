"""Hardware: the numbers the cost model and the simulator need about one server.

Presets come from public spec sheets (their numbers and sources: `hardware_presets.py`);
`Hardware.measure()` times this machine.
Nothing here touches a device at import time.

    >>> hw = Hardware.preset("rtx4090")
    >>> hw.device_memory // 10**9, hw.flops("bf16") / 1e12, hw.flops("fp16", accumulate="fp16") / 1e12
    (24, 165.2, 330.3)

Rates are per (input dtype, accumulation dtype). A `peak_flops` key is a dtype
key ("bfloat16") for the default accumulation (fp32 for fp16 / bf16 inputs,
what training uses), or "<dtype>/<accumulate>" ("float16/float16": fp16
inputs with fp16 accumulation, `torch.backends.cuda.matmul.allow_fp16_accumulation`).
GeForce cards run fp32 accumulation at half their fp16-accumulate tensor rate;
data-center cards run both at one rate.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Iterator

import torch

from rpcompile.ir.hardware_presets import PRESETS, blas_workspace_bytes

__all__ = ["Hardware", "dtype_key", "rate_key", "fp16_gemms", "blas_workspace_bytes"]

_ALIASES = MappingProxyType({
    "fp32": "float32", "float": "float32", "tf32": "tf32", "bf16": "bfloat16", "fp16": "float16",
    "half": "float16", "fp64": "float64", "double": "float64", "fp8": "float8_e4m3fn",
})


def dtype_key(dtype: torch.dtype | str) -> str:
    """The `peak_flops` key of a dtype: torch.bfloat16, "bf16", "bfloat16" -> "bfloat16"."""
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else str(dtype).lower()
    return _ALIASES.get(name, name)


def rate_key(dtype: torch.dtype | str, accumulate: torch.dtype | str | None = None) -> str:
    """The `peak_flops` key of (input dtype, accumulation dtype); the default accumulation is the bare dtype key.

    >>> rate_key(torch.float16), rate_key("fp16", "fp16"), rate_key("bf16", "fp32"), rate_key("float16/float16")
    ('float16', 'float16/float16', 'bfloat16', 'float16/float16')
    """
    if accumulate is None and isinstance(dtype, str) and "/" in dtype:
        dtype, accumulate = dtype.split("/", 1)
    key = dtype_key(dtype)
    acc = None if accumulate is None else dtype_key(accumulate)
    return key if acc is None or acc == "float32" or acc == key and key in ("float32", "float64") else f"{key}/{acc}"


@contextlib.contextmanager
def fp16_gemms(enabled: bool = True) -> Iterator[None]:
    """Within the block (if `enabled`), CUDA GEMMs in fp16 accumulate in fp16; the previous setting comes back.

    `torch.backends.cuda.matmul.allow_fp16_accumulation` is process-wide: use it from one thread
    (measuring); the runtime's workers share one counted scope (`runtime.streams.cuda.Fp16Accumulation`).

    >>> with fp16_gemms(False):
    ...     pass
    """
    if not enabled:
        yield
        return
    flags = torch.backends.cuda.matmul
    before = flags.allow_fp16_accumulation
    flags.allow_fp16_accumulation = True
    try:
        yield
    finally:
        flags.allow_fp16_accumulation = before


@dataclass(frozen=True, slots=True)
class Hardware:
    """One server: N identical accelerators attached to a host that keeps the model state.

    Bandwidths are bytes/s, memories bytes, times seconds. `peak_flops` maps a rate
    key ("float32", "bfloat16", "float16", "float16/float16", ...; see `rate_key`) to dense FLOP/s.
    """

    name: str  # preset name or "measured-<device>"
    peak_flops: dict[str, float] = field(hash=False)  # rate key (dtype[/accumulate]) -> peak dense FLOP/s of one device
    efficiency: float  # fraction of peak_flops a real kernel achieves (roofline compute ceiling)
    device_memory: int  # bytes of memory per device (GPU, or one host worker's share)
    mem_bandwidth: float  # device memory bandwidth, bytes/s (roofline memory ceiling)
    h2d_bandwidth: float  # host-to-device copy bandwidth per device, bytes/s
    d2h_bandwidth: float  # device-to-host copy bandwidth per device, bytes/s
    host_memory: int  # bytes of host (CPU) memory for master weights, optimizer state, saved activations
    gpus: int  # number of devices (workers) in the server
    optimizer_bytes_per_s: float  # bytes of fp32 master weights the CPU optimizer (Adam) updates per second
    link_latency: float = 10e-6  # fixed cost per host<->device transfer, s
    op_latency: float = 5e-6  # fixed cost per launched op (kernel launch / eager dispatch), s
    # data parallelism across servers (issue #9; runtime/distributed.py); the simulator adds a ring all-reduce
    nodes: int = 1  # servers training data-parallel, one rpcompile process each (1: no network traffic)
    net_bandwidth: float = 12.5e9  # inter-node bytes/s per server and direction (100 Gb/s NIC)
    net_latency: float = 10e-6  # per-message inter-node latency, s
    notes: str = field(default="", compare=False)  # where the numbers come from
    # cuBLAS + cuBLASLt workspace torch allocates per worker compute stream (`blas_workspace_bytes`), outside
    # the plan's buffers; `stage_budget` takes it off each worker's budget. 0: none (host workers)
    blas_workspace: int = 0
    # what runs the kernels: "cuda" (GPU workers: the fused LM head's elementwise work is one compiled kernel)
    # or "cpu" (host workers: every op runs eagerly); the cost model prices what runs
    kind: str = "cuda"

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_flops", {rate_key(k): float(v) for k, v in dict(self.peak_flops).items()})
        if self.kind not in ("cuda", "cpu"):
            raise ValueError(f"Hardware.kind must be 'cuda' or 'cpu', got {self.kind!r}")
        if not self.peak_flops:
            raise ValueError("Hardware.peak_flops needs at least one dtype")
        for f in ("efficiency", "device_memory", "mem_bandwidth", "h2d_bandwidth", "d2h_bandwidth",
                  "host_memory", "gpus", "optimizer_bytes_per_s"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Hardware.{f} must be > 0, got {getattr(self, f)!r}")
        if self.blas_workspace < 0:
            raise ValueError(f"Hardware.blas_workspace must be >= 0 bytes, got {self.blas_workspace!r}")
        if self.link_latency < 0 or self.op_latency < 0 or self.net_latency < 0:
            raise ValueError("Hardware latencies must be >= 0")
        if self.nodes < 1 or not self.net_bandwidth > 0:
            raise ValueError(f"Hardware.nodes must be >= 1 and net_bandwidth > 0, got {self.nodes}, "
                             f"{self.net_bandwidth!r}")

    def __setstate__(self, state: list) -> None:
        """Unpickle (a checkpoint's options): fields an older version lacks take their defaults.

        `kind` came with issue 33: a Hardware pickled before it ran on host workers when it is the
        cpu preset or a CPU measurement ("cpu", "measured-cpu"), on GPUs otherwise.
        """
        values = dict(zip((f.name for f in dataclasses.fields(self)), state))
        values.setdefault("kind", "cpu" if values.get("name") in ("cpu", "measured-cpu") else "cuda")
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, values.get(f.name, f.default))

    def flops(self, dtype: torch.dtype | str, accumulate: torch.dtype | str | None = None) -> float:
        """Peak dense FLOP/s for `dtype` inputs accumulating in `accumulate` (None: the default, fp32).

        A rate key without an entry falls back to its dtype's default-accumulation rate, and a dtype
        without an entry to float32's (or the slowest).

        >>> Hardware.preset("h100").flops(torch.bfloat16) / 1e12
        989.5
        >>> hw = Hardware.preset("rtx4090"); hw.flops("fp16", "fp16") / 1e12, hw.flops("fp16") / 1e12
        (330.3, 165.2)
        """
        key = rate_key(dtype, accumulate)
        for k in (key, key.split("/")[0]):
            if k in self.peak_flops:
                return self.peak_flops[k]
        return self.peak_flops.get("float32", min(self.peak_flops.values()))

    def roofline(self, flops: float, nbytes: float, dtype: torch.dtype | str = "float32") -> float:
        """Seconds for one op: max(compute time at efficiency x peak, memory time), no launch cost.

        `dtype` is a rate key (`rate_key`): "float16/float16" prices fp16 accumulation.

        >>> Hardware.preset("rtx4090").roofline(165.2e12 * 0.6, 0, "bf16")
        1.0
        """
        return max(flops / (self.flops(dtype) * self.efficiency), nbytes / self.mem_bandwidth)

    def stage_budget(self, memory_budget: int | None = None, usable: float = 0.9) -> int:
        """Device bytes per worker that a plan's stages may use: the budget less the BLAS workspace.

        Args:
            memory_budget: device bytes per worker (default `usable * device_memory`, as `compile`'s).
            usable: the share of the device memory a worker may use when no budget is given.
        Returns:
            `memory_budget - blas_workspace` (0 if that is negative): what `StagePlan.stage_memory`
            must fit, since every worker's compute stream also holds its cuBLAS workspaces.

        >>> h = Hardware.preset("h100"); h.stage_budget(2**30) == 2**30 - h.blas_workspace == 2**30 - 33 * 2**20
        True
        >>> Hardware.preset("cpu").stage_budget() == int(0.9 * Hardware.preset("cpu").device_memory)
        True
        """
        budget = int(usable * self.device_memory) if memory_budget is None else int(memory_budget)
        return max(budget - self.blas_workspace, 0)

    def replace(self, **changes) -> "Hardware":
        """A copy with some fields changed, e.g. `hw.replace(gpus=4)`."""
        return dataclasses.replace(self, **changes)

    @staticmethod
    def presets() -> tuple[str, ...]:
        """Names accepted by `Hardware.preset`."""
        return tuple(PRESETS)

    @classmethod
    def preset(cls, name: str, **changes) -> "Hardware":
        """A server from public spec sheets: "rtx4090", "rtx5090", "a800", "h100" (8 GPUs each) or "cpu".

        Args:
            name: preset name (case-insensitive).
            **changes: fields to override, e.g. `gpus=4`.
        Returns:
            The Hardware.
        Raises:
            ValueError: unknown name (the message lists the known ones).

        >>> Hardware.preset("rtx5090", gpus=4).gpus
        4
        """
        key = name.lower().replace("-", "").replace("_", "")
        if key not in PRESETS:
            raise ValueError(f"unknown hardware preset {name!r}; known presets: {', '.join(PRESETS)}")
        hw = cls(**PRESETS[key])
        return hw.replace(**changes) if changes else hw

    @classmethod
    def measure(cls, device: str | torch.device | None = None, *, gpus: int | None = None,
                budget_s: float = 2.0, optimizer_rate: Callable[[float], float] | None = None) -> "Hardware":
        """Measure this machine: matmul FLOP/s per dtype, memory and copy bandwidth, optimizer speed.

        Args:
            device: "cuda", "cuda:1" or "cpu"; default CUDA if available, else the CPU.
            gpus: device count (default: CUDA device count, or 1 host worker on the CPU).
            budget_s: rough time budget for all measurements.
            optimizer_rate: times the host optimizer in about the seconds given and returns its fp32 master
                bytes per second: `rpcompile.runtime.host.kernels.optimizer_rate` times the C++ kernels
                the runtime steps with (the IR cannot import the runtime, so the caller passes it:
                `rpcompile.measure_hardware()` does); default: torch's foreach AdamW.
        Returns:
            A Hardware named "measured-<device>" with efficiency 0.9 (peak_flops are already achieved rates);
            on CUDA `blas_workspace` is torch's for the device's compute capability (`blas_workspace_bytes`).

        >>> hw = Hardware.measure("cpu"); hw.flops("float32") > 0
        True
        """
        dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        per = budget_s / 8
        dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if dev.type == "cuda" else [])
        peak = {dtype_key(dt): _matmul_rate(dev, dt, per) for dt in dtypes}
        if dev.type == "cuda" and hasattr(torch.backends.cuda.matmul, "allow_fp16_accumulation"):
            peak["float16/float16"] = _matmul_rate(dev, torch.float16, per, fp16_accumulation=True)
        peak = {k: v for k, v in peak.items() if v > 0}
        mem_bw = _elementwise_bandwidth(dev, per)
        if dev.type == "cuda":
            h2d, d2h = _copy_bandwidth(dev, per, "h2d"), _copy_bandwidth(dev, per, "d2h")
            dev_mem = torch.cuda.get_device_properties(dev).total_memory
            count = gpus or torch.cuda.device_count()
            op_lat = 5e-6
            blas = blas_workspace_bytes(torch.cuda.get_device_capability(dev))
        else:
            h2d = d2h = _copy_bandwidth(dev, per, "copy")
            count = gpus or 1
            op_lat = _op_latency(dev, per / 2)
            dev_mem = blas = 0
        host = _host_memory()
        opt = (optimizer_rate or _adam_rate)(per * 2)
        return cls(name=f"measured-{dev.type}", peak_flops=peak, efficiency=0.9,
                   device_memory=dev_mem or max(host // max(count, 1) // 2, 1), mem_bandwidth=mem_bw,
                   h2d_bandwidth=h2d, d2h_bandwidth=d2h, host_memory=host, gpus=count,
                   optimizer_bytes_per_s=opt, link_latency=10e-6 if dev.type == "cuda" else 2e-6,
                   op_latency=op_lat, blas_workspace=blas, kind="cuda" if dev.type == "cuda" else "cpu",
                   notes=f"measured with torch {torch.__version__} in ~{budget_s:.0f} s")


def _timeit(fn, dev: torch.device, budget: float, max_reps: int = 50) -> float:
    """Median seconds of `fn()` after one warm-up, repeated until `budget` s are spent."""
    fn()
    _sync(dev)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < budget):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
        if times[-1] > budget:  # too slow to repeat
            break
    return statistics.median(times)


def _sync(dev: torch.device) -> None:
    """Wait for queued work on `dev`."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _matmul_rate(dev: torch.device, dtype: torch.dtype, budget: float, fp16_accumulation: bool = False) -> float:
    """Best matmul FLOP/s over a few square sizes (0 if the dtype is unusably slow); optionally fp16 accumulation."""
    if fp16_accumulation:
        with fp16_gemms():
            return _matmul_rate(dev, dtype, budget)
    best = 0.0
    sizes = (1024, 4096, 8192) if dev.type == "cuda" else (512, 1024)
    for n in sizes:
        a = torch.randn(n, n, device=dev).to(dtype)
        b = torch.randn(n, n, device=dev).to(dtype)
        t0 = time.perf_counter()
        a @ b
        _sync(dev)
        if time.perf_counter() - t0 > budget:  # no fast kernel for this dtype here
            return best or 2 * n ** 3 / (time.perf_counter() - t0)
        best = max(best, 2 * n ** 3 / _timeit(lambda: a @ b, dev, budget / len(sizes)))
    return best


def _elementwise_bandwidth(dev: torch.device, budget: float) -> float:
    """Bytes/s moved by an out-of-place add (2 reads + 1 write), as eager ops use memory."""
    n = (64 if dev.type == "cuda" else 1) * 2 ** 20
    x, y = torch.randn(n, device=dev), torch.randn(n, device=dev)
    return 3 * x.nbytes / _timeit(lambda: x + y, dev, budget)


def _copy_bandwidth(dev: torch.device, budget: float, kind: str) -> float:
    """Bytes/s of a host<->device copy (pinned host memory) or, on the CPU, a large memcpy."""
    n = (64 if kind != "copy" else 16) * 2 ** 20
    if kind == "copy":
        src, dst = torch.empty(n // 4), torch.empty(n // 4)
        return n / _timeit(lambda: dst.copy_(src), dev, budget)
    host = torch.empty(n // 4, pin_memory=True)
    gpu = torch.empty(n // 4, device=dev)
    if kind == "h2d":
        return n / _timeit(lambda: gpu.copy_(host, non_blocking=True), dev, budget)
    return n / _timeit(lambda: host.copy_(gpu, non_blocking=True), dev, budget)


def _op_latency(dev: torch.device, budget: float) -> float:
    """Seconds of eager overhead per op (a tiny add)."""
    x = torch.ones(8, device=dev)

    def ten_adds() -> None:
        for _ in range(10):
            x + x
    return _timeit(ten_adds, dev, budget, max_reps=200) / 10


def _adam_rate(budget: float) -> float:
    """Bytes of fp32 master weights per second one fused CPU AdamW step updates."""
    n = 2 ** 19
    p = torch.zeros(n, requires_grad=True)
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
    return p.nbytes / _timeit(opt.step, torch.device("cpu"), budget)


def _host_memory() -> int:
    """Physical host memory in bytes (Linux /proc/meminfo; 16 GiB if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * 2 ** 30
