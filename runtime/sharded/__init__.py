"""Sharded host state across data-parallel servers (`compile(..., dist=True, shard_state=True)`).

Each of W processes keeps 1/W of every layer group's masters and optimizer moments
(`runtime.host.flat.FlatGroups` with `shard=`); this package runs the collectives that make W
processes train like one:

    reducer.py  `ShardedReducer`: the network lanes: reduce-scatter of each group's gradient once it
                is complete, the iteration's gradient statistics (global norm, non-finite) summed over
                the ranks, all-gather of each group's updated compute copies, waited for only by the
                uploads that read them
"""
from rpcompile.runtime.sharded.reducer import ShardedReducer, shard_of, sharded_data_parallel

__all__ = ["ShardedReducer", "sharded_data_parallel", "shard_of"]
