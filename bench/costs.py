"""Predicted vs measured per-layer costs of a 134M Llama on this machine.

Measures the machine (`rpcompile.measure_hardware()`: `Hardware.measure()` with the host optimizer's
kernels timed), then runs `estimate_costs` in
"measure" and "predict" mode on the same traced model and prints both side by
side with the ratio, per layer and summed.

    python bench/costs.py                 # B=1, S=256
    python bench/costs.py --seq 128 --batch 2
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_model  # noqa: E402
from tabulate import tabulate

from rpcompile.ir.hardware import Hardware
from rpcompile.machine import measure_hardware
from rpcompile.passes.cost import estimate_costs
from rpcompile.passes.trace import trace


def llama_134m(ffn: int = 2048) -> torch.nn.Module:
    """12 layers, hidden 768, 12 heads, FFN `ffn`, vocab 32000, eager attention (random weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=ffn, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                      attn_implementation="eager")
    return LlamaForCausalLM(cfg).train()


def _measure_hw(when: str) -> Hardware:
    """measure_hardware() on the CPU, printed."""
    t0 = time.perf_counter()
    hw = measure_hardware("cpu")
    print(f"measure_hardware() {when} measuring: {hw.peak_flops['float32'] / 1e9:.0f} GFLOP/s fp32, "
          f"{hw.mem_bandwidth / 1e9:.1f} GB/s elementwise, {hw.op_latency * 1e6:.2f} us/op, "
          f"optimizer {hw.optimizer_bytes_per_s / 1e9:.1f} GB/s of fp32 master ({time.perf_counter() - t0:.1f} s)")
    return hw


def _mean_hw(a: Hardware, b: Hardware) -> Hardware:
    """The mean of two measurements of the same machine (rates and latencies)."""
    return a.replace(peak_flops={k: (v + b.peak_flops.get(k, v)) / 2 for k, v in a.peak_flops.items()},
                     mem_bandwidth=(a.mem_bandwidth + b.mem_bandwidth) / 2,
                     op_latency=(a.op_latency + b.op_latency) / 2,
                     optimizer_bytes_per_s=(a.optimizer_bytes_per_s + b.optimizer_bytes_per_s) / 2)


def main() -> None:
    """Run the comparison and print the tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is robust on a shared machine)")
    ap.add_argument("--ffn", type=int, default=2048, help="FFN width: 2048 gives 134M parameters, 3072 162M")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    print(f"date {datetime.date.today()}, CPU {cpu_model()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    before = _measure_hw("before")
    model = llama_134m(args.ffn)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (args.batch, args.seq), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    graph = trace(model, batch)
    t0 = time.perf_counter()
    meas = estimate_costs(graph, batch, mode="measure", device="cpu", repeats=args.repeats)
    t_meas = time.perf_counter() - t0
    hw = _mean_hw(before, _measure_hw("after"))  # the machine is shared: average the two measurements
    t0 = time.perf_counter()
    pred = estimate_costs(graph, batch, mode="predict", hardware=hw)
    t_pred = time.perf_counter() - t0
    print(f"B={args.batch} S={args.seq}: measure {t_meas:.1f} s, predict {t_pred:.1f} s\n")

    rows = []
    for i, name in enumerate(meas.names):
        rows.append([i, name, f"{meas.fwd[i] * 1e3:.2f}", f"{pred.fwd[i] * 1e3:.2f}",
                     f"{pred.fwd[i] / meas.fwd[i]:.2f}", f"{meas.bwd[i] * 1e3:.2f}", f"{pred.bwd[i] * 1e3:.2f}",
                     f"{pred.bwd[i] / max(meas.bwd[i], 1e-12):.2f}", f"{pred.fwd_flops[i] / 1e9:.2f}",
                     f"{pred.bwd_flops[i] / 1e9:.2f}"])
    sf, pf, sb, pb = sum(meas.fwd), sum(pred.fwd), sum(meas.bwd), sum(pred.bwd)
    rows.append(["", "total", f"{sf * 1e3:.2f}", f"{pf * 1e3:.2f}", f"{pf / sf:.2f}", f"{sb * 1e3:.2f}",
                 f"{pb * 1e3:.2f}", f"{pb / sb:.2f}", f"{sum(pred.fwd_flops) / 1e9:.2f}",
                 f"{sum(pred.bwd_flops) / 1e9:.2f}"])
    print(tabulate(rows, headers=["#", "layer", "fwd meas ms", "fwd pred ms", "ratio", "bwd meas ms",
                                  "bwd pred ms", "ratio", "fwd GFLOP", "bwd GFLOP"], disable_numparse=True))
    ok = all(abs(r - 1) <= 0.35 for r in (pf / sf, pb / sb))
    print(f"\nsum predicted / measured: forward {pf / sf:.3f}, backward {pb / sb:.3f} "
          f"-> {'within' if ok else 'OUTSIDE'} 35%")
    print("\nmemory columns agree between modes:",
          all(getattr(meas, f) == getattr(pred, f) for f in ("param_bytes", "grad_bytes", "act_bytes",
                                                              "saved_bytes", "peak_bytes")))


if __name__ == "__main__":
    main()
