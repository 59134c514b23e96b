"""CP agreement on numbers a real machine has (issue 48, item 6), over real gloo ranks.

* `DistributedAgreement.min_int` returns values above 2**31 exactly (a host budget
  of tens of GiB is one);
* `host_budget = "auto"` under CP, with ranks that measure different memory, gives
  every rank the smallest budget (the pools of all ranks agree on their pages).
"""

from __future__ import annotations

from typing import Any

from hicache_harness.launch import RankContext, spawn_ranks

TIMEOUT_S = 60.0
GIB = 1 << 30


def _min_of_large_values(ctx: RankContext) -> list[int]:
    big = [5 * (1 << 32) + 3 - ctx.rank, 60 * GIB + 4096 * ctx.rank, (1 << 62) + 1 - ctx.rank]
    return [ctx.agreement.min_int(v) for v in big]


def test_min_int_over_gloo_is_exact_above_2_31() -> None:
    results = spawn_ranks(_min_of_large_values, 2, timeout_s=TIMEOUT_S)
    want = [5 * (1 << 32) + 2, 60 * GIB, (1 << 62)]
    assert results == [want, want]


def _auto_budget(ctx: RankContext) -> dict[str, Any]:
    """A rank whose machine shows `8 - 2 * rank` MiB free builds a cache with
    host_budget_bytes = "auto" (the reading is the test's; the pools are real)."""
    import hicache_cp.cache.build as build
    from hicache_cp.cache import HiCache
    from hicache_cp.config import Config
    from hostmem.sizing import HostMemory, MemorySource

    free = (8 - 2 * ctx.rank) << 20
    reading = HostMemory(MemorySource.MEMINFO, 64 << 20, free, 0, 64 << 20, free)
    build.host_memory = lambda *a, **k: reading  # this rank's process only
    config = Config(model="tiny", page_size=16, l1_pages=17, host_budget_bytes="auto", host_reserve_bytes=0,
                    io_backend="cpu", pin_host=False, cp_size=2)  # fmt: skip
    with HiCache(config, agreement=ctx.agreement, rank=ctx.rank) as cache:
        return {"budget": build.host_budget(config, ctx.agreement, ctx.rank),
                "physical_pages": cache.host_pool.physical_pages}  # fmt: skip


def test_auto_budget_under_cp_is_the_smallest_ranks() -> None:
    """Rank 0 sees 8 MiB, rank 1 6 MiB, two ranks on the machine: both get 3 MiB."""
    results = spawn_ranks(_auto_budget, 2, timeout_s=TIMEOUT_S)
    assert [r["budget"] for r in results] == [3 << 20, 3 << 20]
    assert results[0]["physical_pages"] == results[1]["physical_pages"]
