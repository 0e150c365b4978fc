"""Runtime: workers, transfers, the CPU optimizer and the simulator (no device query at import).

The third layer of the package (ir < passes < runtime < driver < models, finetune < cli): it runs
what the passes emit (`Program` + `CostTable`), and imports only the IR and the passes.

The executor's parts, here:

    executor.py          `Runtime`: the interpreter, a Program issued onto worker streams (one handler per Op)
    reports.py           what a Runtime reports: per-iteration counters, the last step's timeline, peaks
    issuer.py            one issuing thread per worker, walking its instructions in program order
    handlers.py          the issue handlers, one per Op: their tables, transfers (P, U, D, G), release (E)
    compute_handlers.py  the compute handlers (F, X, R, B), a mixin of the issue handlers
    board.py             which instruction instances were issued, and what they left for consumers
    iterations.py        the iterations in flight and what their callers collect
    host_lanes.py        the host's lanes: gradient accumulation, optimizer steps and copies
    program_info.py      what the runtime derives once from a Program
    recovery.py          failure recovery: drain every thread, undo a failed iteration
    transfer.py          the runtime's threads, failures, test delays and extra dependencies
    distributed.py       data parallelism across processes (per-layer gradient all-reduce on the host)

and five folders:

    streams/  the stream and device layer: host and CUDA streams, launching, workers, buffer pool, stats
    host/     the host state (weights, gradients, optimizer state) and the CPU optimizer
    sim/      the simulator, its Timeline, its event core, the bound-stage baselines and Gantt charts
    sharded/  sharded host state across data-parallel servers: reduce-scatter, statistics, all-gather lanes
    stage/    running a stage's layers on a worker: cuts, microbatches, the layer runner, randomness,
              MoE routing replay, evaluation's token hits
"""
from rpcompile.runtime.sim.simulator import Timeline, simulate, steady_iterations
from rpcompile.runtime.executor import Runtime, RuntimeFailure, run

__all__ = ["Timeline", "simulate", "steady_iterations", "Runtime", "RuntimeFailure", "run"]
