#!/usr/bin/env python
"""Time to a usable pinned host pool: HostArena versus cudaHostAlloc.

Measures, in one run on one GPU host:

1. ``arena_s``: ``HostArena(--gib)`` (parallel first touch + chunked
   ``cudaHostRegister``) until ``wait_ready()`` covers the whole arena.
2. ``cuda_host_alloc_s``: ``cudaHostAlloc`` of the same size.
3. D2H / H2D bandwidth of one ``--copy-gib`` copy to and from each pool with
   ``torch`` ``copy_(..., non_blocking=True)``, plus a pageable baseline.
   The arena is registered per chunk, so its copy is issued as one
   ``copy_`` per registration chunk (how the pool is used: pages never
   straddle a chunk); a single copy across chunks is measured too.

The two pools are alive one after the other, never together, so the peak
host footprint is one pool plus the pageable buffer. Everything is freed at
the end. Without CUDA it exits with status 1 and one line on stderr.

Usage: python tools/bench_pinning.py [--gib 64] [--copy-gib 4]
       [--json bench/results/pinning-h200.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hostmem import cuda  # noqa: E402
from hicache_cp.harness.provenance import git_commit  # noqa: E402
from hostmem.arena import HostArena  # noqa: E402

logger = logging.getLogger("bench_pinning")

GIB = 1 << 30
REPEATS = 3


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2)


def _timed_copies(copies: Callable[[], None]) -> float:
    """Best wall time of ``REPEATS`` runs of ``copies`` (after one warm-up), synchronised."""
    copies()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        copies()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _bandwidth(host_parts: list[torch.Tensor], dev: torch.Tensor) -> dict[str, float]:
    """D2H and H2D GB/s between ``dev`` and host tensors laid end to end."""
    nbytes = sum(p.numel() for p in host_parts)
    dev_parts = list(torch.split(dev[:nbytes], [p.numel() for p in host_parts]))

    def d2h() -> None:
        for h, d in zip(host_parts, dev_parts):
            h.copy_(d, non_blocking=True)

    def h2d() -> None:
        for h, d in zip(host_parts, dev_parts):
            d.copy_(h, non_blocking=True)

    return {"d2h_gbps": _gbps(nbytes, _timed_copies(d2h)), "h2d_gbps": _gbps(nbytes, _timed_copies(h2d))}


def _measure(results: dict[str, Any], key: str, fn: Callable[[], Any]) -> None:
    """Store ``fn()`` in ``results["bandwidth"][key]`` (unless None).

    On failure, log the traceback, record the error in ``results["errors"]``
    and carry on: one failed measurement must not lose the others.
    """
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - the one boundary of each measurement
        logger.exception("%s failed", key)
        results.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"
        return
    if value is not None:
        results["bandwidth"][key] = value


def _bench_arena(args: argparse.Namespace, dev: torch.Tensor, results: dict[str, Any]) -> None:
    """HostArena: parallel touch + chunked register until fully ready, then copies."""
    nbytes, copy_bytes, chunk = int(args.gib * GIB), dev.numel(), int(args.chunk_gib * GIB)
    t0 = time.perf_counter()
    arena = HostArena(
        nbytes, pin=True, touch_threads=args.touch_threads, register_chunk_bytes=chunk, name="bench"
    )
    try:
        arena.wait_ready()
        results["arena_s"] = round(time.perf_counter() - t0, 3)
        print(f"HostArena {args.gib:g} GiB ready in {results['arena_s']:.2f} s", flush=True)
        parts = [arena.torch(off, min(chunk, copy_bytes - off)) for off in range(0, copy_bytes, chunk)]
        _measure(results, "arena", lambda: _bandwidth(parts, dev))
        _measure(results, "arena_single_copy", lambda: _bandwidth([arena.torch(0, copy_bytes)], dev))
        del parts
    finally:
        arena.close()


def _bench_host_alloc(args: argparse.Namespace, dev: torch.Tensor, results: dict[str, Any]) -> None:
    """cudaHostAlloc of the same size, then copies through a ctypes/numpy view."""
    nbytes, copy_bytes = int(args.gib * GIB), dev.numel()
    t0 = time.perf_counter()
    ptr = cuda.host_alloc(nbytes)
    try:
        results["cuda_host_alloc_s"] = round(time.perf_counter() - t0, 3)
        print(f"cudaHostAlloc {args.gib:g} GiB in {results['cuda_host_alloc_s']:.2f} s", flush=True)
        view = torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * copy_bytes).from_address(ptr)))
        _measure(results, "cuda_host_alloc", lambda: _bandwidth([view], dev))
        del view
    finally:
        cuda.free_host(ptr)


def _bench_pageable(dev: torch.Tensor, results: dict[str, Any]) -> None:
    """Pageable (ordinary, touched) host memory baseline."""
    pageable = torch.ones(dev.numel(), dtype=torch.uint8)
    _measure(results, "pageable", lambda: _bandwidth([pageable], dev))


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every phase; a failing phase is recorded under "errors", the rest still run.

    The pools live one after the other (peak host memory: one pool + one copy buffer).
    """
    results: dict[str, Any] = {
        "gib": args.gib,
        "copy_gib": min(args.copy_gib, args.gib),
        "touch_threads": args.touch_threads,
        "register_chunk_gib": args.chunk_gib,
        "bandwidth": {},
    }
    torch.cuda.init()
    dev = torch.empty(int(min(args.copy_gib, args.gib) * GIB), dtype=torch.uint8, device="cuda")
    dev.fill_(7)
    torch.cuda.synchronize()  # context and device buffer exist before any timing
    _measure(results, "arena_phase", lambda: _bench_arena(args, dev, results))
    _measure(results, "cuda_host_alloc_phase", lambda: _bench_host_alloc(args, dev, results))
    _measure(results, "pageable_phase", lambda: _bench_pageable(dev, results))
    if "arena_s" in results and "cuda_host_alloc_s" in results:
        results["speedup"] = round(results["cuda_host_alloc_s"] / results["arena_s"], 2)
    return results


