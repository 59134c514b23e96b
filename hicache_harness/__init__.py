"""The harness: what drives and measures the cache library (`hicache_cp`, `hostmem`),
never imported by it; a package of its own, shipped in the same distribution. Its
command line is `hicache-cp` (also `python -m hicache_harness`).

    engines/      prefill engines that drive `HiCache` (the synthetic reference server)
    replay/       `hicache-cp replay`: traces through an engine, per rank or on CP ranks
    bench/        benchmarks: bench-alloc, bench-io, bench-pd
    trace, workload     Mooncake-format traces and the embedded workload
    integrity     deterministic KV content, so every reader can check what it got
    bounds        offline hit-rate bounds (infinite capacity, Belady)
    decode_peer   a decode-side PD peer that receives and verifies KV
    pd_replay     the decode peer process and the per-rank sink of `replay --pd`
    launch        run a function on N rank processes (torch.distributed)
    torchrun      the replay under torchrun
    plot, provenance, cli
"""
