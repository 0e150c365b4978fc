"""Layers run without data: what `trace`, `shard_lm_head` and `estimate_costs` share to run on `meta`.

Not a pass: the helpers the first three passes of the pipeline (trace -> shard_lm_head ->
estimate_costs -> partition -> emit -> verify) have in common, for running a layer on the `meta`
device (shapes and op counts, no weights, no data) and pricing what really runs:

    attention.py  SDPA on `meta` runs (and is priced) as the fused flash kernel
    masks.py      attention-mask creation on `meta`: transformers' data-dependent decisions taken from shapes
    moe.py        mixture-of-experts blocks on `meta`: balanced routing instead of data-dependent dispatch
    regions.py    chunk loops that cost counting folds: one op per loop position, not one per iteration
"""
