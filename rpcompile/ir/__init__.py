"""The IR: plain data that every pass and the runtime share, with its printers, parsers and checkers.

Layer 1 of 5 (DESIGN.md section 2): these modules import nothing of the
project's but each other, and nothing here runs a pass or touches a device.

    graph.py       LayerGraph, Layer, Value: the traced model as layers and the values between them
    costs.py       CostTable: seconds and bytes per layer per microbatch
    plan.py        StagePlan, Stage, PlanReport: forward | fused | backward stage groupings
    program.py     Op, Instr, Chunk, Program: the static round-robin schedule (`2F0`-style text form)
    program_io.py  a Program as a grid, CSV and Chrome trace
    hardware.py    Hardware: device, link and host numbers (presets and a measured CPU)
    hardware_presets.py  the presets' spec-sheet numbers, each with its source; torch's BLAS workspace
    optim.py       AdamW, SGD: optimizer configs (the update itself is runtime/host/optimizer.py)
    cache.py       where the kernels rpcompile builds on the user's machine are kept (planner, host optimizer)
"""
