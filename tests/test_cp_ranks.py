"""CP shared KV across real rank processes (gloo on CPU).

Every test spawns real ranks through `hicache_harness.launch.spawn_ranks`: each
rank runs a module-level worker of this file (spawn pickles it by name) with
a real `DistributedAgreement`, and sends back what it saw; the test compares
the ranks. Every wait has a deadline (spawn_ranks' timeout_s).

Rank-uniformity is the property under test (docs/invariants.md rule 7): a copy that
fails or lags on one rank only must change every rank's cache state at the
same poll, and random request streams with failures on random ranks must
leave every rank with the same tree and allocator state after every step.
"""

from __future__ import annotations

import argparse
import hashlib
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from hicache_harness.replay import command as replay
from hicache_cp.cache import HiCache
from hicache_cp.config import Config
from hicache_cp.io.base import Direction
from hicache_harness.launch import RankContext, RankFailed, spawn_ranks
from hicache_harness.replay.multirank import combine_reports
from hicache_cp.layout import Model, Part
from hicache_cp.radix import Node
from hicache_harness.engines.synthetic import ReferenceServer

PAGE = 16  # tokens per page of the tiny preset
TIMEOUT_S = 60.0


def _config(cp_size: int, *, l1_pages: int = 16, host_pages: int = 16) -> Config:
    """Tiny preset; `l1_pages` and `host_pages` are physical pages per rank (dummy excluded)."""
    layout = Config(model="tiny", page_size=PAGE).layout()
    return Config(
        model="tiny",
        page_size=PAGE,
        l1_pages=l1_pages + 1,
        host_budget_bytes=(host_pages + 1) * layout.bytes_per_page,
        l1_free_room=0,
        l2_free_room=0,
        debug_checks=True,
        io_backend="cpu",
        pin_host=False,
        cp_size=cp_size,
    )


def _tokens(*page_ids: int) -> np.ndarray:
    return np.concatenate([np.full(PAGE, i, dtype=np.int64) for i in page_ids])


def _cache(ctx: RankContext, **cfg: Any) -> HiCache:
    return HiCache(_config(ctx.world_size, **cfg), rank=ctx.rank, agreement=ctx.agreement)


