"""The node tier on a GPU: two rank processes on one GPU map and register one segment, back up
and load through it, and a restarted pair adopts it; every byte of every reused page checked
on the GPU, by the harness's oracle and by the library's restore checks against the segment's
shared checksum table, and a flipped bit in one rank's slice is caught by the other's load
(skipped without CUDA; bench/device/node.sh runs these).

The ranks agree over gloo (NCCL wants one GPU per rank); their L1 pools, copy engines (the
default `direct` DMA engine) and byte checks are on cuda:0, their L2 is the pinned segment.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from hicache_cp.cache import HiCache
from hicache_harness.engines.synthetic import ReferenceServer
from hicache_harness.launch import RankContext, spawn_ranks
from hicache_harness.trace import request_tokens
from hicache_harness.workload import default_workload
from hostmem.cuda import cuda_available, host_get_flags
from hostmem.segment import find_segment

from conftest import PAGE, tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CUDA")]
REQUESTS = default_workload(seed=21)[:80]



def _rank(ctx: RankContext, name: str, lo: int, hi: int, drop: bool) -> dict[str, Any]:
    """Serve requests [lo, hi) on cuda:0 over the node segment; report what was checked."""
    config = tiny_config(host_pages=400, l1_pages=96, node_segment=name, node_drop_on_close=drop,
                         io_backend="auto", pin_host=True)  # fmt: skip
    cache = HiCache(config, agreement=ctx.agreement, device="cuda:0")
    try:
        pool = cache.host_pool
        assert pool.pinned and pool.shared and cache.engine.name == "direct", (pool.pinned, cache.engine.name)
        for arena in pool.arenas.values():  # registered in this process; device address = host address (UVA)
            assert host_get_flags(arena.ptr) and arena.device_ptr(0) == arena.ptr
        server = ReferenceServer(cache)
        for r in REQUESTS[lo:hi]:
            server.serve(r.index, request_tokens(r, PAGE))
        cache.drain()
        cache.check_invariants()
        torch.cuda.synchronize()
        s = cache.stats()
        cache.agreement.min_int(0)  # neither rank unmaps before both finished
        t = server.integrity
        return {"checked": t.checked_units, "expected": t.expected_units, "mismatches": t.mismatches,
                "examples": [str(m) for m in t.examples[:5]], "l2_hit_tokens": s["l2_hit_tokens"],
                "hit_rate": s["hit_rate"], "bytes_d2h": s["bytes_d2h"], "bytes_h2d": s["bytes_h2d"],
                "adopted": s["node_adopted"], "adopted_pages": s["node_adopted_pages"],
                "verified": s["node_verified_pages"], "verify_failures": s["node_verify_failures"],
                "lib_checked": s["verified_units"], "lib_failures": s["verify_failures"]}  # fmt: skip
    finally:
        cache.close()


def test_two_processes_on_one_gpu_back_up_and_load_through_one_registered_segment(seg_name: str) -> None:
    first = spawn_ranks(_rank, 2, (seg_name, 0, 40, False), timeout_s=600, backend="gloo")
    for r in first:
        assert r["mismatches"] == 0 and r["checked"] == r["expected"] > 0, r["examples"]
        assert r["l2_hit_tokens"] > 0 and r["bytes_h2d"] > 0  # loads read the shared copy
        assert r["lib_checked"] > 0 and r["lib_failures"] == 0  # the GPU checks, against the shared table
    assert first[0]["hit_rate"] == first[1]["hit_rate"]
    total = sum(r["bytes_d2h"] for r in first)
    assert all(0.25 * total <= r["bytes_d2h"] <= 0.75 * total for r in first)  # each rank wrote its share
    again = spawn_ranks(_rank, 2, (seg_name, 40, 80, True), timeout_s=600, backend="gloo")
    for r in again:
        assert r["adopted"] and r["adopted_pages"] > 0 and r["verified"] > 0 and r["verify_failures"] == 0
        assert r["lib_checked"] > 0 and r["lib_failures"] == 0
        assert r["mismatches"] == 0 and r["checked"] == r["expected"] > 0, r["examples"]
    assert find_segment(seg_name) is None


def test_a_flip_in_another_ranks_slice_is_caught_by_the_gpu_checks_and_dropped_everywhere(seg_name: str) -> None:
    """tests/test_node_checks.py's two-rank story with L1 and the checksum kernel on cuda:0:
    rank 1's slice's checksums, written by its kernel into the pinned shared table, catch a
    bit flipped in its page when rank 0 loads it."""
    from test_node_checks import check_flip_in_another_ranks_slice

    check_flip_in_another_ranks_slice(seg_name, "cuda:0")


def test_a_segment_region_registers_and_copies_both_ways_byte_exact(seg_name: str) -> None:
    """One process: a pinned arena over a region of the segment, DMA from and to the GPU."""
    from hostmem.arena import HostArena
    from hostmem.segment import Segment

    seg = Segment.open_mapped(seg_name, 64 << 20)
    try:
        with HostArena(32 << 20, memory=seg.region(32 << 20, 32 << 20), register_chunk_bytes=8 << 20,
                       background=False, name="seg") as arena:  # fmt: skip
            assert arena.pinned and host_get_flags(arena.ptr)
            src = torch.randint(0, 256, (32 << 20,), dtype=torch.uint8, device="cuda")
            host = arena.torch()
            for lo in range(0, 32 << 20, 8 << 20):  # one copy per registration chunk
                host[lo : lo + (8 << 20)].copy_(src[lo : lo + (8 << 20)], non_blocking=True)
            torch.cuda.synchronize()
            back = torch.empty_like(src)
            for lo in range(0, 32 << 20, 8 << 20):
                back[lo : lo + (8 << 20)].copy_(host[lo : lo + (8 << 20)], non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(back, src)
            assert np.array_equal(np.frombuffer(seg.mm, np.uint8, 16, 32 << 20), src[:16].cpu().numpy())  # type: ignore[arg-type]
            del host
    finally:
        seg.close(unlink_if_last=True)
