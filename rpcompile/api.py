"""compile(): the pass pipeline, and Compiled: the trained model's handle.

Here the handle is built (programs, runtime, host state), switches programs when the batch changes,
simulates, saves, loads and closes; what it runs (`step`, `evaluate`, `flush`, `set_lr`, `stats`,
`last_timeline`) is its base class `Training`, in training.py.

    >>> c = rpcompile.compile(model, gpus=2, microbatches=4)   # checks the arguments   # doctest: +SKIP
    >>> loss = c.step(batch)                # plans for this batch, then trains on it   # doctest: +SKIP
    >>> print(c.plan); print(c.program)                                               # doctest: +SKIP

`example=batch` plans at `compile` instead (the same plan). A handle compiled without it holds the
checked options (`Pending`) until its first `step` / `evaluate`; what only a plan makes (`PLANNED`)
raises "nothing is planned yet" until then (`Compiled.__getattr__`).
"""
from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Any, Callable, Sequence

import torch

from rpcompile import checkpoint, passes
from rpcompile.batch import check_batch, describe_change, signature
from rpcompile.ir.graph import LayerGraph
from rpcompile.ir.hardware import Hardware
from rpcompile.ir.optim import SGD, AdamW, DynamicLossScale, decay_names
from rpcompile.machine import hardware_of
from rpcompile.options import Options, check_model, default_microbatches, options
from rpcompile.passes.trace import match_units
from rpcompile.pipeline import Frozen, compile_passes, plan_pipeline
from rpcompile.replan import Variant, Variants, plan_for
from rpcompile.runtime import simulate
from rpcompile.runtime.distributed import data_parallel
from rpcompile.runtime.sharded import shard_of, sharded_data_parallel
from rpcompile.runtime.executor import Runtime
from rpcompile.runtime.host.optimizer import HostState
from rpcompile.runtime.stage.batch import trained_tokens
from rpcompile.runtime.transfer import plan_deadline
from rpcompile.snapshots import Snapshots
from rpcompile.training import Training, _one_caller

__all__ = ["compile", "Compiled", "Options", "default_microbatches", "plan_pipeline"]

# What only a plan makes: on a handle compiled without `example`, reading one before its first step or evaluate
# raises "nothing is planned yet" (`Compiled.__getattr__`)
PLANNED = frozenset({"graph", "costs", "plan", "program", "assignment", "microbatches", "state", "rank", "world_size",
                     "_example", "_units", "_signature", "_variants", "_dist", "_runtime"})