def _forward_and_insert(cache: HiCache, tokens: np.ndarray) -> tuple[Any, Node]:
    """match, alloc, reserve, every layer hook, insert; no poll. Returns (backup, node)."""
    m = cache.match_prefix(tokens)
    assert cache.load_back(m) is None
    new = cache.alloc_device(len(tokens) // PAGE - m.matched_pages, m.matched_pages)
    assert new is not None
    bk = cache.reserve_backup(new, m.matched_pages)
    assert bk is not None
    for model in (Model.TARGET, Model.DRAFT):
        for layer in range(cache.layout.num_layers(model)):
            cache.on_layer_end(model, layer, [bk])
    return bk, cache.insert(m, new, backup=bk)


def _allocator_state(cache: HiCache) -> dict[str, Any]:
    return {
        "l1_lane_free": cache.device_pool.allocator.lane_free_pages(),
        "l2_lane_free": cache.host_pool.allocator.lane_free_pages(),
        "l2_used": cache.host_pool.allocator.used_pages,
    }


def _tree(cache: HiCache) -> list[tuple[Any, ...]]:
    """Rank-independent serialisation: structure, page ids, host state, locks, ops."""
    out: list[tuple[Any, ...]] = []

    def walk(node: Node, depth: int) -> None:
        for key in sorted(node.children):
            c = node.children[key]
            out.append((
                depth, c.head().hex()[:16], c.first_position, c.num_pages,
                None if c.device_pages is None else tuple(int(x) for x in c.device_pages),
                None if c.host_pages is None else tuple(int(x) for x in c.host_pages),
                c.host_state.value, tuple(sorted(p.value for p in c.host_parts)), c.lock_ref, c.hit_count,
                None if c.backup is None else c.backup.state.value,  # type: ignore[attr-defined]
                None if c.load is None else c.load.state.value,  # type: ignore[attr-defined]
            ))  # fmt: skip
            walk(c, depth + 1)

    walk(cache.tree.root, 0)
    return out


def _op_states(cache: HiCache) -> list[str]:
    backups, loads = cache.in_flight()
    return [op.state.value for op in [*backups, *loads]]


class _Fault:
    """Fault hook for one rank: fail or delay copies as armed (thread-safe)."""

    def __init__(self) -> None:
        self.fail_next: dict[Direction, int] = {Direction.D2H: 0, Direction.H2D: 0}
        self.fail_on: set[tuple[Direction, Part, int]] = set()
        self.delay_s = 0.0
        self._lock = threading.Lock()

    def __call__(self, direction: Direction, part: Part, layer: int) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        with self._lock:
            if (direction, part, layer) in self.fail_on or self.fail_next[direction] > 0:
                self.fail_next[direction] = max(0, self.fail_next[direction] - 1)
                raise RuntimeError(f"injected failure: {direction.value} {part.value} layer {layer}")


# ---- workers (module level: spawn pickles them by name) -------------------------------------


def _failing_copy_worker(ctx: RankContext, fail_rank: int) -> dict[str, Any]:
    """One backup whose target-KV layer-1 copy fails on `fail_rank` only."""
    cache = _cache(ctx)
    fault = _Fault()
    if ctx.rank == fail_rank:
        fault.fail_on.add((Direction.D2H, Part.TARGET_KV, 1))
    cache.engine.fault = fault  # type: ignore[attr-defined]
    try:
        bk, node = _forward_and_insert(cache, _tokens(1, 2, 3, 4, 5, 6))
        during = _allocator_state(cache)
        polls: list[tuple[str, str, dict[str, Any]]] = []
        while bk.active and len(polls) < 10_000:
            time.sleep(0.002)
            cache.poll()
            polls.append((bk.state.value, node.host_state.value, _allocator_state(cache)))
            cache.check_invariants()
        cache.release(node)
        cache.check_invariants()
        m = cache.match_prefix(_tokens(1, 2, 3, 4, 5, 6))
        host_hit = m.host_len
        cache.release(m.last_node)
        return {"during": during, "polls": polls, "final": _allocator_state(cache), "tree": _tree(cache),
                "host_hit": host_hit, "collectives": ctx.agreement.collectives}  # fmt: skip
    finally:
        cache.engine.fault = None  # type: ignore[attr-defined]
        cache.close()


def _slow_copy_worker(ctx: RankContext, slow_rank: int, delay_s: float) -> dict[str, Any]:
    """One backup whose copies are slow on `slow_rank` only; poll until it commits."""
    cache = _cache(ctx)
    fault = _Fault()
    if ctx.rank == slow_rank:
        fault.delay_s = delay_s
    cache.engine.fault = fault  # type: ignore[attr-defined]
    try:
        bk, node = _forward_and_insert(cache, _tokens(7, 8, 9, 10))
        polls: list[tuple[str, str, list[str]]] = []
        while bk.active and len(polls) < 10_000:
            time.sleep(0.005)
            cache.poll()
            polls.append((bk.state.value, node.host_state.value, _op_states(cache)))
            cache.check_invariants()
        cache.release(node)
        return {"polls": polls, "tree": _tree(cache), "alloc": _allocator_state(cache)}
    finally:
        cache.engine.fault = None  # type: ignore[attr-defined]
        cache.close()


def _random_ops_worker(ctx: RankContext, seed: int, steps: int) -> dict[str, Any]:
    """Seeded random requests and polls, copy failures armed on random ranks.

    The rng is identical on every rank (same seed, same draws), so every rank
    makes the same calls; only the armed failures are rank-local.
    """
    rng = np.random.default_rng(seed)
    cache = _cache(ctx, l1_pages=10, host_pages=8)
    fault = _Fault()
    cache.engine.fault = fault  # type: ignore[attr-defined]
    server = ReferenceServer(cache, verify=True)
    prefixes = [(1, 2, 3), (1, 2, 4), (5, 6), (7,)]
    digests: list[str] = []
    try:
        for _ in range(steps):
            action = rng.random()
            fail_rank = int(rng.integers(ctx.world_size))
            direction = Direction.D2H if rng.random() < 0.6 else Direction.H2D
            if action < 0.25 and ctx.rank == fail_rank:
                fault.fail_next[direction] += 1
            if action < 0.9:
                prefix = prefixes[int(rng.integers(len(prefixes)))]
                suffix = tuple(int(x) for x in rng.integers(10, 16, size=int(rng.integers(0, 4))))
                server.serve(len(digests), _tokens(*prefix, *suffix))
            else:
                cache.poll()
            cache.check_invariants()
            state = (_tree(cache), _allocator_state(cache), _op_states(cache))
            digests.append(hashlib.sha256(repr(state).encode()).hexdigest())
        cache.drain()
        cache.check_invariants()
        stats = cache.stats()
        return {
            "digests": digests,
            "final": (_tree(cache), _allocator_state(cache)),
            "mismatches": server.integrity.mismatches,
            "checked": server.integrity.checked_pages,
            "aborted": (stats["backups_aborted"], stats["loads_aborted"]),
        }
    finally:
        cache.engine.fault = None  # type: ignore[attr-defined]
        cache.close()


def _raise_on_rank_worker(ctx: RankContext, bad_rank: int) -> None:
    import torch
    import torch.distributed as dist

    if ctx.rank == bad_rank:
        raise RuntimeError(f"boom on rank {ctx.rank}")
    dist.all_reduce(torch.zeros(1))  # would wait for the dead rank forever without the launcher


# ---- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size,fail_rank", [(2, 1), (3, 2)])
def test_copy_failing_on_one_rank_aborts_on_every_rank_at_the_same_poll(world_size: int, fail_rank: int) -> None:
    results = spawn_ranks(_failing_copy_worker, world_size, (fail_rank,), timeout_s=TIMEOUT_S)
    r0 = results[0]
    # While in flight, every rank held the same 6-page reservation (its own lane's share).
    assert r0["during"]["l2_used"] == 6
    for r, res in enumerate(results):
        # Same state after every poll: same number of polls, abort at the same one.
        assert res["polls"] == r0["polls"], f"rank {r} diverged from rank 0"
        assert res["polls"][-1][0] == "aborted" and res["polls"][-1][1] == "none"
        assert not any(state == "committed" for state, _, _ in res["polls"])
        # The reservation was released on every rank, and no host hit remains.
        assert res["final"]["l2_used"] == 0
        assert res["final"]["l2_lane_free"] == [16] * world_size
        assert res["host_hit"] == 0
        assert res["tree"] == r0["tree"]
        assert res["collectives"] == r0["collectives"]


def test_slow_copy_on_one_rank_delays_the_commit_on_every_rank() -> None:
    results = spawn_ranks(_slow_copy_worker, 2, (0, 0.05), timeout_s=TIMEOUT_S)
    a, b = results
    assert a["polls"] == b["polls"]  # identical op states after every poll: no rank commits early
    states = [s for s, _, _ in a["polls"]]
    assert states[-1] == "committed"
    # Rank 1 finished its copies long before rank 0 (about 0.25 s of delays),
    # so there were polls where it had landed but the agreed state still waited.
    assert states.count("writing") >= 3, states
    assert all(h == "pending" for s, h, _ in a["polls"] if s == "writing")
    assert a["tree"] == b["tree"] and a["alloc"] == b["alloc"]


@pytest.mark.parametrize("world_size,seed,steps", [(2, 11, 300), (3, 12, 150)])
def test_random_ops_with_rank_local_failures_keep_ranks_identical(world_size: int, seed: int, steps: int) -> None:
    results = spawn_ranks(_random_ops_worker, world_size, (seed, steps), timeout_s=TIMEOUT_S)
    r0 = results[0]
    for r, res in enumerate(results[1:], start=1):
        first = next((i for i, (x, y) in enumerate(zip(r0["digests"], res["digests"])) if x != y), None)
        assert first is None, f"rank {r} diverged from rank 0 at step {first}"
        assert res["final"] == r0["final"]
        assert res["aborted"] == r0["aborted"]
    assert all(res["mismatches"] == 0 for res in results)
    assert sum(res["checked"] for res in results) > 0
    backups_aborted, loads_aborted = r0["aborted"]
    assert backups_aborted > 0, "the injected failures never hit a backup: the test lost its teeth"


def test_a_rank_that_raises_fails_the_launch_with_its_traceback() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        spawn_ranks(_raise_on_rank_worker, 2, (1,), timeout_s=TIMEOUT_S)
    assert "CP rank 1 of 2 failed" in str(info.value)
    assert "boom on rank 1" in str(info.value)
    assert time.monotonic() - t0 < TIMEOUT_S / 2


def test_combine_reports_raises_on_diverged_hit_tokens() -> None:
    a = {"requests": 3, "l2_hit_tokens": 32, "l2_capacity_pages": 8, "cp_size": 2, "wall_s": 1.0}
    b = dict(a, l2_hit_tokens=16)
    with pytest.raises(Exception, match="rank 0 has 32, rank 1 has 16"):
        combine_reports([a, b], wall_s=1.0)


def _replay_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    replay.add_arguments(p)
    return p.parse_args([*argv, "--device", "cpu"])


def test_replay_cp2_matches_cp1() -> None:
    one = replay.replay(_replay_args("--limit", "60"))
    two = replay.replay(_replay_args("--limit", "60", "--cp-size", "2"))
    assert two["integrity_mismatches"] == 0 and one["integrity_mismatches"] == 0
    assert two["integrity_checked_pages"] > 0
    # Same logical capacity, same decisions: the same tokens hit. (The L1/L2
    # split may differ slightly: L1 pages come from per-rank lanes.)
    assert two["l1_hit_tokens"] + two["l2_hit_tokens"] == one["l1_hit_tokens"] + one["l2_hit_tokens"]
    assert two["miss_tokens"] == one["miss_tokens"]
    assert two["hit_rate"] == pytest.approx(one["hit_rate"])
    ranks = two["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["collectives"] == ranks[0]["collectives"] > 0 for r in ranks)
    # Each rank holds about half the host memory of the single rank.
    for r in ranks:
        assert r["host_bytes"] <= one["host_bytes"] / 2 + one["host_bytes"] / one["l2_capacity_pages"] * 2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("backend", ["direct"])
def test_replay_cp2_on_two_gpus_matches_cp1(backend: str) -> None:
    """Two real ranks on two GPUs (NCCL agreement, CUDA copy engine): the same
    hits as one GPU at equal logical capacity, every page verified."""
    p = argparse.ArgumentParser()
    replay.add_arguments(p)
    common = ["--limit", "60", "--device", "cuda", "--io-backend", backend]
    one = replay.replay(p.parse_args(common))
    two = replay.replay(p.parse_args([*common, "--cp-size", "2"]))
    assert one["integrity_mismatches"] == 0 and two["integrity_mismatches"] == 0
    assert two["integrity_checked_pages"] > 0 and two["rejected_requests"] == 0
    assert two["l1_hit_tokens"] + two["l2_hit_tokens"] == one["l1_hit_tokens"] + one["l2_hit_tokens"]
    assert two["l2_hit_tokens"] > 0 and two["bytes_h2d"] > 0
    assert [r["rank"] for r in two["per_rank"]] == [0, 1]


def _disagreeing_op_lists(ctx: RankContext) -> None:
    """Rank 1 has one op more in flight than rank 0 (a replication bug)."""
    from hicache_cp.cp.agreement import Vote

    votes = [Vote(ok=True, settled=False)] * (2 + ctx.rank)
    ctx.agreement.reduce(votes)


def test_agreement_catches_ranks_with_different_op_counts() -> None:
    """The op count rides along with the votes: ranks whose op lists diverged
    fail loudly with both counts instead of mixing two ops' votes."""
    with pytest.raises(RankFailed) as info:
        spawn_ranks(_disagreeing_op_lists, 2, timeout_s=TIMEOUT_S)
    text = str(info.value)
    assert "CP ranks disagree on the number of in-flight ops" in text
    assert "min_ops=2" in text and "max_ops=3" in text


# ---- restore checks across ranks (issue 44) -------------------------------------------------------


def _corrupt_on_one_rank_worker(ctx: RankContext, bad_rank: int) -> dict[str, Any]:
    """A flipped bit in one rank's L2 page: only that rank's check fails, every rank aborts
    the load at the same poll and drops the copy; the pages are recomputed, never served."""
    from hicache_cp.cp import mapping as cp_mapping

    cache = _cache(ctx, l1_pages=16, host_pages=16)
    server = ReferenceServer(cache, verify=True)
    try:
        prompt = _tokens(1, 2, 3, 4, 5, 6)
        server.serve(0, prompt)
        cache.evict_device()
        pages = np.concatenate([n.host_pages for n in cache.tree.match(prompt)])  # the same calls on every rank
        if ctx.rank == bad_rank:
            mine = pages[cp_mapping.owner(pages, ctx.world_size) == ctx.rank]
            physical = int(cp_mapping.to_physical(mine[:1], ctx.world_size)[0])
            cache.host_pool.layer_view(Part.DRAFT_KV, 0)[physical, 3] ^= 0x01
        served = server.serve(1, prompt)
        again = server.serve(2, prompt)  # L1 holds the recomputed pages now; the dropped copy is gone
        cache.drain()
        cache.check_invariants()
        stats = cache.stats()
        return {"tree": _tree(cache), "alloc": _allocator_state(cache), "loads_aborted": stats["loads_aborted"],
                "dropped": stats["integrity_dropped_pages"], "failures": stats["verify_failures"],
                "mismatches": server.integrity.mismatches, "l2_hit": served.l2_hit_pages, "again": again.l2_hit_pages}
    finally:
        cache.close()


@pytest.mark.parametrize("world_size,bad_rank", [(2, 1), (3, 0)])
def test_a_check_failing_on_one_rank_aborts_and_drops_on_every_rank(world_size: int, bad_rank: int) -> None:
    results = spawn_ranks(_corrupt_on_one_rank_worker, world_size, (bad_rank,), timeout_s=TIMEOUT_S)
    r0 = results[0]
    for r, res in enumerate(results):
        assert res["l2_hit"] == 6 and res["loads_aborted"] == 1 and res["dropped"] == 6, (r, res)
        assert res["failures"] == (1 if r == bad_rank else 0), (r, res)
        assert res["mismatches"] == 0 and res["again"] == 0
        assert res["tree"] == r0["tree"] and res["alloc"] == r0["alloc"], f"rank {r} diverged from rank 0"
