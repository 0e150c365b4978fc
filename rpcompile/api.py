"""compile(): the pass pipeline, and Compiled: the trained model's handle.

    >>> c = rpcompile.compile(model, gpus=2, example=batch, microbatches=4)   # doctest: +SKIP
    >>> print(c.plan); print(c.program)                                        # doctest: +SKIP
    >>> loss = c.step(batch)                                                   # doctest: +SKIP
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from rpcompile import checkpoint
from rpcompile.batch import batch_size, check_batch
from rpcompile.costs import CostTable
from rpcompile.graph import LayerGraph
from rpcompile.hardware import Hardware
from rpcompile.optim import SGD, AdamW


@dataclass(frozen=True, slots=True)
class Options:
    """Everything compile() was asked for, so a re-plan can repeat it."""

    gpus: int                                  # workers N (GPUs, or host workers without CUDA)
    microbatches: int | None                   # M per iteration; None: smallest divisor of the batch >= gpus
    staleness: int                             # 0 synchronous, 1 RoundPipe (optimizer one step behind)
    optimizer: AdamW | SGD                     # CPU optimizer config
    dtype: torch.dtype | None                  # training dtype of compute copies; None keeps the model's
    loss_fn: Callable | None                   # loss_fn(output, example) when the model does not return its loss
    layers: Sequence[str] | None               # layer patterns overriding detection
    lm_head_shards: int | str                  # vocabulary shards of the LM head ("auto" from costs)
    hardware: Hardware | None                  # target for predicted costs and the memory budget
    memory_budget: int | None                  # device bytes per worker; None: 90% of hardware memory
    backend: str                               # runtime backend: "auto", "host" or "cuda"
    seed: int                                  # base seed of per-(iteration, microbatch, layer) randomness


def default_microbatches(batch: int, gpus: int) -> int:
    """The smallest divisor of the batch size that is >= gpus (the batch size itself if none)."""
    for m in range(min(gpus, batch), batch + 1):
        if batch % m == 0 and m >= min(gpus, batch):
            return m
    return batch


def compile(model: torch.nn.Module, gpus: int = 8, *, example: Any, microbatches: int | None = None,
            staleness: int = 1, optimizer: AdamW | SGD | None = None, dtype: torch.dtype | None = None,
            loss_fn: Callable | None = None, layers: Sequence[str] | None = None,
            lm_head_shards: int | str = "auto", hardware: Hardware | str | None = None,
            memory_budget: int | None = None, backend: str = "auto", seed: int = 0,
            dist: Any = False, process_group: Any = None) -> "Compiled":
    """Compile `model` for RoundPipe training on `gpus` workers.

    Args:
        model: the module; it must return its loss (or pass `loss_fn`).
        gpus: number of workers (CUDA devices; host worker threads without CUDA).
        example: one global batch (tensor, tuple or dict of tensors, batch along dim 0).
        microbatches: microbatches per iteration (default: smallest divisor of the batch >= gpus).
        staleness: 1 (default, RoundPipe) or 0 (synchronous).
        optimizer: `rpcompile.AdamW(...)` (default lr 1e-4) or `rpcompile.SGD(...)`.
        dtype: training dtype of the compute copies (masters stay fp32).
        loss_fn: loss_fn(output, example) -> scalar, when the model's output is not the loss.
        layers: module-name patterns that override the layer detection, e.g. ["model.layers.*"].
        lm_head_shards: vocabulary shards of the LM head, or "auto".
        hardware: a `Hardware` or preset name used for predicted costs and the default memory budget.
        memory_budget: device bytes per worker (default: 90% of the hardware's device memory).
        backend: "auto" (CUDA if available, else host workers), "host" or "cuda".
        seed: base seed for dropout and other randomness.
        dist: data parallelism across processes: True or a `rpcompile.runtime.distributed.DistConfig`.
            `example` and `step`'s batches are then this process's shard (see DistConfig, `shard`).
        process_group: the torch.distributed group to train over (implies dist; default: the
            initialised default group, else gloo from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT).
    Returns:
        A `Compiled` handle: `.plan`, `.program`, `.step(batch)`, `.simulate()`, `.save()`...
    """
    if isinstance(hardware, str):
        hardware = Hardware.preset(hardware)
    opts = Options(gpus=gpus, microbatches=microbatches, staleness=staleness,
                   optimizer=optimizer or AdamW(lr=1e-4), dtype=dtype, loss_fn=loss_fn, layers=layers,
                   lm_head_shards=lm_head_shards, hardware=hardware, memory_budget=memory_budget,
                   backend=backend, seed=seed)
    return Compiled(model, opts, example, dist=dist, process_group=process_group)


def plan_pipeline(model: torch.nn.Module, example: Any, opts: Options, *, mode: str = "measure"):
    """The compiler proper: trace -> shard_lm_head -> estimate_costs -> partition -> emit -> verify.

    Returns:
        (graph, costs, plan, program, microbatches)
    """
    from rpcompile import passes
    m = opts.microbatches or default_microbatches(batch_size(example), opts.gpus)
    check_batch(example, m)
    budget = opts.memory_budget
    if budget is None and opts.hardware is not None:
        budget = int(0.9 * opts.hardware.device_memory)
    # 1. trace the model into layers with explicit values across every cut
    graph = passes.trace(model, example, loss_fn=opts.loss_fn, layers=opts.layers)
    if not any(v.requires_grad for v in graph.params.values()):
        raise ValueError(f"{type(model).__name__} has no trainable parameter (requires_grad is False for all "
                         f"{len(graph.params)}): nothing to train; unfreeze some (e.g. LoRA adapters)")
    # 2. measure (or predict) per-layer time and memory for one microbatch
    costs = passes.estimate_costs(graph, example, mode=mode, hardware=opts.hardware, microbatches=m)
    # 3. cut the LM head + loss into vocabulary shards so no layer dominates, and cost the shards
    shards = opts.lm_head_shards
    sharded = _shard_head(graph, shards, costs)
    if sharded is not graph:
        graph = sharded
        costs = passes.estimate_costs(graph, example, mode=mode, hardware=opts.hardware, microbatches=m)
    # 4-5. choose the stage grouping (and, for a hardware target, the round size) and emit the program
    plan, program = _plan_and_emit(graph, costs, opts, m, budget)
    # 6. check it: dependencies, coverage, the per-layer rules R1-R5, memory
    passes.verify(program, costs=costs, memory_budget=budget)
    return graph, costs, plan, program, m


def _plan_and_emit(graph: LayerGraph, costs: CostTable, opts: Options, m: int, budget: int | None):
    """partition + emit; with a hardware target, also pick the round size by simulating each candidate.

    Note: the partitioner's objective is the compute-only schedule time. On a target whose PCIe
    traffic matters, one round of all M microbatches uploads every stage's parameters once per
    iteration instead of M / R times, so both round sizes are emitted and the simulated faster one
    (with transfers and the CPU optimizer) wins.
    """
    from rpcompile import passes
    from rpcompile.passes.timing import default_round_size
    from rpcompile.runtime import simulate, steady_iterations
    sizes = [default_round_size(opts.gpus, m)]
    if opts.hardware is not None and m not in sizes:
        sizes.append(m)
    best = None
    for r in sizes:
        plan = passes.partition(costs, gpus=opts.gpus, microbatches=m, round_size=r, memory_budget=budget,
                                staleness=opts.staleness)
        program = passes.emit(plan, gpus=opts.gpus, microbatches=m, round_size=r, staleness=opts.staleness,
                              costs=costs, readers=_shared_readers(graph))
        if len(sizes) == 1:
            return plan, program
        k = steady_iterations(program) if opts.staleness else 1
        t = simulate(program, costs, opts.hardware, iterations=k).steady_iteration_time
        if best is None or t < best[0]:
            best = (t, plan, program)
    return best[1], best[2]


def _shard_head(graph: LayerGraph, shards: int | str, costs: CostTable) -> LayerGraph:
    """shard_lm_head when the graph ends in a supported LM head; the graph itself otherwise."""
    from rpcompile import passes
    if shards == 1:
        return graph
    try:
        return passes.shard_lm_head(graph, shards=shards, costs=costs)
    except ValueError:
        if shards == "auto":  # no recognised LM head (e.g. a plain Sequential): nothing to shard
            return graph
        raise


def _shared_readers(graph: LayerGraph) -> dict[int, tuple[int, ...]]:
    """For tied parameters: optimizer layer (lowest owner) -> every layer that uses them."""
    out: dict[int, set[int]] = {}
    for owners in graph.param_owners().values():
        if len(owners) > 1:
            out.setdefault(min(owners), set()).update(owners)
    return {k: tuple(sorted(v)) for k, v in out.items()}


class Compiled:
    """A compiled model: the IRs, the runtime and the host-resident training state.

    Attributes:
        graph, costs, plan, program: the compiler's IRs (all printable).
    """

    def __init__(self, model: torch.nn.Module, opts: Options, example: Any, *, dist: Any = False,
                 process_group: Any = None) -> None:
        from rpcompile.runtime.optimizer import HostState
        self._model, self.options, self._example = model, opts, example
        self.graph, self.costs, self.plan, self.program, self.microbatches = plan_pipeline(model, example, opts)
        self._shape = _shape_key(example)
        self.state = HostState.from_graph(self.graph, optimizer=opts.optimizer, dtype=opts.dtype,
                                          pin_memory=opts.backend != "host")  # pinned only where CUDA is
        # data parallel (issue #9): rank 0's weights everywhere; each group's gradient averaged before its step
        self._dist = _data_parallel(self.state, dist, process_group)
        self.rank, self.world_size = (self._dist.rank, self._dist.world) if self._dist else (0, 1)
        self.steps = 0
        self._runtime = self._new_runtime()

    def _new_runtime(self):
        from rpcompile.runtime.executor import Runtime
        rt = Runtime(self.graph, self.program, self.state, backend=self.options.backend,
                     seed=self.options.seed + self.rank, start_iteration=self.steps)  # per-rank dropout
        if self._dist:
            self._dist.attach(rt)  # counts the gradient writes that complete each layer group
        return rt

    def _replan(self, batch: Any) -> None:
        """Re-plan for a batch of a new shape (e.g. a longer sequence), keeping the training state."""
        self._runtime.flush()
        self._runtime.close()
        old = self.plan.to_str()
        self.graph, self.costs, self.plan, self.program, self.microbatches = plan_pipeline(
            self._model, batch, self.options)
        self._shape, self._example = _shape_key(batch), batch
        print(f"rpcompile: batch shape changed to {self._shape}; re-planned {old} -> {self.plan.to_str()}",
              file=sys.stderr)
        self._runtime = self._new_runtime()

    def step(self, batch: Any) -> float:
        """One training iteration (forward, backward, optimizer); returns the mean microbatch loss."""
        check_batch(batch, self.microbatches, like=self.graph)
        if _shape_key(batch) != self._shape:
            self._replan(batch)
        if self._dist:
            self._dist.check()  # a failed data-parallel step cannot be re-run in place
        try:
            loss = self._runtime.step(batch)
        except BaseException as exc:
            if self._dist:
                self._dist.fail(exc)
            raise
        finally:
            self.steps = self._runtime.t  # a failure rolls the run back to the iteration that failed
        return self._dist.average(loss) if self._dist else loss  # data parallel: mean over processes

    def stats(self) -> dict[str, Any]:
        """What the last step cost: host waits, allocations, bytes each way and busy seconds per lane.

        Waits for the step's remaining work first (`flush`), so the numbers are complete.

        Returns:
            {"host_waits": times the host blocked on device work, "issue_waits": times an issuing
            thread blocked on host work, "host_allocations" / "device_allocations": new buffers
            (not pool hits), "bytes_to_device", "bytes_to_host", "busy_s": {lane: seconds}}.

        Example:
            >>> c.step(batch); c.stats()["device_allocations"]   # doctest: +SKIP
            0
        """
        self._runtime.flush()
        return self._runtime.stats()

    @property
    def last_timeline(self) -> list:
        """The measured run of the last step: simulator `Record`s (worker, lane, op, start, end; seconds)."""
        from rpcompile.runtime.simulator import Record
        steps = self.steps - 1
        return [Record(name, name, steps, w, lane, name.split(" ", 1)[1][0], start, end)
                for name, w, lane, start, end in self._runtime.last_timeline]

    def evaluate(self, batch: Any) -> float:
        """Forward only with the weights the next step would read; returns the mean microbatch loss."""
        check_batch(batch, self.microbatches, like=self.graph)
        if _shape_key(batch) != self._shape:
            self._replan(batch)
        loss = self._runtime.evaluate(batch)
        return self._dist.average(loss, "evaluate loss") if self._dist else loss

    def simulate(self, hardware: Hardware | str = "rtx4090", iterations: int = 1, *, example: Any = None):
        """Simulate this program on `hardware`, with layer costs predicted for that hardware.

        Args:
            hardware: a Hardware or preset name ("rtx4090", ...).
            iterations: back-to-back iterations (staleness 1: the steady state needs several).
            example: the batch to cost (default: the one the program was compiled for).
        Returns:
            A Timeline (iteration time, bubble, exposed communication, peak memory per worker).
        """
        from rpcompile import passes
        from rpcompile.runtime import simulate
        hw = Hardware.preset(hardware) if isinstance(hardware, str) else hardware
        costs = passes.estimate_costs(self.graph, self._example if example is None else example, mode="predict",
                                      hardware=hw, microbatches=self.microbatches, progress=False)
        return simulate(self.program, costs, hw, iterations=iterations)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Full training state: weights, masters, optimizer state (incl. a pending update), step, RNG."""
        self._runtime.flush()
        from dataclasses import asdict
        opts = {k: v for k, v in asdict(self.options).items() if k != "loss_fn"}
        opts["optimizer"], opts["hardware"] = self.options.optimizer, self.options.hardware
        return {"format": checkpoint.FORMAT, "steps": self.steps, "plan": self.plan.to_str(),
                "host": self.state.state_dict(), "options": opts, "example": self._example,
                "rng": torch.get_rng_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Resume from `state_dict()`: the next step continues the run bit for bit."""
        checkpoint.check(sd)
        self._runtime.flush()
        self._runtime.close()
        self.state.load_state_dict(sd["host"])
        self.steps = int(sd["steps"])
        torch.set_rng_state(sd["rng"])
        self._runtime = self._new_runtime()

    def save(self, path: str) -> None:
        """Write `state_dict()` atomically (temporary file in the same folder, then rename); data parallel: rank 0 only."""
        if self.rank == 0:  # every rank holds the same state
            checkpoint.save(self.state_dict(), path)

    def model(self) -> torch.nn.Module:
        """The user's module with the current weights (every update applied, a pending one too)."""
        self._runtime.flush()
        masters = self.state.parameters_fp32()
        with torch.no_grad():
            for name, p in self.graph.parameters().items():
                p.copy_(masters[name].to(p.dtype))
        return self._model

    def close(self) -> None:
        """Stop the runtime's threads (and the data-parallel reducer)."""
        self._runtime.close()
        if self._dist:
            self._dist.close()

    def __enter__(self) -> "Compiled":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Compiled({len(self.graph.layers)} layers, plan {self.plan.to_str()}, "
                f"{self.options.gpus} workers, {self.microbatches} microbatches, staleness {self.options.staleness})")


def load(path: str, model: torch.nn.Module, *, loss_fn: Callable | None = None, dist: Any = False,
         process_group: Any = None) -> Compiled:
    """Load a checkpoint written by `Compiled.save` and continue training `model` from it.

    The checkpoint records the compile options and the example batch, so the
    same plan and program are rebuilt; only `loss_fn` (code, not data) must be
    passed again if the run used one.

    Args:
        path: the checkpoint file.
        model: a module of the architecture the checkpoint was trained with (its weights are replaced).
        loss_fn: the run's loss_fn, if any.
        dist, process_group: as for `compile` (every process loads the same file).
    Returns:
        A Compiled whose next `step` continues the saved run bit for bit.
    """
    sd = checkpoint.load(path)
    opts = Options(**{**sd["options"], "loss_fn": loss_fn})
    c = Compiled(model, opts, sd["example"], dist=dist, process_group=process_group)
    c.load_state_dict(sd)
    return c


def _data_parallel(state: Any, dist: Any, process_group: Any) -> Any:
    """A GradReducer over `process_group` (runtime/distributed.py) that has broadcast rank 0's weights; None if off."""
    if not dist and process_group is None:
        return None
    from rpcompile.runtime.distributed import DistConfig, GradReducer, init_group
    cfg = dist if isinstance(dist, DistConfig) else DistConfig()
    reducer = GradReducer(state, init_group(cfg, process_group), cfg)
    reducer.broadcast_state()
    return reducer


def _shape_key(batch: Any) -> tuple:
    """The shapes of a batch's tensors, to notice when a re-plan is needed."""
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape),)
    if isinstance(batch, dict):
        return tuple((k, tuple(v.shape)) for k, v in sorted(batch.items()) if isinstance(v, torch.Tensor))
    return tuple(tuple(v.shape) for v in batch if isinstance(v, torch.Tensor))
