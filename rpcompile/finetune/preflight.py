"""The checks a fine-tuning run passes before any weight loads: the model on `meta`, planned and sized.

    >>> pre = preflight(config, example, gpus=2, microbatches=4, microbatch_size=1, staleness=1, dtype=torch.float32,
    ...                 optimizer=AdamW(lr=2e-5), budget=None, lora=None, packed=True)      # doctest: +SKIP
    >>> print("\\n".join(pre.lines()))                                                        # doctest: +SKIP

`preflight` builds the model from its config.json on the meta device (no weight
is allocated or read), adds the LoRA adapters if asked, checks that the
parameters' host state fits this machine's RAM, plans it with predicted costs
(`rpcompile.plan_pipeline(mode="predict")`: FLOPs and bytes on a `Hardware` that
describes this machine's devices), checks the saved activations against the RAM
again, simulates the program for each worker's device peak, and finds the
longest sequence that fits (`max_seq_len` with the layer units compile uses at each length,
`passes.cost.seqlen.units_limit`; for `--dry-run` only). A run that cannot
fit is refused here, in seconds, with the bytes named (ValueError); `finetune`
runs it before it loads the weights, and `--dry-run` prints what it found.

The RAM a run needs is more than the host state (`rpcompile.hostmem`, which counts the runtime's
transfer buffers too: gradient staging and the host pool, `runtime.host.buffers`, and with staleness 1 the
undo copies of the trainable weights): the model as loaded keeps its own parameters; and on host workers (no CUDA) a worker's "device" memory is RAM too, so every worker's
simulated peak counts. What the process already holds when the check runs (Python, torch, transformers, the
tokenizer and the prepared data) is read, not assumed (`resident_bytes`: its RSS at the check), and
`RUNTIME_BYTES` is added for what the run adds beside the counted categories (the runtime's threads and the
libraries and kernels it loads, the allocator's slack). The check and `--dry-run` count all of it and say so;
with CUDA workers their peaks are device memory and do not count.

Note:
    The process's own footprint is measured because it depends on the torch build, not on the model:
    importing torch and transformers takes 335 MiB of RSS with torch 2.13's CPU build and 761 MiB with
    2.14.1's CUDA build (what pip installs by default, on a machine without a GPU too: its CUDA libraries are
    mapped at import). A constant tuned on one build under-counted the other by 426 MiB.

The plan printed is the predicted one: the run itself measures its layers and may
group them differently; the memory figures are bytes, the same either way.
"""
from __future__ import annotations

import copy
import os
import resource
import sys
from dataclasses import dataclass
from typing import Any

import torch

from rpcompile import passes
from rpcompile.api import Options
from rpcompile.finetune.hf import add_lora, trainable_module
from rpcompile.finetune.packed_attention import use_packed_attention
from rpcompile.hostmem import HostBytes, check_host_memory
from rpcompile.ir import hardware as _hardware
from rpcompile.ir.hardware import Hardware, rate_key
from rpcompile.passes.cost.seqlen import units_limit
from rpcompile.passes.trace import sublayer_units
from rpcompile.pipeline import compile_passes
from rpcompile.runtime import simulate

__all__ = ["Preflight", "preflight", "local_hardware", "meta_model", "resident_bytes", "RUNTIME_BYTES"]

RUNTIME_BYTES = 256 * 2**20  # what a run adds beside the counted bytes: its ~30 threads' stacks and malloc arenas,
# the host kernels and libraries it loads after the check, the allocator's slack (measured: a 17.7M-parameter
# Llama on 2 host workers peaked 265 MiB above the counted bytes and the RSS at the check with torch 2.13's CPU
# build, 302 MiB with 2.14.1's CUDA build)


