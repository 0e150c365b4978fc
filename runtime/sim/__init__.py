"""The simulator: a Program's run on hardware you may not have, priced from a CostTable.

Beside the executor (runtime/): the same Program, run as discrete events instead of on workers.

    simulator.py  `simulate(program, costs, hardware) -> Timeline`: the run, its cost and memory model
    timeline.py   the `Timeline` it returns, its `Record`s and views (summary, chrome trace, plot)
    events.py     its core: an event-driven list scheduler over FIFO lanes and shared channels
    baselines.py  bound-stage pipelines as Programs: GPipe, 1F1B, interleaved 1F1B, looped BFS
    gantt.py      Gantt charts of measured or simulated runs (matplotlib, imported only when drawing)
"""
