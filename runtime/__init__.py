"""Runtime: workers, transfers, the CPU optimizer and the simulator."""
from rpcompile.runtime.simulator import Timeline, simulate  # pure Python: no device query at import

__all__ = ["Timeline", "simulate"]
from rpcompile.runtime.executor import Runtime, RuntimeFailure, run  # noqa: E402  (torch only; no device query)
