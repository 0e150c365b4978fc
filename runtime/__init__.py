"""Runtime: workers, transfers, the CPU optimizer and the simulator (no device query at import)."""
from rpcompile.runtime.simulator import Timeline, simulate, steady_iterations
from rpcompile.runtime.executor import Runtime, RuntimeFailure, run

__all__ = ["Timeline", "simulate", "steady_iterations", "Runtime", "RuntimeFailure", "run"]