def resident_bytes() -> int:
    """This process's resident memory now: Linux's /proc/self/statm, elsewhere its peak so far (no less)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, others KiB


@dataclass(frozen=True, slots=True)
class Preflight:
    """What the checks found (plain data; `lines()` reads it out)."""

    hardware: Hardware  # what the costs were predicted for (this machine's devices and RAM)
    plan: Any  # the predicted StagePlan
    program: Any  # its Program
    peaks: tuple[int, ...]  # each worker's simulated device peak, bytes
    budget: int | None  # device bytes per worker the plan had to fit (None: unbounded)
    host: HostBytes  # host bytes of the run, by category
    host_limit: int  # this machine's RAM
    workers_ram: int  # host workers: the sum of their device peaks, which are RAM too (0 with CUDA workers)
    buffers: int  # the model as loaded (see the module docstring)
    seq_limit: Any  # rpcompile.SeqLenLimit: the longest sequence that fits and what binds it (None: see why)
    seq_limit_why: str | None  # why the longest sequence could not be found
    resident: int = 0  # this process's RSS when the check ran (Python, torch, transformers, the data)
    iteration: float | None = None  # simulated seconds of one iteration on `hardware` (predicted costs)
    gemm_rate: str = ""  # the rate key its training-dtype GEMMs were priced at ("float16/float16": fp16 accumulation)

    @property
    def ram(self) -> int:
        """The RAM the run needs: the host state, the host workers' peaks, the process so far, `RUNTIME_BYTES`."""
        return self.host.total + self.buffers + self.workers_ram + self.resident + RUNTIME_BYTES

    def ram_line(self) -> str:
        """What `ram` adds up, in words."""
        workers = (f" + {len(self.peaks)} host workers' device peaks {_size(self.workers_ram)} (RAM here)"
                   if self.workers_ram else "")
        return (f"{_size(self.ram)} of {_size(self.host_limit)} RAM: host state {self.host} + the loaded model "
                f"{_size(self.buffers)}{workers} + this process so far (Python, torch, the data) "
                f"{_size(self.resident)} + the runtime's threads and libraries {_size(RUNTIME_BYTES)}")

    def lines(self) -> list[str]:
        """The findings, a line each."""
        peaks = ", ".join(f"w{i} {_size(p)}" for i, p in enumerate(self.peaks))
        cap = f" (budget {_size(self.budget)})" if self.budget is not None else " (no device budget)"
        seq = str(self.seq_limit) if self.seq_limit is not None else f"not found ({self.seq_limit_why})"
        return [f"plan (predicted for {self.hardware.name}, {len(self.peaks)} workers) {self.plan.to_str()}",
                f"device peak per worker{cap}: {peaks}",
                f"host memory: {self.ram_line()}",
                f"max_seq_len: {seq}",
                f"predicted iteration: {self.iteration:.3g} s, GEMMs priced at {self.gemm_rate} "
                f"({self.hardware.flops(self.gemm_rate) / 1e12:g} TFLOP/s peak)"] + self._plan_note()

    def _plan_note(self) -> list[str]:
        """The plan report's note, if compile chose a plan other than the partitioner's (its host fallback)."""
        report = getattr(self.plan, "report", None)
        return [report.note] if report is not None and report.note else []


def local_hardware(gpus: int, budget: int | None) -> Hardware:
    """This machine as a `Hardware` for predicted costs: its CUDA devices' memory, else host workers; its RAM.

    On CUDA the rtx4090 preset's speeds with the smallest device's memory; without CUDA the
    "cpu" preset whose device memory is the RAM (host workers share it) or the budget's.
    """
    ram = _hardware._host_memory()
    if torch.cuda.is_available():
        memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
        return Hardware.preset("rtx4090").replace(name=torch.cuda.get_device_name(0), gpus=gpus,
                                                  device_memory=memory, host_memory=ram)
    memory = ram if budget is None else max(int(budget / 0.9), 1)
    return Hardware.preset("cpu").replace(name="host workers", gpus=gpus, device_memory=memory,
                                          host_memory=ram)


def meta_model(config: Any, *, dtype: torch.dtype, lora: dict | None, packed: bool) -> torch.nn.Module:
    """The module `finetune` compiles, built on meta from `config` (no weight allocated or read).

    Args:
        config: the model's transformers config (config.json).
        dtype: the training dtype.
        lora: add_lora's arguments (rank, alpha, targets, seed), or None for full fine-tuning.
        packed: documents are packed per row (use_packed_attention).
    """
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)  # the caller's stays as is
    model.config.use_cache = False
    model.train()
    if lora is not None:
        model = add_lora(model, **lora)
    module = trainable_module(model)
    if packed:
        use_packed_attention(module)
    return module