def compile(model: torch.nn.Module, gpus: int = 8, *, example: Any = None, microbatches: int | None = None,
            staleness: int = 1, optimizer: AdamW | SGD | None = None, dtype: torch.dtype | None = None,
            loss_fn: Callable | None = None, layers: Sequence[str] | None = None,
            lm_head_shards: int | str = "auto", hardware: Hardware | str | None = None,
            memory_budget: int | None = None, backend: str = "auto", seed: int = 0,
            on_nonfinite: str = "raise", loss_scale: float | DynamicLossScale | None = None,
            loss_mean: str = "microbatch", fp16_accumulation: bool = False, fused_head: bool = False,
            dist: Any = False, process_group: Any = None, timeout: float | None = None,
            shard_state: bool = False) -> "Compiled":
    """Compile `model` for RoundPipe training on `gpus` workers: check the arguments, and plan now or at the first step.

    With `example`, the passes (trace, costs, partition, emit, verify) run now on that batch. Without
    it, the handle runs them on the first batch given to `step` or `evaluate` (as `torch.compile`
    traces at the first call), and plans exactly what `example=` that batch would have: the same plan,
    losses and weights. Either way every argument is checked here, before any batch. Until the first
    plan, what only a plan has (`plan`, `program`, `graph`, `costs`, `state`, `microbatches`,
    `simulate`, `stats`, `state_dict`, `save`, ...) raises RuntimeError("nothing is planned yet: ...");
    `steps` is 0, `set_lr` is kept for the first update, `model()` is the module as given (the weights
    are read at the plan), and `close` stops nothing.

    Args:
        model: the module; it must return its loss (or pass `loss_fn`).
        gpus: number of workers (CUDA devices; host worker threads without CUDA).
        example: one global batch (tensor, tuple or dict of tensors, batch along dim 0) to plan for now;
            None (default): plan for the first batch `step` or `evaluate` gets.
        microbatches: microbatches per iteration (default: smallest divisor of the batch >= gpus).
        staleness: 1 (default, RoundPipe) or 0 (synchronous).
        optimizer: `rpcompile.AdamW(...)` (default lr 1e-4) or `rpcompile.SGD(...)`; its `decay` (names or a
            callable over `model.named_parameters()` names) picks the parameters weight decay applies to.
        dtype: training dtype of the compute copies (masters stay fp32).
        loss_fn: loss_fn(output, example) -> scalar, when the model's output is not the loss.
        layers: module-name patterns that override the layer detection, e.g. ["model.layers.*"].
        lm_head_shards: vocabulary shards of the LM head, or "auto".
        hardware: a `Hardware` or preset name used for predicted costs and the default memory budget;
            "measured": this machine (`rpcompile.measure_hardware`, which times the host optimizer that runs).
        memory_budget: device bytes per worker (default: 90% of the hardware's device memory).
        backend: "auto" (CUDA if available, else host workers), "host" or "cuda".
        seed: base seed for dropout and other randomness.
        on_nonfinite: a NaN/inf loss or gradient is caught before the optimizer applies it: "raise"
            (FloatingPointError naming the step and the first layer group; the weights and optimizer
            state stay those of the last good step) or "skip" (the step is skipped and counted in
            `Compiled.skipped_steps`). fp16 dynamic loss scaling keeps its own skip-and-lower rule.
        loss_scale: None (off), a constant factor, or `rpcompile.DynamicLossScale()` (torch GradScaler's
            rule: an iteration with an inf/nan gradient is skipped and halves the scale). Use it with
            `dtype=torch.float16`, whose gradients underflow without it; bf16 needs none.
        loss_mean: what a step's loss averages over. "microbatch" (default): the mean of the
            microbatch losses. "tokens", for models that take `labels` and return the mean NLL over
            their trained targets (transformers causal LMs: the shifted labels that are not -100): the
            sum of the token NLLs over every trained token of the step (all microbatches; with dist,
            all processes) divided by the number of those tokens. Microbatch m's loss is weighted by
            n_m / N, the counts read from the batch's labels (N all-reduced over the processes) before
            anything runs; a microbatch with no trained token counts for nothing (no NaN). The update
            is this loss's gradient, and `step` / `evaluate` return it. Composes with loss_scale.
        fp16_accumulation: with `dtype=torch.float16`, CUDA workers run their GEMMs accumulating in fp16
            (`torch.backends.cuda.matmul.allow_fp16_accumulation`, the RoundPipe reference's recipe: twice the
            fp32-accumulate rate on GeForce cards), set around each compute launch and restored after; the
            costs are priced at that rate. Pair it with `loss_scale=rpcompile.DynamicLossScale()`. Accepted
            on host workers, where it has no effect (CPU matmuls).
        fused_head: the LM head + cross-entropy takes its gradients in its forward, chunk by chunk (logits,
            loss, d(logits), then the input and weight gradients at once; no logits kept, nothing recomputed
            in the backward; on CUDA the chunk's elementwise work is one `torch.compile` kernel). Heads
            are cut into token shards instead of vocabulary shards (`lm_head_shards`). Needs a loss reduced
            by mean or sum (HF causal LMs).
        dist: data parallelism across processes: True or a `rpcompile.runtime.distributed.DistConfig`.
            `example` and `step`'s batches are then this process's shard (see DistConfig, `shard`).
        process_group: the torch.distributed group to train over (implies dist; default: the
            initialised default group, else gloo from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT).
        shard_state: with dist, each process keeps 1/W of the masters and optimizer moments (W processes) and
            the gradients are reduce-scattered and the new compute copies all-gathered instead of one
            all-reduce (`rpcompile.runtime.sharded`): servers add capacity, not only speed.
            `Compiled.parameters_fp32`-style reads (`model()`) are then collectives every rank calls.
        timeout: seconds any wait of the runtime may last before the step fails with a RuntimeFailure
            naming the instruction and what it waited for (a hang). None (default): derived from the
            plan, the larger of 10 minutes and 20x one iteration's predicted work done serially
            (`rpcompile.runtime.transfer.plan_deadline`); `Compiled.deadline_s` says what it is.
    Returns:
        A `Compiled` handle: `.plan`, `.program`, `.step(batch)`, `.simulate()`, `.save()`...
    Raises:
        ValueError: a bad argument (named, before tracing); a layer that does not fit a worker even cut
            into sub-blocks (names the layer, its bytes by term and the budget); or a run that does not fit
            the host memory (`hardware.host_memory`, else this machine's RAM: the bytes by category).
            Without `example`, all but the bad argument are raised by the first `step` / `evaluate`,
            which leaves the handle unplanned, ready for another batch.

    Example:
        >>> import torch, rpcompile
        >>> c = rpcompile.compile(torch.nn.Linear(4, 1), gpus=2)   # checked, nothing traced yet
        >>> c
        Compiled(not planned yet: plans at the first step(batch) or evaluate(batch); 2 workers, staleness 1)
        >>> c.plan
        Traceback (most recent call last):
        RuntimeError: nothing is planned yet: compile(model, gpus=2) without example= plans at the first step(batch) ...
        >>> c.close()
    """
    opts = options(gpus=gpus, microbatches=microbatches, staleness=staleness, optimizer=optimizer, dtype=dtype,
                   loss_fn=loss_fn, layers=layers, lm_head_shards=lm_head_shards, hardware=hardware,
                   memory_budget=memory_budget, backend=backend, seed=seed, on_nonfinite=on_nonfinite,
                   loss_scale=loss_scale, loss_mean=loss_mean, fp16_accumulation=fp16_accumulation,
                   fused_head=fused_head, timeout=timeout)
    check_model(model)
    if opts.layers is not None:
        match_units(model, opts.layers)  # a pattern that matches no module is named now, before any batch
    decay_names(opts.optimizer, [n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad])
    if shard_state and not dist and process_group is None:
        raise ValueError("shard_state=True shards the host state over data-parallel processes: it needs dist=True "
                         "(or a process_group)")
    return Compiled(model, opts, example, dist=dist, process_group=process_group, shard_state=bool(shard_state))


