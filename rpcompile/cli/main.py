"""Command line: python -m rpcompile {demo, plan, simulate, train, finetune} ...

    python -m rpcompile demo
    python -m rpcompile plan --model llama3.1-8b --gpus 8 --hardware rtx4090 --seq 2048 --microbatches 16
    python -m rpcompile plan --model qwen3-32b --host-memory 1024 --micro-batch-size 2
    python -m rpcompile plan --model qwen3-32b --state-dtype bf16   # bf16 AdamW moments: 14 B/param, not 18
    python -m rpcompile plan --model qwen3-32b --state-dtype bf16 --master-dtype bf16   # and a bf16 master: 12
    python -m rpcompile plan --model qwen3-32b --state-dtype bf16 --master-dtype bf16 --grad-dtype bf16   # 10
    python -m rpcompile plan --model qwen3-32b --servers 4 --shard-state   # each server: 1/4 of masters + moments
    python -m rpcompile simulate --program program.csv [--costs costs.json] --hardware rtx4090
    python -m rpcompile train --config run.json          # train --help lists the config keys
    python -m rpcompile finetune --model DIR --data train.jsonl --out DIR [--lora 8] [--save-every 100]
    python -m rpcompile finetune --config OUT/rpcompile-run.json --out OUT2   # rerun a run (or a .json/.yaml)

A bad value (a count below 1, an unknown config key, a string where a number
goes), a file that cannot be read or written (any OSError: missing, a folder
where a file goes, no permission) and a non-finite loss (FloatingPointError) are
one line on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import threading
import time

from rpcompile.checkpoint import write_text_atomic
from rpcompile.cli.demo import DemoConfig, run
from rpcompile.finetune.loop import StepFailed
from rpcompile.finetune.run import finetune
from rpcompile.finetune.config import MAX_COUNT
from rpcompile.cli.finetune import add_arguments, config_from_args
from rpcompile.models.planning import plan_model
from rpcompile.passes.cost.host_bytes import _gib
from rpcompile.models.presets import MODELS
from rpcompile.cli.train import RunConfig, config_help, train
from rpcompile.ir.costs import CostTable
from rpcompile.ir.hardware import Hardware
from rpcompile.ir.optim import GRAD_DTYPES, MASTER_DTYPES, STATE_DTYPES
from rpcompile.ir.program import Program
from rpcompile.runtime import RuntimeFailure, simulate


class _BadUsage(Exception):
    """A command line argparse refused: printed by `main` as one line (no usage block, no traceback)."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a refused command line raised as `_BadUsage` instead of printing usage and exiting."""

    def error(self, message: str):
        raise _BadUsage(f"{self.prog}: error: {message} (see {self.prog} --help)")


