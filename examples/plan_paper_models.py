"""Plan the five RoundPipe paper models for 8x RTX 4090 without allocating a weight.

Each model is built on the `meta` device from its published config
(`rpcompile.models.presets.MODELS`), its per-layer costs are predicted for the target
hardware, and `rpcompile.models.planning.plan_model` partitions it into RoundPipe
stages and simulates the schedule. One summary table: parameters, decoder
layers, the chosen plan, simulated tokens/s, steady-state bubble, peak device
memory and the longest sequence that fits.

Run (about 10-20 s per model on a CPU; needs transformers for the configs):

    python examples/plan_paper_models.py
    python examples/plan_paper_models.py --models qwen3-1.7b llama3.1-8b --hardware rtx5090
"""
from __future__ import annotations

import argparse
import time

from tabulate import tabulate

from rpcompile.models.planning import plan_model
from rpcompile.models.presets import MODELS, config_for

HEADERS = ["model", "params", "layers", "plan stages (F|FB|B)", "tokens/s", "steady bubble",
           "peak GiB/GPU", "max_seq_len", "planned in"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options: which models and which target run."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), metavar="NAME",
                   help=f"subset of {', '.join(MODELS)} (default: all five)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs in the target server")
    p.add_argument("--hardware", default="rtx4090", help="hardware preset (rtx4090, rtx5090, a800, h100)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (one sequence per microbatch)")
    p.add_argument("--microbatches", type=int, default=16, help="microbatches per iteration")
    return p.parse_args(argv)


def plan(name: str, args: argparse.Namespace):
    """Plan one model for the target run; returns (PlanResult, seconds it took)."""
    t = time.perf_counter()
    r = plan_model(name, gpus=args.gpus, hardware=args.hardware, seq=args.seq, microbatches=args.microbatches)
    return r, time.perf_counter() - t


def row(r, seconds: float) -> list[str]:
    """The summary row of one PlanResult (our RoundPipe schedule, steady state)."""
    _, _, tokens_s, _, steady_bubble, peak_gib, fits = r.rows[0]  # rows[0] is our schedule
    p = r.plan
    return [r.model, f"{r.params / 1e9:.2f} B", str(config_for(r.model).num_hidden_layers),
            f"{p.num_stages} ({len(p.fwd)}|1|{len(p.bwd)})", f"{tokens_s:,.0f}", f"{steady_bubble:.1%}",
            f"{peak_gib:.1f}" + ("" if fits == "yes" else " (OOM)"),
            "n/a" if r.max_seq is None else f"{r.max_seq.length:,}", f"{seconds:.1f} s"]


def main(argv: list[str] | None = None) -> None:
    """Plan each chosen model and print one table."""
    args = parse_args(argv)
    print(f"planning {len(args.models)} model(s) for {args.gpus}x {args.hardware}, seq {args.seq}, "
          f"{args.microbatches} microbatches, staleness 1 (meta device: no weights allocated)", flush=True)
    results = []
    for name in args.models:
        results.append(plan(name, args))
        text = results[-1][0].plan.to_str()
        print(f"  {name}: plan {text if len(text) <= 70 else text[:67] + '...'}", flush=True)
    print(tabulate([row(r, s) for r, s in results], headers=HEADERS, disable_numparse=True,
                   colalign=("left", "right", "right", "left", "right", "right", "right", "right", "right")))
    for r, _ in results:  # what stops a longer sequence: the device (a layer's workspace) or the host
        if r.max_seq is not None:
            print(f"max_seq_len {r.model}: {r.max_seq}")

if __name__ == "__main__":
    main()