@dataclasses.dataclass
class Pending:
    """What a handle compiled without `example` keeps for its first plan (at its first step or evaluate)."""

    dist: Any                  # compile's `dist`
    process_group: Any         # compile's `process_group`
    shard_state: bool = False  # compile's `shard_state`
    lr: float | None = None    # the last `set_lr` before the plan: queued on the runtime the plan starts


class Compiled(Training, Snapshots):
    """A compiled model: the IRs, the runtime and the host-resident training state.

    One handle, one caller at a time: `step`, `evaluate`, `stats`, `set_lr`, `state_dict`,
    `load_state_dict`, `save`, `model` and `close` take the handle's lock, so calls from several
    threads are serialised (each runs whole, in the order the threads get the lock) instead of
    racing on the iteration counter.

    Planned or waiting: compiled with `example`, it plans at once (`_plan`); without, `_pending` holds
    what the plan needs besides a batch until the first `step` / `evaluate` plans with its batch (under
    the lock: two threads plan once). Before that, the names in `PLANNED` (the IRs, the host state,
    the runtime) raise RuntimeError("nothing is planned yet: ..."), in one place (`__getattr__`).

    Attributes:
        graph, costs, plan, program: the compiler's IRs (all printable).
    """

    def __init__(self, model: torch.nn.Module, opts: Options, example: Any = None, *, dist: Any = False,
                 process_group: Any = None, frozen: Frozen | None = None, resume: dict | None = None,
                 shard_state: bool = False) -> None:
        self._lock = threading.RLock()  # one caller at a time (see `_one_caller`)
        self._model, self.options, self.closed = model, opts, False
        self._pending: Pending | None = Pending(dist, process_group, shard_state)
        if example is not None:
            self._plan(example, frozen=frozen, resume=resume)

    def _plan(self, example: Any, *, frozen: Frozen | None = None, resume: dict | None = None) -> None:
        """Run the passes on `example` and build what the plan needs: the IRs, host state, data parallelism,
        runtime. If anything fails, the handle is left unplanned (no thread started) and the error raised."""
        pending, opts = self._pending, self.options
        try:
            self._example = example
            shard = shard_of(pending.dist, pending.process_group) if pending.shard_state else None  # (rank, world)
            (self.graph, self.costs, self.plan, self.program, self.microbatches, self._units, _,
             self.assignment) = compile_passes(self._model, example, dataclasses.replace(opts, shard=shard),
                                               frozen=frozen)  # units: sub-blocks, if cut; admission: this share
            if opts.loss_mean == "tokens":
                trained_tokens(self.graph, example, self.microbatches)  # no `labels`: refused before any thread
            self._signature, self._variants = signature(example), Variants()  # one program per batch signature
            self._variants.put(self._signature, self._variant())
            self.state = HostState.from_graph(self.graph, optimizer=opts.optimizer, dtype=opts.dtype,
                                              loss_scale=opts.loss_scale, seed=opts.seed,  # bf16 moments' rounding
                                              pin_memory=opts.backend != "host", shard=shard,  # pinned where CUDA is
                                              staleness=opts.staleness)  # 1: split fp32 masters beside bf16 moments
            self.options = dataclasses.replace(opts, optimizer=self.state.config)  # decay resolved to names
            if resume is not None:  # a checkpoint of another model or plan is refused before any thread starts
                checkpoint.check(resume)
                self.state.check_state_dict(resume["host"], sliced=True)  # the others: rpcompile.load reads
            # data parallel (issue #9): rank 0's weights everywhere; each group's gradient averaged before its step
            self._dist = (sharded_data_parallel(self.state, pending.dist, pending.process_group, self.graph.parameters())
                          if shard else data_parallel(self.state, pending.dist, pending.process_group))
            self.rank, self.world_size = (self._dist.rank, self._dist.world) if self._dist else (0, 1)
            self._runtime = self._new_runtime(0)
        except BaseException:
            if self.__dict__.get("_dist"):
                self._dist.close()
            for name in PLANNED:  # back to unplanned: the next batch plans afresh
                self.__dict__.pop(name, None)
            self.options = opts
            raise
        self._pending = None
        if pending.lr is not None:  # set_lr before the plan: queued as it would have been on a planned handle
            self._runtime.lanes["optimizer"].submit(lambda: self.state.set_lr(pending.lr))

    def __getattr__(self, name: str) -> Any:
        """Only for names not set: what the plan makes (`PLANNED`) says in one line that none is made yet."""
        if name in PLANNED:
            raise RuntimeError(f"nothing is planned yet: compile(model, gpus={self.options.gpus}) without example= "
                               f"plans at the first step(batch) or evaluate(batch); pass example= to plan now")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def steps(self) -> int:
        """Iterations completed (a failure rolls it back to the iteration that failed)."""
        return 0 if self._pending is not None else self._runtime.t

    @property
    def deadline_s(self) -> float:
        """Seconds a wait of the runtime may last before it fails as a hang: `timeout`, else from the plan.

        Example:
            >>> rpcompile.compile(model, gpus=2, example=batch).deadline_s   # doctest: +SKIP
            600.0
        """
        return self.options.timeout or self._runtime.timeout  # the runtime's is the option, if one was given

    @property
    def skipped_steps(self) -> list[int]:
        """Iterations skipped for a non-finite loss or gradient (on_nonfinite="skip")."""
        return [] if self._pending is not None else list(self._runtime.skipped)

    def _new_runtime(self, start: int, graph: LayerGraph | None = None, program: Any = None):
        rt = Runtime(graph or self.graph, program or self.program, self.state, backend=self.options.backend,
                     seed=self.options.seed + self.rank, start_iteration=start,  # per-rank dropout
                     on_nonfinite=self.options.on_nonfinite, fp16_accumulation=self.options.fp16_accumulation,
                     timeout=self.options.timeout or plan_deadline(self.costs, self.microbatches),
                     drain_timeout=plan_deadline(self.costs, self.microbatches),  # a short timeout fails a wait only
                     assignment=self.assignment if program is None else None)
        if self._dist:
            self._dist.attach(rt)  # counts the gradient writes that complete each layer group
        return rt

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this Compiled handle is closed (close() or leaving `with`); compile again")

    def _variant(self) -> Variant:
        return Variant(self.graph, self.costs, self.plan, self.program, self.microbatches, self._example,
                       self.assignment)

    def _prepare(self, batch: Any) -> None:
        """Check `batch`; plan with it if nothing is planned yet; if its signature (inputs present, shapes)
        is not the program's, switch programs.

        The first plan of a handle compiled without `example` is the one `compile(..., example=batch)`
        makes (`_plan`). A signature seen before gets its program back; a new one is planned
        (`replan.plan_for`), keeping the training state. The new program is built before the old runtime
        stops: if planning fails (a bad batch), the handle goes on as before and the error is raised.
        """
        self._check_open()
        if self._pending is not None:  # compiled without example=: this batch is the example
            self._plan(batch)
        check_batch(batch, self.microbatches)
        sig = signature(batch)
        if sig != self._signature:
            self._runtime.flush()  # the iterations run so far complete under the program they began with
            v = self._variants.get(sig)
            if v is None:
                v = plan_for(self._model, self.options, self._variant(), self._units, batch)
                print(f"rpcompile: the batch changed ({describe_change(self._signature, sig)}); re-planned "
                      f"{self.plan.to_str()} -> {v.plan.to_str()}", file=sys.stderr)
                self._variants.put(sig, v)
            start = self._runtime.t
            self._runtime.close()
            self.graph, self.costs, self.plan, self.program = v.graph, v.costs, v.plan, v.program
            self.assignment = v.assignment
            self.microbatches, self._example = v.microbatches, v.example
            self._signature = sig
            self._runtime = self._new_runtime(start)
        check_batch(batch, self.microbatches, like=self.graph)

    def simulate(self, hardware: Hardware | str = "rtx4090", iterations: int = 1, *, example: Any = None):
        """Simulate this program on `hardware`, with layer costs predicted for that hardware.

        Args:
            hardware: a Hardware, a preset name ("rtx4090", ...) or "measured" (this machine, measured now,
                its optimizer lane priced at the rate of the optimizer this handle runs: `measure_hardware`).
            iterations: back-to-back iterations (staleness 1: the steady state needs several).
            example: the batch to cost (default: the one the program was compiled for).
        Returns:
            A Timeline (iteration time, bubble, exposed communication, peak memory per worker).
        """
        hw = hardware_of(hardware, self.options.optimizer)
        costs = passes.estimate_costs(self.graph, self._example if example is None else example, mode="predict",
                                      hardware=hw, microbatches=self.microbatches, progress=False,
                                      fp16_accumulation=self.options.fp16_accumulation)
        return simulate(self.program, costs, hw, iterations=iterations)

    @_one_caller
    def close(self) -> None:
        """Stop the runtime's threads (and the data-parallel reducer); later calls raise RuntimeError."""
        if self.closed:
            return
        self.closed = True
        if self._pending is not None:  # nothing planned: no thread was started
            return
        try:
            self._runtime.close()
        finally:
            if self._dist:
                self._dist.close()

    def __enter__(self) -> "Compiled":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._pending is not None:
            return (f"Compiled(not planned yet: plans at the first step(batch) or evaluate(batch); "
                    f"{self.options.gpus} workers, staleness {self.options.staleness})")
        return (f"Compiled({len(self.graph.layers)} layers, plan {self.plan.to_str()}, "
                f"{self.options.gpus} workers, {self.microbatches} microbatches, staleness {self.options.staleness})")
