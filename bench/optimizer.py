"""The host optimizer at memory speed: rpcompile's whole host side vs torch's, vs a memcpy.

Usage:
    python bench/optimizer.py [--params 48e6] [--groups 24] [--reps 5] [--runs 1] [--threads 1,2] [--no-compile]
                              [--out optimizer.md]

Every row handles the same parameters (split evenly over `--groups` layer groups of one tensor
each), with bf16 gradients arriving (as a bf16 device sends them, into buffers allocated as the runtime's
landing buffers are), clipping at max_grad_norm 1.0, AdamW (weight decay 0.01) and a bf16 compute copy. Rows:

- rpcompile kernels, staleness 0: `accumulate_grad` (writes the fp32 gradient and takes its
  statistics), `grads_complete`, `step(l, copy=True)` (the update writes the bf16 copy), `copy(l)`.
- rpcompile kernels, staleness 1: `step(l)` with the compute copies alternating between two buffers (the
  update's pass writes the new ones into the buffer the iteration uploaded from, `HostState.alternate`),
  as the runtime runs it unless the state is sharded.
- rpcompile kernels, staleness 1, 4 KiB pages: the same with the host state allocated without the huge-page
  advice (`RPCOMPILE_HUGE_PAGES=0` while it is built; runtime/host/pinned.py): what huge pages gain where
  transparent huge pages are in `madvise` mode (in `always` mode this row gets them too).
- rpcompile kernels, staleness 1, copy pass: what sharded state runs (and every staleness-1 run did before
  the alternating copies): `copy(l)` (a cast pass) before `step(l)` (the next iteration reads the version
  before the update, DESIGN.md idea 7, so it cannot share the update's pass), and before the copy the
  runtime's undo copy of what it overwrites (`runtime.host_lanes.back_up`: an iteration's copies may have
  to be undone until it commits).
- rpcompile kernels, bf16 moments (`AdamW(state_dtype=torch.bfloat16)`), staleness 0 and 1: the same
  calls, the moments read and written as bf16 (rounded stochastically; 14 bytes per parameter).
- rpcompile kernels, bf16 moments and master (`master_dtype=torch.bfloat16` too: 12 bytes per parameter),
  and bf16 moments, master and gradients (`grad_dtype=torch.bfloat16` too: 10 bytes), staleness 0 and 1.
  At staleness 1 every row alternates its compute copies between two buffers as the runtime does
  (runtime/host/layout.py `Alternation`, `HostState.alternate`): the update's pass writes the new copies
  (a bf16 master: the new master) into the other buffer, with no copy pass and no undo copy.
- rpcompile, torch kernels (`impl="foreach"`: eager bits) on the same flat buffers.
- torch equivalent: grad copy into `.grad`, `clip_grad_norm_`, fused AdamW, bf16 copy.
- torch fused AdamW step alone; DeepSpeed's CPUAdam step alone (if `deepspeed` is installed and
  its CPU op builds).
- torch.compile (inductor's C++/OpenMP code) of the same two fused passes over the flat buffers.
- memcpy of 18 bytes per parameter (36 bytes moved: the fused design's traffic, the bandwidth floor).
- an in-place stream of 18 bytes per parameter (`add_`: 18 read, 18 written, no write-allocate read of
  a fresh destination, as the update's read-modify-write buffers): a second floor.

The median of `--reps` timed calls after one warm-up per row; rows run round-robin so machine load
hits them alike. Each run builds every row afresh, in an order shuffled per run (`build`: where a row's
buffers lie moves its time). With `--runs K` that is done K times per thread count: a row's time is the median of its K
medians, and a second table gives the range of the lean rows' ratio to the fp32 state over the K runs (on a
shared machine one run's ratio moves by 0.1 or more). One table per torch thread count in `--threads` (every row uses that many threads).
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_line, write_doc  # noqa: E402
from tabulate import tabulate  # noqa: E402

import rpcompile  # noqa: E402
from rpcompile.runtime.host.optimizer import HostState  # noqa: E402
from rpcompile.runtime.host.pinned import HUGE_PAGES_ENV, host_zeros  # noqa: E402
from rpcompile.runtime.host_lanes import back_up, copied_regions, undo_buffers  # noqa: E402

Case = Callable[[], float]
CLIP = 1.0
ALTERNATING = "accumulate, complete, step (alternating copies)"  # a staleness-1 row's calls
BYTES_FUSED = 36  # per parameter: land (2 read + 4 write) + update (16 read + 12 write + 2 copy)


def timed(fn: Callable[[], None]) -> Case:
    """`fn` as a case: returns its seconds."""
    def run() -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return run


LEAN = {"bf16 moments": dict(state_dtype=torch.bfloat16),  # row name part -> AdamW's lean options
        "bf16 moments+master": dict(state_dtype=torch.bfloat16, master_dtype=torch.bfloat16),
        "bf16 moments+master+grads": dict(state_dtype=torch.bfloat16, master_dtype=torch.bfloat16,
                                          grad_dtype=torch.bfloat16)}


def bf16_grads(total: int, groups: int) -> list[torch.Tensor]:
    """One seeded bf16 gradient per group, in host memory allocated as the runtime's landing buffers are
    (runtime/host_lanes.py's staging: `pinned_zeros`, huge pages where the advice is on; torch's allocator put
    them on 4 KiB pages, which made every row's landing read 1-3 ms slower on the Xeon of docs/bench)."""
    g = torch.Generator().manual_seed(0)
    return [host_zeros(total // groups, torch.bfloat16).copy_(torch.randn(total // groups, generator=g))
            for _ in range(groups)]


def ours(total: int, groups: int, staleness: int, impl: str = "fused", alternate: bool = True,
         **lean: torch.dtype) -> Case:
    """One iteration of HostState's host side over every group (`lean`: AdamW's state_dtype, master_dtype and
    grad_dtype, default float32; `alternate=False`: at staleness 1 the copy pass and its undo copy, as sharded
    state runs it)."""
    params = {f"layer{l}.weight": torch.nn.Parameter(torch.randn(total // groups)) for l in range(groups)}
    state = HostState(params, {n: (l,) for l, n in enumerate(params)}, groups, dtype=torch.bfloat16,
                      optimizer=rpcompile.AdamW(lr=1e-4, max_grad_norm=CLIP, impl=impl, **lean),
                      staleness=staleness)  # as the runtime makes it (split fp32 masters at staleness 1)
    assert (state.kernels is not None) == (impl == "fused"), "the kernels did not build"
    grads = dict(zip(params, bf16_grads(total, groups)))
    del params

    def run() -> None:
        for n, g in grads.items():
            state.accumulate_grad(n, g)
        for l in reversed(range(groups)):
            state.grads_complete(l)
        for l in reversed(range(groups)):
            if staleness == 0:
                state.step(l, copy=True)
                state.copy(l)
            elif alternating:  # the step writes the other buffer: nothing to copy or undo
                state.step(l)
            else:
                for key, region in copied_regions(state, l).items():  # the runtime's undo copy (host_lanes)
                    back_up(state, region, undo[key][0])
                state.copy(l)
                state.step(l)
    alternating = staleness == 1 and alternate and state.alternate(0)  # what the runtime does (HostLanes)
    undo = {} if alternating else undo_buffers(state)
    return timed(run)


def small_pages(make: Callable[[], Case]) -> Case:
    """`make()` with the huge-page advice off while it allocates (the host state on 4 KiB pages in `madvise` mode)."""
    before = os.environ.get(HUGE_PAGES_ENV)
    os.environ[HUGE_PAGES_ENV] = "0"
    try:
        return make()
    finally:
        if before is None:
            del os.environ[HUGE_PAGES_ENV]
        else:
            os.environ[HUGE_PAGES_ENV] = before


def torch_params(total: int, groups: int) -> list[torch.nn.Parameter]:
    """One fp32 parameter per group, with a gradient."""
    out = [torch.nn.Parameter(torch.randn(total // groups)) for _ in range(groups)]
    for p in out:
        p.grad = torch.zeros_like(p)
    return out


def torch_equivalent(total: int, groups: int) -> Case:
    """grad copy, clip_grad_norm_, fused AdamW, bf16 copy: what an eager loop does per iteration."""
    params, grads = torch_params(total, groups), bf16_grads(total, groups)
    copies = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def run() -> None:
        for p, g in zip(params, grads):
            p.grad.copy_(g)
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        torch._foreach_copy_(copies, [p.detach() for p in params])
    return timed(run)


def torch_fused_alone(total: int, groups: int) -> Case:
    """torch's fused AdamW step alone (gradients already in .grad)."""
    params = torch_params(total, groups)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    return timed(opt.step)


def deepspeed_alone(total: int, groups: int) -> Case | str:
    """DeepSpeed's CPUAdam (AdamW mode) step alone, or why it is not available."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        params = torch_params(total, groups)
        opt = DeepSpeedCPUAdam(params, lr=1e-4, adamw_mode=True)
        opt.step()
    except Exception as exc:  # noqa: BLE001 - not installed, or its CPU op does not build here
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
    return timed(opt.step)


def memcpy(total: int) -> Case:
    """A copy of 18 bytes per parameter: 36 bytes of memory traffic, the fused design's floor."""
    src = torch.ones(total * 18 // 4)
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src))


def stream(total: int) -> Case:
    """An in-place pass over 18 bytes per parameter: 18 read and 18 written (no fresh destination)."""
    buf = torch.ones(total * 18 // 4)
    return timed(lambda: buf.add_(1.0))


def compiled(total: int, groups: int) -> Case:
    """torch.compile of the two fused passes (land with statistics; clip-scaled AdamW writing the bf16 copy)."""
    n = total // groups

    def land(buf, g):
        buf.copy_(g.float())
        return buf.double().square().sum(), ~torch.isfinite(buf).all()

    def update(p, g, m, v, out, factor, decay, w1, b2, w2, eps, neg_step, bc2):
        gi = g * factor
        p.mul_(decay)
        m.lerp_(gi, w1)
        v.mul_(b2).add_(gi * gi * w2)
        p.add_(neg_step * m / (v.sqrt() / bc2 + eps))
        out.copy_(p)

    land_c, update_c = torch.compile(land, dynamic=False), torch.compile(update, dynamic=False)
    bufs = [[torch.randn(n) for _ in range(4)] + [torch.empty(n, dtype=torch.bfloat16)] for _ in range(groups)]
    grads = bf16_grads(total, groups)
    scalars = [torch.tensor(x) for x in (0.5, 1 - 1e-6, 0.1, 0.999, 0.001, 1e-8, -1e-4, 0.9)]

    def run() -> None:
        sq = [land_c(b[1], g)[0] for b, g in zip(bufs, grads)]
        coef = torch.clamp(CLIP / (torch.stack(sq).sum().sqrt() + 1e-6), max=1.0)
        for b in bufs:
            update_c(*b, coef, *scalars[1:])
    return timed(run)


def build(makers: list[Callable[[], Case]], seed: int) -> list[Case]:
    """Every row's case (in the rows' order), built in an order shuffled by `seed`.

    Where a row's buffers lie in memory moves its time: on a Xeon VM, 1 GiB buffers allocated one after another
    took 89-136 ms each for the same in-place add_, and the row built first ran 5-20% slower than when built
    later (its landing alone 35 instead of 18 ms). Built in one fixed order, the fp32 state (the first row, which
    every `vs fp32 state` divides by) would carry that every run; so each run builds its rows afresh in another
    order, and the runs' medians spread the luck over the rows.

        >>> order = []
        >>> build([lambda i=i: order.append(i) or i for i in range(4)], seed=1)
        [0, 1, 2, 3]
        >>> sorted(order) == [0, 1, 2, 3] and order != [0, 1, 2, 3]
        True
    """
    order = list(range(len(makers)))
    random.Random(seed).shuffle(order)
    built = {i: makers[i]() for i in order}
    return [built[i] for i in range(len(makers))]


def _vs_fp32(med: dict[str, float], name: str) -> float:
    """The fp32 state's time at the staleness of row `name` over the row's (its speed-up over the fp32 state)."""
    return med[f"rpcompile kernels, staleness {name[-1]}"] / med[name]


def paired(rounds: list[dict[str, float]], names: list[str]) -> list[tuple[str, ...]]:
    """Per lean row: the lowest, quartiles and highest of its speed-up over the fp32 state within each round-robin
    (the two timed seconds apart, so a load that comes and goes over minutes moves both alike).

    >>> paired([{"rpcompile kernels, staleness 1": 3.0, "x, staleness 1": 2.0}] * 3, ["x, staleness 1"])
    [('x, staleness 1', '1.50', '1.50', '1.50', '1.50', '1.50')]
    """
    rows = []
    for name in names:
        r = sorted(_vs_fp32(t, name) for t in rounds)
        q = statistics.quantiles(r, n=4, method="inclusive") if len(r) > 1 else r * 3
        rows.append((name, *(f"{x:.2f}" for x in (r[0], q[0], q[1], q[2], r[-1]))))
    return rows


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark, print the table and write docs/bench/<--out>; returns the markdown."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=48e6, help="total parameters")
    ap.add_argument("--groups", type=int, default=24, help="layer groups (one tensor each)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    ap.add_argument("--runs", type=int, default=1, help="repeat each table's round-robin this often (median of "
                    "the runs' medians, and the range of the lean rows' ratios)")
    ap.add_argument("--threads", default="1,2", help="torch thread counts, one table each")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile row (its first compile is slow)")
    ap.add_argument("--out", default="optimizer.md", help="file name under docs/bench ('' = none)")
    args = ap.parse_args(argv)
    total, groups = int(args.params) // args.groups * args.groups, args.groups
    ds = deepspeed_alone(total, groups)  # a Case if DeepSpeed's CPUAdam builds here, else why not
    ds_missing = ds if isinstance(ds, str) else None
    del ds  # each run builds its own (`build`)
    S0 = "accumulate, complete, step(copy=True), copy"
    cases: list[tuple[str, str, Callable[[], Case]]] = [  # each row's name, calls and the function building it
        ("rpcompile kernels, staleness 0", S0, lambda: ours(total, groups, 0)),
        ("rpcompile kernels, staleness 1", ALTERNATING, lambda: ours(total, groups, 1)),
        ("rpcompile kernels, staleness 1, 4 KiB pages", ALTERNATING,
         lambda: small_pages(lambda: ours(total, groups, 1))),
        ("rpcompile kernels, staleness 1, copy pass", "accumulate, complete, undo copy, copy, step",
         lambda: ours(total, groups, 1, alternate=False)),
        *[(f"rpcompile kernels, {what}, staleness {s}", how, lambda s=s, lean=lean: ours(total, groups, s, **lean))
          for what, lean in LEAN.items() for s, how in ((0, S0), (1, ALTERNATING))],
        ("rpcompile, torch kernels (impl=foreach)", "accumulate, complete, step, copy",
         lambda: ours(total, groups, 0, "foreach")),
        ("torch equivalent", "grad copy, clip_grad_norm_, fused AdamW, bf16 copy",
         lambda: torch_equivalent(total, groups)),
        ("torch fused AdamW alone", "step", lambda: torch_fused_alone(total, groups)),
        ("memcpy, 18 B/param", "copy_ (36 B of traffic per param)", lambda: memcpy(total)),
        ("stream in place, 18 B/param", "add_ (36 B of traffic per param)", lambda: stream(total))]
    if ds_missing is None:
        at = [name for name, _, _ in cases].index("torch fused AdamW alone") + 1
        cases.insert(at, ("DeepSpeed CPUAdam alone", "step (adamw_mode)", lambda: deepspeed_alone(total, groups)))
    if not args.no_compile:
        t = time.perf_counter()
        case = compiled(total, groups)
        case()  # the first call compiles
        at = [name for name, _, _ in cases].index("rpcompile kernels, staleness 1, copy pass") + 1
        cases.insert(at, ("torch.compile of the fused passes", f"land, clip, AdamW+copy (compiled in "
                                                              f"{time.perf_counter() - t:.0f} s)", lambda: case))
    tables = []
    for threads in [int(x) for x in args.threads.split(",")]:
        torch.set_num_threads(threads)
        runs = []  # per run: row name -> median seconds
        rounds = []  # every round-robin of every run: row name -> seconds
        for r in range(args.runs):
            built = build([make for _, _, make in cases], seed=threads * 1000 + r)
            for run in built:  # warm-up: first touch, lazy state, thread pools
                run()
            times = [[run() for run in built] for _ in range(args.reps)]  # round-robin
            del built
            gc.collect()  # this run's buffers go before the next run's are allocated
            runs.append({name: statistics.median(t[i] for t in times) for i, (name, _, _) in enumerate(cases)})
            rounds += [{name: t[i] for i, (name, _, _) in enumerate(cases)} for t in times]
        med = {name: statistics.median(r[name] for r in runs) for name, _, _ in cases}
        eq, mc = med["torch equivalent"], med["memcpy, 18 B/param"]
        rows = [(name, how, f"{med[name] * 1e3:.1f}", f"{total / med[name] / 1e6:.0f}", f"{eq / med[name]:.2f}",
                 f"{mc / med[name]:.2f}", f"{_vs_fp32(med, name):.2f}" if "bf16" in name else "")
                for name, how, _ in cases]
        tables.append(f"### {threads} thread{'s' if threads > 1 else ''} (load average {os.getloadavg()[0]:.1f})\n\n"
                      + tabulate(rows, headers=["path", "what is timed", "ms / iteration", "Mparam/s",
                                                "vs torch equivalent", "of memcpy rate (36 B/param)",
                                                "vs fp32 state"],
                                 tablefmt="github"))
        if args.runs > 1:
            spread = [(name, *(f"{f(_vs_fp32(r, name) for r in runs):.2f}" for f in (min, statistics.median, max)))
                      for name, _, _ in cases if "bf16" in name]
            tables.append(f"`vs fp32 state` over the {args.runs} runs ({threads} thread{'s' if threads > 1 else ''})"
                          f"\n\n" + tabulate(spread, headers=["path", "lowest", "median", "highest"],
                                                tablefmt="github"))
        tables.append(f"`vs fp32 state` paired: the ratio within each round-robin, over its {len(rounds)} rounds "
                      f"({threads} thread{'s' if threads > 1 else ''})\n\n"
                      + tabulate(paired(rounds, [name for name, _, _ in cases if "bf16" in name]),
                                 headers=["path", "lowest", "quartile 1", "median", "quartile 3", "highest"],
                                 tablefmt="github"))
    text = (f"# The host optimizer at memory speed\n\n{machine_line()}  \n"
            f"{os.cpu_count()} cores shared with other users; the load average is given per table  \n"
            f"{total / 1e6:.0f}M fp32 parameters in {groups} groups, bf16 gradients in, AdamW, clipping at "
            f"{CLIP}, bf16 compute copy; median of {args.reps} after one warm-up, rows interleaved"
            f"{f'; {args.runs} runs, each row the median of their medians' if args.runs > 1 else ''}\n\n"
            + "\n\n".join(tables) + "\n\n"
            f"DeepSpeed CPUAdam: {'timed above' if ds_missing is None else 'not available: ' + ds_missing}.\n\n"
            "`of memcpy rate` is the memcpy row's time over the row's: 1.0 means the row moves its parameters\n"
            "as fast as a copy of 36 bytes per parameter (the fused design's traffic: a 2-byte read and 4-byte\n"
            "write while the gradient lands, 16 bytes read and 14 written in the update). Staleness 1 moves the\n"
            "same with alternating copies (the update's pass writes the copy into the other buffer), 44 with the\n"
            "copy pass (4 read, 2 written; the undo copy before it 2 read, 2 written). The bf16 moment rows move\n"
            "28 at staleness 0 (the update reads 12 bytes and writes 10); at staleness 1 they keep the fp32 master\n"
            "split in two bf16-sized halves (one the compute copy) and move 26 (the update reads 12 and writes 8:\n"
            "the copy half out of place, no copy of its own); with a bf16 master too 24 (the update reads 10 and writes 8: the\n"
            "master out of place, no copy); with bf16 gradients too 20 (the gradient lands as 2 read and 2\n"
            "written, the update reads 8 and writes 8). The buffers written whole (a gradient's first landing,\n"
            "the copy, a bf16 master or half stepped out of place) are written around the cache (non-temporal\n"
            "stores), so no line of theirs is read first.\n"
            "`vs fp32 state` is the fp32 row's time of the same\n"
            "staleness over theirs (issue 48 asks 1.2 or more); the paired table takes that ratio within each\n"
            "round-robin, where the two rows ran seconds apart, so load that comes and goes over minutes moves\n"
            "both alike. Each run builds its rows afresh in a shuffled order (`build`: where a row's buffers\n"
            "lie moves its time). On one thread the lean rows gain less than the bytes they save (36/26, 36/24,\n"
            "36/20): on an AMD EPYC the lean updates were bound by their arithmetic (the float32 update, one\n"
            "lowbias32 hash and up to three roundings an element: runtime/host/kernels_avx512.h); on a Xeon by\n"
            "memory latency until the loop prefetched its streams, and since then by memory, at fewer bytes a\n"
            "second than the fp32 update's. Compare ratios within one table, not across runs.\n"
            "torch's copy_ into a fresh destination also reads it first (write-allocate), so the memcpy row\n"
            "moves more than 36 bytes per parameter; the in-place stream row (read and written, as the update's\n"
            "buffers) is the tighter floor: compare its ms with ours.\n"
            "With more threads than free cores (a load average above the core count), every parallel region\n"
            "waits at its barrier for a descheduled thread: rows that make one region per group and pass\n"
            "(ours: 2 per group, torch's fused AdamW: 1 per tensor) lose more than the single memcpy.\n")
    print(text)
    if args.out:
        print("wrote", write_doc(args.out, text))
    return text


if __name__ == "__main__":
    main()
