"""Running a stage's layers on a worker: what the executor's compute handlers call (DESIGN.md idea 3).

Below the executor (runtime/), above the IR and the passes:

    cuts.py     what crosses a stage's cuts: the values it reads, downloads, and the gradients it sends
    batch.py    a step's batch as microbatches, their trained tokens and weights
    runner.py   `LayerRunner`: a stage's layers forward, recomputed and backward on one worker
    rng.py      per-worker randomness, seeded per (iteration, microbatch, layer)
    routing.py  MoE routing recorded by the forward and replayed by the recompute
    hits.py     evaluation's token accuracy, counted by the loss layer
"""