def positive_int(text: str) -> int:
    """argparse type: an integer from 1 to MAX_COUNT (refused with the value, naming the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be a positive integer (at most {MAX_COUNT:,}), got {value}")
    return value


def cmd_demo(args: argparse.Namespace) -> int:
    """Train the embedded tiny Llama on the repository's own text."""
    run(DemoConfig(steps=args.steps, out=args.out))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Plan a model on meta for a target machine and compare with the baselines."""
    t = time.perf_counter()
    if args.host_memory is not None and not 1 <= args.host_memory * 2**30 < math.inf:  # NaN too
        raise ValueError(f"--host-memory must be a positive number of GiB, and finite, got {args.host_memory:g}")
    if args.shard_state and args.servers == 1:
        raise ValueError("--shard-state needs --servers W with W > 1: it splits the masters and optimizer moments "
                         "over W data-parallel servers")
    limit = None if args.host_memory is None else int(args.host_memory * 2**30)
    r = plan_model(args.model, gpus=args.gpus, hardware=args.hardware, seq=args.seq,
                   microbatches=args.microbatches, staleness=args.staleness, frozen_base=args.frozen_base,
                   host_memory=limit, microbatch_size=args.micro_batch_size,
                   state_dtype=STATE_DTYPES[args.state_dtype],
                   master_dtype=MASTER_DTYPES[args.master_dtype],
                   grad_dtype=GRAD_DTYPES[args.grad_dtype], servers=args.servers,
                   shard_state=args.shard_state)  # raises (exit 2) over the host
    n = args.micro_batch_size
    size = f"{r.params / 1e9:.2f}B" if r.params >= 1e8 else f"{r.params / 1e6:.2f}M"
    print(f"{args.model}: {size} parameters, {len(r.costs)} layers, "
          f"{args.gpus}x {args.hardware}, seq {args.seq}, {args.microbatches} microbatches of "
          f"{n} sequence{'s' if n > 1 else ''}\n")
    print(r.plan, "", r.table(), "", sep="\n")
    source = "--host-memory" if limit is not None else f"{args.hardware} preset"
    each = " on each server" if args.servers > 1 else ""
    print(f"host memory: {r.host} needed{each} of {r.host_memory / 2**30:,.1f} GiB ({source}): fits")
    if args.shard_state:
        own = r.host.masters + r.host.optimizer
        print(f"sharded optimizer state over {args.servers} servers: each holds 1/{args.servers} of the masters "
              f"and moments ({_gib(own)} of {_gib(r.state_whole)}; the largest share, server 0's, is counted)")
    elif args.servers > 1:
        print(f"{args.servers} data-parallel servers without --shard-state: each holds the whole parameter state "
              f"(masters and moments {_gib(r.state_whole)}), so each needs what one server does")
    print(f"{r.host.per_param_line()}, {args.state_dtype} moments (--state-dtype)"
          f"{', bf16 master (--master-dtype)' if args.master_dtype == 'bf16' else ''}"
          f"{', bf16 gradients (--grad-dtype)' if args.grad_dtype == 'bf16' else ''}")
    where = f"{args.gpus}x {args.hardware}, {n} sequence{'s' if n > 1 else ''} per microbatch"
    if r.max_seq is not None:  # the length, then what stops a longer one (SeqLenLimit's str)
        print(f"max_seq_len on {where}: {r.max_seq}")
    else:
        print(f"max_seq_len on {where}: n/a ({r.max_seq_why})")
    print(f"planned in {time.perf_counter() - t:.1f} s")
    if args.save_program:
        r.program.to_csv(args.save_program)
        write_text_atomic(args.save_program + ".costs.json", json.dumps(r.costs.to_lists()))
        print(f"wrote {args.save_program} and {args.save_program}.costs.json")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    """Simulate a saved program (CSV) with saved costs (JSON) on a hardware preset."""
    program = Program.from_csv(args.program)
    costs_path = args.costs or args.program + ".costs.json"
    try:
        with open(costs_path) as f:
            costs = CostTable.from_lists(**json.load(f))
    except FileNotFoundError:
        n = program.plan.num_layers
        print(f"no cost file {costs_path!r}: using unit costs (fwd 1 ms, bwd 2 ms per layer, no bytes)")
        costs = CostTable.from_lists(fwd=[1e-3] * n, bwd=[2e-3] * n)
    t = simulate(program, costs, Hardware.preset(args.hardware), iterations=args.iterations)
    print(t.summary())
    if args.trace:
        t.to_chrome_trace(args.trace)
        print(f"wrote {args.trace}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Train from a JSON run config (see rpcompile.cli.train.RunConfig)."""
    train(RunConfig.from_json(args.config))  # a bad key or value: ValueError naming it
    return 0


def cmd_finetune(args: argparse.Namespace) -> int:
    """Fine-tune a Hugging Face model folder on a data file (see rpcompile.finetune.run).

    The settings: --config FILE (rpcompile.finetune.config_file), overridden by the flags given; a bad
    key or value in the file is a ValueError naming it (one line, exit 2), raised before anything loads.
    """
    finetune(config_from_args(args))
    return 0


