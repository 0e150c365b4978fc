"""rpcompile vs eager PyTorch on one CUDA GPU: tokens/s, memory, host waits, PCIe bytes (issues 8, 12).

    python bench/gpu_compare.py                 # ~1.1B Llama, bf16, seq 2048, batch 4, 3 timed steps
    python bench/gpu_compare.py --seq 1024 --steps 2 --workers 1 2 4

Eager: the model in bf16 on the GPU, torch.utils.checkpoint per decoder layer (non-reentrant),
gradient accumulation over the same microbatches, torch.optim.AdamW(fused=True) on the GPU (all state
resident: the upper bound when the model fits). Compiled: rpcompile.compile(gpus=N, dtype=bf16,
staleness 1) planned for `Hardware.measure()` of this GPU: weights, fp32 master and Adam state on the
host, stages streamed through N workers that share the one GPU (N > 1 runs the multi-worker protocol on
real streams). Each row prints as soon as it is measured. Installs nothing; exits 0 without CUDA.

Step time: the k timed steps run back to back after a warm-up, with one synchronize (eager) or one
flush (rpcompile) at the end, divided by k: throughput, as a long run sees it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import torch


def build(seed: int = 0):
    """A ~1.1B Llama-style causal LM (hidden 2048, 22 layers, GQA 4 KV heads, vocab 32000), fp32 on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096,
                      attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).train()


def batches(n: int, batch: int, seq: int, vocab: int = 32000) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def timed(step: Callable[[dict], Any], flush: Callable[[], Any], bs: list[dict], warmup: int) -> tuple[float, list]:
    """(seconds per step, what each step returned): `warmup` steps and a flush, then the other k steps
    back to back and one flush, timed together and divided by k.

    >>> calls = []; timed(lambda b: calls.append(b) or b, lambda: calls.append("flush"), [0, 1, 2], 1)[1]
    [0, 1, 2]
    >>> calls
    [0, 'flush', 1, 2, 'flush']
    """
    out = [step(b) for b in bs[:warmup]]
    flush()  # the warm-up's work (with staleness 1 its optimizer tail) is not timed
    t0 = time.perf_counter()
    out += [step(b) for b in bs[warmup:]]  # back to back: step t+1 overlaps step t's optimizer tail
    flush()  # the last step's tail, once per k steps as in a long run
    return (time.perf_counter() - t0) / max(len(bs) - warmup, 1), out


def run_eager(bs: list[dict], mbs: int, warmup: int) -> tuple[float, int, list[float]]:
    """(seconds per step, peak bytes, losses) of the eager loop: the timed steps back to back, one sync."""
    from torch.utils.checkpoint import checkpoint

    class Ckpt(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, *a, **kw):
            return checkpoint(self.layer, *a, use_reentrant=False, **kw)

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self._modules["layer"], name)

    model = build().to("cuda", torch.bfloat16)
    for i in range(len(model.model.layers)):
        model.model.layers[i] = Ckpt(model.model.layers[i])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()

    def step(b: dict) -> torch.Tensor:
        total = torch.zeros((), device="cuda")
        for ids, lab in zip(b["input_ids"].chunk(mbs), b["labels"].chunk(mbs)):
            loss = model(input_ids=ids.cuda(non_blocking=True), labels=lab.cuda(non_blocking=True)).loss / mbs
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    seconds, losses = timed(step, torch.cuda.synchronize, bs, warmup)
    losses = [float(x) for x in losses]
    peak = torch.cuda.max_memory_allocated()
    del model, opt
    torch.cuda.empty_cache()
    return seconds, peak, losses


