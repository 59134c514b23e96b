"""Benchmarks (`hicache-cp bench-*`): each prints a table and writes JSON with
the commit, the machine and the command (`hicache_harness.provenance`).

    alloc   host page allocator on a fragmented pool (bench-alloc)
    io      copy engines against the PCIe peak (bench-io, GPU)
    pd      the PD adapter against raw TransferEngine writes (bench-pd)
    pinning time to a usable pinned host pool against cudaHostAlloc (bench-pinning)
    overhead host time of the cache's own calls per request on a trace (bench-overhead)
    l3      the L3 tier's puts and gets against raw Mooncake Store calls (bench-l3)
"""
