"""Host-resident model state and the CPU optimizer (DESIGN.md ideas 1, 6, 7).

The home of every weight, gradient and optimizer state: the executor (runtime/) uploads from it,
downloads gradients into it and steps it; the driver saves and loads it.

    optimizer.py  `HostState`: compute copies, fp32 masters, gradients, moments; the optimizer worker
    grad_stats.py its gradient statistics: gradients landing, norms and clipping, loss scale, the barrier
    state_io.py   its snapshots: fp32 weights, and a state_dict that resumes a run bit for bit
    layout.py     flat memory layouts: host blocks per layer group, device slots per stage, chunk copies, and the
                  alternating copies of staleness 1
    pinned.py     pinned host memory at its exact size (cudaHostRegister): compute copies, transfer buffers
    buffers.py    the runtime's transfer buffers (gradient staging, host pool) counted before a run
    staging.py    gradient staging: a ring of K buffers shared by every stage, one accumulation unit at a time
    flat.py       each layer group's masters, gradients and moments as flat fp32 buffers, parameters as views
    kernels.py    the memory-speed optimizer passes (kernels.cpp and its kernels_*.h, built once per machine with
                  torch.utils.cpp_extension): statistics while a gradient lands, one update pass per group
    assign.py     the buffer assignment: the download buffers' live ranges packed into one arena (assign.c)
    shard_comm.py sharded state's collectives over gloo: reduce-scatter (rank-order sums), all-gather, wire
                  bytes (runtime/sharded/ runs them for `shard_state`)
"""