def preflight(config: Any, example: Any, *, gpus: int, microbatches: int, microbatch_size: int, staleness: int,
              dtype: torch.dtype, optimizer: Any, budget: int | None, lora: dict | None, packed: bool,
              lm_head_shards: int | str = "auto", fp16_accumulation: bool = False,
              seq_limit: bool = True, shard: tuple[int, int] | None = None) -> Preflight:
    """Plan and size the run on the meta device; raise ValueError if it cannot fit (see the module docstring).

    Args:
        config: the model's transformers config.
        example: one step's batch of this process (its shapes are planned; the tokens are not read).
        gpus, microbatches, staleness, dtype, optimizer, lm_head_shards, fp16_accumulation: as for
            `rpcompile.compile` (fp16 accumulation prices the GEMMs at the hardware's fp16-accumulate rate).
        microbatch_size: sequences per microbatch (for max_seq_len).
        budget: device bytes per worker (None: unbounded host workers, or 90% of the CUDA device).
        lora, packed: as for `meta_model`.
        seq_limit: also find the longest sequence that fits (`max_seq_len`, for `--dry-run`'s report; a
            real run skips it: it is the slowest check and refuses nothing).
        shard: (rank, world) of sharded state (`--shard-state`): the host counts this rank's share.
    Raises:
        ValueError: the host state or the saved activations exceed the RAM, or with host workers so do
            they and the workers' device peaks, or a layer cannot fit the device budget (each names the
            bytes).
    """
    module = meta_model(config, dtype=dtype, lora=lora, packed=packed)
    hw = local_hardware(gpus, budget)
    state = dict(staleness=staleness, optimizer=optimizer, dtype=dtype, shard=shard)
    check_host_memory(module, microbatches=microbatches, **state)  # the parameters' state alone, before planning
    opts = Options(gpus=gpus, microbatches=microbatches, staleness=staleness, optimizer=optimizer, dtype=dtype,
                   loss_fn=None, layers=None, lm_head_shards=lm_head_shards, hardware=hw, memory_budget=budget,
                   backend="host", seed=0, fp16_accumulation=fp16_accumulation)
    graph, costs, plan, program, m, units, *_ = compile_passes(module, example, opts, mode="predict")
    host = check_host_memory(graph, costs, plan, microbatches=m, gpus=gpus, round_size=program.round_size,
                             program=program, **state)  # with the runtime's transfer buffers (gradient staging)
    timeline = simulate(program, costs, hw)
    peaks = tuple(int(p) for p in timeline.peak_memory)
    rate = rate_key(dtype, torch.float16 if fp16_accumulation else None)
    workers = 0 if torch.cuda.is_available() else sum(peaks)  # host workers' device memory is RAM
    buffers = host.weights  # the loaded model (the undo copies of staleness 1 are in `host`)
    found = Preflight(hw, plan, program, peaks, budget, host, hw.host_memory, workers, buffers, None, None,
                      resident_bytes())
    if found.ram > hw.host_memory:
        raise ValueError(f"host memory: the run needs {found.ram_line().replace(' of ', ' but has ', 1)}; lower "
                         f"--micro-batch-size, --seq or --microbatches, or train adapters (--lora)")
    limit, why = None, "not asked"
    try:
        if seq_limit:
            def sub_blocks():  # the units compile cuts the blocks into where a block does not fit a worker
                if units is not None:  # planned in sub-blocks already: nothing further to cut
                    return None
                try:
                    return passes.trace(module, example, layers=sublayer_units(module))
                except ValueError:  # no list of decoder blocks to cut
                    return None
            limit, why = units_limit(graph, sub_blocks, hw, gpus=gpus, microbatch_size=microbatch_size,
                                     microbatches=m, memory_budget=budget, host_memory=hw.host_memory,
                                     optimizer=optimizer, shard=shard), None
    except Exception as exc:  # noqa: BLE001 - reported: the plan and the checks above still stand
        limit, why = None, f"{type(exc).__name__}: {exc}"
    return Preflight(hw, plan, program, peaks, budget, host, hw.host_memory, workers, buffers, limit, why,
                     found.resident, timeline.iteration_time, rate)


def _size(n: int) -> str:
    """Bytes in MiB below a GiB, else in GiB."""
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"
