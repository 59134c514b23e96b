"""Benchmarks (`hicache-cp bench-*`): each prints a table and writes JSON with
the commit, the machine and the command (`hicache_cp.harness.provenance`).

    alloc   host page allocator on a fragmented pool (bench-alloc)
    io      copy engines against the PCIe peak (bench-io, GPU)
    pd      the PD adapter against raw TransferEngine writes (bench-pd)
"""
