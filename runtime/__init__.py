"""Runtime: workers, transfers, the CPU optimizer and the simulator (no device query at import)."""
from rpcompile.runtime.simulator import Timeline, simulate
from rpcompile.runtime.executor import Runtime, RuntimeFailure, run

__all__ = ["Timeline", "simulate", "Runtime", "RuntimeFailure", "run"]
