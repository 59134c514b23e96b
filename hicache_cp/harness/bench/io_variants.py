"""The io backends' measured variants: a name for a backend with options.

bench-io measures each beside a compute-bound forward, bench-overhead times the
cache's calls with one (`--io-variant`), and bench/scripts/io_vs_sglang.py races them
against SGLang's kernels. The plain backend names are their defaults.
"""

from __future__ import annotations

from typing import Any

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
    "direct-given": ("direct", {"order": "given"}),
    "direct-overlap-hint": ("direct", {"overlap_hint": True}),
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
    # (the hook records the compute-ordering event). `-hook16` issues a layer of up to 16
    # descriptors in the hook while the worker is idle (four driver calls there; the default
    # before 3524bee); `-worker-order` has the worker record that event as
    # well, so the hook makes no driver call.
    "direct-hook16": ("direct", {"hook_worker_above": 16}),
    "direct-worker-order": ("direct", {"hook_order": "worker"}),
}
