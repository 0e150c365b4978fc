"""Runtime: workers, transfers, the CPU optimizer and the simulator."""
