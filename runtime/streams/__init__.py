"""The stream and device layer of the runtime: one execution model for CUDA and host workers (DESIGN.md 3a).

Below the executor (runtime/), above the IR; nothing here knows the schedule's rules.

    host.py     streams and events on host threads (one in-order executor thread per stream)
    cuda.py     `torch.cuda.Stream` and events, driven by `LaunchStream`
    launch.py   the issuing side of a GPU stream: launch from the calling thread, never block it on host work
    devices.py  workers: a device, its five streams, its buffer pool and its byte accounting
    pool.py     a stream-aware buffer pool: a buffer returns only after every stream that used it
    values.py   the values handed from one stream item to later ones
    stats.py    per-iteration counters: host waits, allocations, PCIe bytes, lane busy time
"""
