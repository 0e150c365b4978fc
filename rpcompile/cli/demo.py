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
from dataclasses import dataclass

import torch

from rpcompile.api import Options, compile, plan_pipeline
from rpcompile.cli.gantt import compute_bubble, plot_panels
from rpcompile.cli.zoo import LlamaConfig, TinyLlama
from rpcompile.ir.hardware import Hardware
from rpcompile.ir.optim import AdamW
from rpcompile.runtime import simulate, steady_iterations

# The folders whose .py and .md files make the corpus, in this order: the package's own (relative to
# rpcompile/), then passes/, runtime/ and docs/ (next to rpcompile/ in a checkout; an installed package
# holds passes/ and runtime/ inside rpcompile/, so those are looked for there too).
_PACKAGE_FOLDERS = ("", "ir", "cli")
_SIBLING_FOLDERS = ("passes", "runtime", "docs")


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What the demo trains and for how long."""

    steps: int = 200           # training iterations
    batch: int = 8             # sequences per iteration
    seq: int = 128             # bytes per sequence
    gpus: int = 2              # workers (host threads without CUDA)
    microbatches: int = 4      # microbatches per iteration
    lr: float = 3e-3           # AdamW learning rate
    memory_mib: float = 8.0    # device budget per worker: small on purpose, so the model does not fit
                               # one worker and runs as a pipeline, as a model larger than one GPU would
    out: str = "rpcompile-demo"  # folder for the charts and traces
    seed: int = 0              # data order and initial weights


def corpus() -> bytes:
    """The project's own source and docs as one byte string (fixed folder order, sorted file names)."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # rpcompile/cli/demo.py -> rpcompile/
    root = os.path.dirname(pkg)
    folders = [os.path.join(pkg, f) for f in _PACKAGE_FOLDERS] + [root]  # root: README.md, when installed -e
    for f in _SIBLING_FOLDERS:
        beside, inside = os.path.join(root, f), os.path.join(pkg, f)
        folders.append(beside if os.path.isdir(beside) else inside)
    chunks = []
    for d in folders:
        if not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            if name.endswith((".py", ".md")):
                with open(os.path.join(d, name), "rb") as f:
                    chunks.append(f.read())
    data = b"\n".join(dict.fromkeys(chunks))  # a file reachable twice counts once
    if len(data) < 10_000:
        raise RuntimeError(f"found only {len(data)} bytes of text under {root}")
    return data


def batches(data: bytes, cfg: DemoConfig):
    """Endless random windows of the corpus as {"input_ids", "labels"} batches."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(cfg.seed)
    while True:
        start = torch.randint(0, len(tokens) - cfg.seq - 1, (cfg.batch,), generator=gen)
        ids = torch.stack([tokens[s:s + cfg.seq] for s in start.tolist()])
        yield {"input_ids": ids, "labels": ids.clone()}


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
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"\nloss {first:.3f} -> {last:.3f} (mean of the first and last 5 steps)")
    print(f"simulated on 8x RTX 4090 (plan {plan8.to_str()}): {sim.summary()}")
    print(f"charts and traces in {os.path.abspath(cfg.out)}/")
    return last


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
