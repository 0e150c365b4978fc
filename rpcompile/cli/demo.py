"""`python -m rpcompile demo`: train a small Llama on this repository's own text.

The main job on an embedded default: byte-level tokens of the project's source
and docs (nothing downloaded), a 4-layer Llama-style model, 2 workers. It
prints the graph, the plan and the program, shows a progress line per step
(loss, tokens/s, measured bubble) and ends by writing a Gantt chart of the
measured run next to the simulated run on 8x RTX 4090.
"""
from __future__ import annotations

import os
import sys
import time

import torch

from rpcompile.api import Options, compile, plan_pipeline
from rpcompile.runtime.sim.gantt import compute_bubble, plot_panels
from rpcompile.models.demo import DemoConfig, batches, corpus
from rpcompile.models.zoo import LlamaConfig, TinyLlama
from rpcompile.ir.hardware import Hardware
from rpcompile.ir.optim import AdamW
from rpcompile.runtime import simulate, steady_iterations

def _bar(i: int, n: int, loss: float, tps: float, bubble: float, tty: bool) -> None:
    """One progress line (redrawn in place on a terminal)."""
    filled = int(30 * i / n)
    line = (f"step {i:3d}/{n} [{'#' * filled}{'.' * (30 - filled)}] loss {loss:.3f}  "
            f"{tps:,.0f} tok/s  bubble {bubble:.1%}")
    if tty:
        print("\r" + line, end="\n" if i == n else "", flush=True)
    elif i == 1 or i == n or i % 10 == 0:
        print(line, flush=True)


def run(cfg: DemoConfig = DemoConfig()) -> float:
    """Train, print the IRs and progress, write the charts; returns the final loss."""
    torch.manual_seed(cfg.seed)
    data = corpus()
    model = TinyLlama(LlamaConfig(vocab=256, dim=128, layers=4, heads=4, kv_heads=2, ffn=344,
                                  max_seq=cfg.seq), seed=cfg.seed)
    stream = batches(data, cfg)
    example = next(stream)
    print(f"rpcompile demo: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{len(data):,} bytes of text, {cfg.gpus} workers, {cfg.microbatches} microbatches\n")
    c = compile(model, gpus=cfg.gpus, example=example, microbatches=cfg.microbatches,
                optimizer=AdamW(lr=cfg.lr, weight_decay=0.0), seed=cfg.seed,
                memory_budget=int(cfg.memory_mib * 2**20))
    print("== layer graph ==", c.graph, "", "== plan ==", c.plan, "", "== program (one iteration) ==",
          c.program, "", sep="\n")
    tty = sys.stdout.isatty()
    losses, tokens = [], cfg.batch * cfg.seq
    for i in range(1, cfg.steps + 1):
        batch = next(stream)
        t = time.perf_counter()
        loss = c.step(batch)
        dt = time.perf_counter() - t
        losses.append(loss)
        _bar(i, cfg.steps, loss, tokens / dt, compute_bubble(c.last_timeline, cfg.gpus), tty)
    measured = c.last_timeline
    c.close()
    os.makedirs(cfg.out, exist_ok=True)
    # The same model planned for 8x RTX 4090 with predicted costs, then simulated.
    opts = Options(gpus=8, microbatches=16, staleness=1, optimizer=c.options.optimizer, dtype=torch.bfloat16,
                   loss_fn=None, layers=None, lm_head_shards="auto",
                   hardware=Hardware.preset("rtx4090"), memory_budget=None, backend="host", seed=0)
    big = {k: v.repeat(2, 1) for k, v in example.items()}
    _, costs8, plan8, program8, _ = plan_pipeline(model, big, opts, mode="predict")
    sim = simulate(program8, costs8, opts.hardware, iterations=steady_iterations(program8))
    _charts(cfg, measured, sim)
    print(f"\n{loss_summary(losses)}")
    print(f"simulated on 8x RTX 4090 (plan {plan8.to_str()}): {sim.summary()}")
    print(f"charts and traces in {os.path.abspath(cfg.out)}/")
    return losses[-1]


def loss_summary(losses: list[float]) -> str:
    """The loss at the start and at the end of a run: the means of its first and last k steps, k = min(5, n // 2).

    The two windows never overlap, so a short run compares different steps; one step is just its loss.

        >>> loss_summary([3.0, 2.0])
        'loss 3.000 -> 2.000 (the first and the last step)'
        >>> loss_summary([4.0, 3.0, 2.0, 1.0])
        'loss 3.500 -> 1.500 (mean of the first and last 2 steps)'
        >>> loss_summary([2.5])
        'loss 2.500 after 1 step'
    """
    if len(losses) < 2:
        return f"loss {losses[0]:.3f} after 1 step" if losses else "no step ran"
    k = min(5, len(losses) // 2)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    what = "the first and the last step" if k == 1 else f"mean of the first and last {k} steps"
    return f"loss {first:.3f} -> {last:.3f} ({what})"


def _charts(cfg: DemoConfig, measured, sim) -> None:
    """gantt.png (measured | simulated) when matplotlib is installed; Chrome traces always."""
    sim.to_chrome_trace(os.path.join(cfg.out, "simulated-8x4090.json"))
    try:
        plot_panels(os.path.join(cfg.out, "gantt.png"),
                    [(f"measured: last step, {cfg.gpus} host workers", measured, cfg.gpus),
                     (f"simulated: 8x RTX 4090, {sim.iterations} iterations, staleness 1", sim.records, 8)],
                    title="rpcompile demo: RoundPipe schedule")
    except ImportError:
        print("matplotlib is not installed (pip install 'rpcompile[plot]'): wrote Chrome traces only")