def run_compiled(bs: list[dict], mbs: int, warmup: int, gpus: int, hw) -> tuple:
    """(seconds per step, peak allocated, peak reserved, losses, plan, [stats of the last step]) of rpcompile.

    `gpus` workers share the one GPU (gpus > 1 exercises the multi-worker protocol on real streams).
    The timed steps run back to back and the runtime is flushed once after them: the time is the
    steady-state step time (throughput), with the staleness-1 optimizer tail counted once per k
    steps, not once per step (a flush per step would time latency).
    """
    import rpcompile
    model = build()
    t0 = time.perf_counter()
    c = rpcompile.compile(model, gpus=gpus, example=bs[0], microbatches=mbs, staleness=1,
                          optimizer=rpcompile.AdamW(lr=1e-5), dtype=torch.bfloat16, hardware=hw,
                          backend="cuda")
    print(f"  gpus={gpus}: compiled in {time.perf_counter() - t0:.1f} s; plan {c.plan.to_str()}, "
          f"{len(c.program.instrs)} instructions per iteration", flush=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    try:
        seconds, losses = timed(c.step, lambda: (c._runtime.flush(), torch.cuda.synchronize()), bs, warmup)
        stats = [c.stats()]  # the last timed step (steady state)
        plan = c.plan.to_str()
    finally:
        c.close()
    return seconds, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), losses, plan, stats


def _row(name: str, t: float, tokens: int, alloc: int, reserved: int, losses: list[float], stats=None) -> str:
    waits = "-" if not stats else f"{statistics.median(s['host_waits'] for s in stats):.0f}"
    moved = "-" if not stats else \
        f"{statistics.median(s['bytes_to_device'] + s['bytes_to_host'] for s in stats) / 2**30:.2f}"
    allocs = "-" if not stats else f"{max(s['device_allocations'] + s['host_allocations'] for s in stats)}"
    return (f"{name[:44]:44s} {t:8.3f} {tokens / t:10,.0f} {alloc / 2**30:9.2f} {reserved / 2**30:9.2f} "
            f"{waits:>6s} {allocs:>6s} {moved:>8s}  " + " ".join(f"{x:.3f}" for x in losses))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="timed steps, back to back (after 1 warm-up)")
    ap.add_argument("--only", choices=["eager", "compiled"], default=None)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4],
                    help="rpcompile runs: workers sharing the one GPU")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_compare: no CUDA device; nothing to do")
        return 0
    bs = batches(1 + args.steps, args.batch, args.seq)
    tokens = args.batch * args.seq
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; Llama ~1.1B bf16, batch {args.batch} x seq "
          f"{args.seq}, {args.microbatches} microbatches, {args.steps} timed steps after 1 warm-up", flush=True)
    header = (f"{'run':44s} {'step s':>8s} {'tokens/s':>10s} {'alloc GiB':>9s} {'resv GiB':>9s} "
              f"{'waits':>6s} {'allocs':>6s} {'PCIe GiB':>8s}  losses")
    print("columns: peak torch.cuda.max_memory_allocated / max_memory_reserved; host waits, new buffers and "
          "bytes over PCIe per step (rpcompile's Compiled.stats())", flush=True)
    eager_t = None
    if args.only in (None, "eager"):
        eager_t, peak, losses = run_eager(bs, args.microbatches, 1)
        print(header, _row("eager (ckpt per layer, AdamW fused on GPU)", eager_t, tokens, peak,
                           torch.cuda.max_memory_reserved(), losses), sep="\n", flush=True)
    if args.only in (None, "compiled"):
        from rpcompile.ir.hardware import Hardware
        hw = Hardware.measure("cuda", gpus=1)
        print(f"Hardware.measure(): bf16 {hw.flops('bfloat16') / 1e12:.0f} TFLOP/s, h2d {hw.h2d_bandwidth / 1e9:.0f} "
              f"GB/s, d2h {hw.d2h_bandwidth / 1e9:.0f} GB/s, {hw.device_memory / 2**30:.0f} GiB", flush=True)
        for gpus in args.workers:
            t, alloc, resv, losses, plan, stats = run_compiled(bs, args.microbatches, 1, gpus, hw.replace(gpus=gpus))
            ratio = "" if eager_t is None else f"   ({eager_t / t:.2f}x eager tokens/s)"
            print(_row(f"rpcompile gpus={gpus} ({plan})", t, tokens, alloc, resv, losses, stats) + ratio,
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
