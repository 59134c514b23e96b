"""The io backends' measured variants: a name for a backend with options.

bench-io measures each beside a compute-bound forward, bench-overhead times the
cache's calls with one (`--io-variant`), and bench/scripts/io_vs_sglang.py races
them against SGLang's kernels. The plain backend names are their defaults.

The product's backends are `cpu` and `direct` (`hicache_cp.io.base.BUILTIN`).
The SM-kernel engines (`kernel`, `hybrid`) and `staging` are measured here only:
importing this module registers them (`register_bench_backends`), so a benchmark
(and a test of those engines) can build them by name while a user's configuration
cannot. docs/design/copy-engines.md records what each variant measured.
"""

from __future__ import annotations

from typing import Any

from hicache_cp.io.base import backend_names, register_backend

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "hybrid": ("hybrid", {}),
    "kernel": ("kernel", {}),
    "direct": ("direct", {}),
    "staging": ("staging", {}),
    "kernel-l2hint": ("kernel", {"mode": "l2hint"}),
    "kernel-tma": ("kernel", {"mode": "tma"}),
    # SGLang's CTA counts (4 for its TMA kernel, 2 for its register kernel) on our kernels:
    # about 4 and 8 of the H200's 132 SMs.
    "kernel-tma-4sm": ("kernel", {"mode": "tma", "sm_fraction": 0.031}),
    "kernel-tma-8sm": ("kernel", {"mode": "tma", "sm_fraction": 0.061}),
    "direct-inline": ("direct", {"worker_above": None}),
    # The issue worker's driver calls: fewer, larger calls cost the GPU less per
    # descriptor but hold the driver (which serialises a context's calls) longer.
    # `direct` issues every layer in calls of 128 (`io.issue` says why).
    "direct-chunk64": ("direct", {"chunk": 64, "whole": 64}),
    "direct-chunk256": ("direct", {"chunk": 256, "whole": 256}),
    "direct-chunk1024": ("direct", {"chunk": 1024, "whole": 1024}),
    # Backups, which the forward does not wait for, in one call of up to 1024 a layer.
    "direct-backup1024": ("direct", {"whole": 1024, "load_whole": 128}),
    # The layer hook (`submit_layer`): `direct` hands every backup layer to the issue worker
    # (the hook records the compute-ordering event); `-hook16` issues a layer of up to 16
    # descriptors in the hook while the worker is idle (the hook's earlier path).
    "direct-hook16": ("direct", {"hook_worker_above": 16}),
}


def register_bench_backends() -> None:
    """Add `kernel`, `hybrid` and `staging` to the io registry (idempotent)."""
    from hicache_cp.io.dma import StagingCopyEngine
    from hicache_cp.io.sm import HybridCopyEngine, KernelCopyEngine

    known = set(backend_names())
    for name, engine in (("kernel", KernelCopyEngine), ("hybrid", HybridCopyEngine), ("staging", StagingCopyEngine)):
        if name not in known:
            register_backend(name)(engine)


register_bench_backends()