def parser() -> argparse.ArgumentParser:
    """The argument parser; each sub-command's `func` is its handler."""
    p = _Parser(prog="python -m rpcompile", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a tiny Llama on this repository's text (2 workers)")
    d.add_argument("--steps", type=positive_int, default=200)
    d.add_argument("--out", default="rpcompile-demo")
    d.set_defaults(func=cmd_demo)
    pl = sub.add_parser("plan", help="plan a model for a machine, on meta, vs the baselines")
    pl.add_argument("--model", required=True, help=f"one of {sorted(MODELS)} or a config.json path")
    pl.add_argument("--gpus", type=positive_int, default=8)
    pl.add_argument("--hardware", default="rtx4090")
    pl.add_argument("--seq", type=positive_int, default=2048, help="tokens per sequence")
    pl.add_argument("--microbatches", type=positive_int, default=16, help="microbatches per iteration")
    pl.add_argument("--micro-batch-size", type=positive_int, default=1, metavar="N",
                    help="sequences per microbatch (default 1)")
    pl.add_argument("--staleness", type=int, default=1, choices=(0, 1))
    pl.add_argument("--frozen-base", action="store_true",
                    help="LoRA-style: freeze every matrix (no grads, masters or optimizer state for them)")
    pl.add_argument("--state-dtype", choices=tuple(STATE_DTYPES), default="fp32",
                    help="AdamW's moments: fp32 (default, 18 B per trainable parameter) or bf16 (14 B: stochastically "
                    "rounded, the update in fp32)")
    pl.add_argument("--master-dtype", choices=tuple(MASTER_DTYPES), default="fp32",
                    help="AdamW's master weights: fp32 (default) or bf16 (2 B less per trainable parameter: no fp32 "
                    "master; updated in fp32, stored with stochastic rounding)")
    pl.add_argument("--grad-dtype", choices=tuple(GRAD_DTYPES), default="fp32",
                    help="the host gradient buffers: fp32 (default) or bf16 (2 B less per trainable parameter: rounds "
                    "summed in fp32, stored with stochastic rounding)")
    pl.add_argument("--host-memory", type=float, metavar="GiB",
                    help="host memory of the target machine in GiB (default: the hardware preset's)")
    pl.add_argument("--servers", type=positive_int, default=1, metavar="W",
                    help="data-parallel servers, each running this plan on its own microbatches (default 1)")
    pl.add_argument("--shard-state", action="store_true",
                    help="shard the masters and optimizer moments over the --servers: the host memory (and its "
                    "check, and max_seq_len) is one server's share")
    pl.add_argument("--save-program", help="write the program (CSV) and costs (JSON) here")
    pl.set_defaults(func=cmd_plan)
    s = sub.add_parser("simulate", help="simulate a saved program")
    s.add_argument("--program", required=True)
    s.add_argument("--costs", help="CostTable JSON (default: PROGRAM.costs.json)")
    s.add_argument("--hardware", default="rtx4090")
    s.add_argument("--iterations", type=positive_int, default=1)
    s.add_argument("--trace", help="write a Chrome trace here")
    s.set_defaults(func=cmd_simulate)
    t = sub.add_parser("train", help="train from a JSON run config",
                       formatter_class=argparse.RawDescriptionHelpFormatter, description="Train a byte-level Llama on a text file from a JSON run config, e.g.\n"
                       '  {"text": "corpus.txt", "steps": 100, "gpus": 2, "lr": 0.003, "save": "run.ckpt"}',
                       epilog="config keys (a JSON object; every key but text is optional):\n" + config_help())
    t.add_argument("--config", required=True, metavar="JSON", help="the run config file")
    t.set_defaults(func=cmd_train)
    f = sub.add_parser("finetune", help="fine-tune a Hugging Face model folder on a .txt/.jsonl file",
                       description="Fine-tune a Hugging Face model folder with RoundPipe. Every option is also a key "
                       "of --config FILE (.json or .yaml; the option's name with _ for -, and progress: false for "
                       "--no-progress), and the flags given override the file.")
    add_arguments(f)
    f.set_defaults(func=cmd_finetune)
    return p


REFUSED = (ValueError, ImportError, OSError, FloatingPointError, MemoryError)  # printed as one line, exit 2
FAILED = (StepFailed, RuntimeFailure)  # a run that failed in the runtime: one line (finetune: the rest in a file it
# names; a RuntimeFailure that escapes a command, e.g. from closing a handle after a hang: its first line), exit 1
INTERRUPTED = 130  # the exit status after Ctrl-C (128 + SIGINT), as shells report it
TERMINATED = 143  # the exit status after SIGTERM (128 + SIGTERM), what a cluster scheduler sends to stop a job


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is, so a command stops the same way (a
    finetune step undone, the last checkpoint kept) and says so in one line."""


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """For the block: SIGTERM raises `Terminated` in the main thread (elsewhere nothing changes); the previous
    handler is back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        raise Terminated("terminated (SIGTERM)")
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: set outside Python


def main(argv: list[str] | None = None) -> int:
    """Run one sub-command; bad input is one line on stderr and exit status 2, not a traceback.

    Note:
        Caught: `REFUSED` (ValueError, ImportError, OSError such as FileNotFoundError,
        NotADirectoryError, IsADirectoryError or PermissionError, FloatingPointError such
        as the runtime's NonFiniteError, and MemoryError such as finetune's StepOutOfMemory).
        Ctrl-C (KeyboardInterrupt) is one line too (what the command kept, e.g. finetune's last checkpoint), and
        exit status 130; SIGTERM, while the command runs, stops it the same way, exit status 143 (`Terminated`).
        A finetune step that failed in
        the runtime (`StepFailed`: an instruction raised, or a wait ran past --timeout) is one line
        naming the instruction, the worker and the wait, and the file in OUT that holds the grid and the
        tracebacks, exit status 1. Only the message's first line is printed (a
        runtime error's grid follows it); anything else is a bug and keeps its traceback.
    """
    try:
        args = parser().parse_args(argv)
    except _BadUsage as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        with _sigterm_as_interrupt():
            return args.func(args)
    except KeyboardInterrupt as exc:  # its message says what the command kept (finetune: the last checkpoint)
        why = str(exc).strip().split("\n")[0] or "interrupted"  # Terminated's: "terminated (SIGTERM) ..."
        print(f"python -m rpcompile {args.command}: {why}", file=sys.stderr)
        return TERMINATED if isinstance(exc, Terminated) else INTERRUPTED
    except FAILED as exc:
        print(f"python -m rpcompile {args.command}: error: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    except REFUSED as exc:
        line = str(exc).strip().split("\n")[0].strip() or type(exc).__name__
        print(f"python -m rpcompile {args.command}: error: {line}", file=sys.stderr)
        return 2