def _print_table(r: dict[str, Any]) -> None:
    print(f"\n{'pool':<20}{'ready s':>10}{'D2H GB/s':>11}{'H2D GB/s':>11}")
    ready = {"arena": r.get("arena_s"), "cuda_host_alloc": r.get("cuda_host_alloc_s")}
    for name, b in r["bandwidth"].items():
        s = ready.get(name)
        ready_s = f"{s:.2f}" if s is not None else "-"
        print(f"{name:<20}{ready_s:>10}{b['d2h_gbps']:>11.2f}{b['h2d_gbps']:>11.2f}")
    if "speedup" in r:
        print(f"time to usable pinned pool: HostArena is {r['speedup']}x faster than cudaHostAlloc")
    for key, err in r.get("errors", {}).items():
        print(f"error in {key}: {err}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=64.0, help="pool size in GiB (default 64)")
    parser.add_argument(
        "--copy-gib", type=float, default=4.0, help="bytes per bandwidth copy, GiB (default 4)"
    )
    parser.add_argument("--chunk-gib", type=float, default=1.0, help="arena register chunk, GiB (default 1)")
    parser.add_argument("--touch-threads", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--json", type=Path, default=Path("bench/results/pinning-h200.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.gib <= 0 or args.copy_gib <= 0 or args.chunk_gib <= 0 or args.touch_threads <= 0:
        print(
            "bench_pinning: error: --gib, --copy-gib, --chunk-gib and --touch-threads must be positive",
            file=sys.stderr,
        )
        return 2
    if not (cuda.cuda_available() and torch.cuda.is_available()):
        print(
            "bench_pinning: CUDA is not available on this machine; this benchmark needs a GPU. "
            "Nothing measured.",
            file=sys.stderr,
        )
        return 1
    try:
        results = bench(args)
    except Exception as exc:  # noqa: BLE001 - still write what we know
        logger.exception("benchmark setup failed")
        results = {"gib": args.gib, "bandwidth": {}, "errors": {"setup": f"{type(exc).__name__}: {exc}"}}
    results.update(
        commit=git_commit(),
        machine=(
            f"{torch.cuda.get_device_name()}; {platform.node()}; {os.cpu_count()} cpus; "
            f"torch {torch.__version__}"
        ),
        command=list(sys.argv),
    )
    _print_table(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0 if "errors" not in results else 1


if __name__ == "__main__":
    sys.exit(main())
