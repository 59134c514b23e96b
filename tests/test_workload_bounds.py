"""The default workload generator and the replay's reference bounds."""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_harness.bounds import (
    BoundResult,
    _belady,
    belady_hit_rate,
    infinite_capacity_hit_rate,
)
from hicache_harness.trace import (
    BLOCK_TOKENS,
    TraceRequest,
    load_trace,
    unique_blocks,
    write_trace,
)
from hicache_harness.workload import default_workload

SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"


def _req(i: int, ids: Sequence[int], tail: int = 0) -> TraceRequest:
    """A request of full blocks ``ids`` (plus a partial block of ``tail`` tokens
    whose id is the last entry of ``ids`` when ``tail > 0``)."""
    full = len(ids) - (1 if tail else 0)
    return TraceRequest(i, float(i), full * BLOCK_TOKENS + tail, 1, tuple(ids))


def _trace(*chains: Sequence[int]) -> list[TraceRequest]:
    return [_req(i, c) for i, c in enumerate(chains)]


def _lru_prefix_hits(requests: Sequence[TraceRequest], capacity: int) -> int:
    """Block LRU, every accessed block inserted, hits by the prefix rule."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for r in requests:
        on_prefix = True
        for b in r.hash_ids[: r.full_blocks]:
            if b in cache:
                cache.move_to_end(b)
                hits += on_prefix
                continue
            on_prefix = False
            if capacity == 0:
                continue
            if len(cache) == capacity:
                cache.popitem(last=False)
            cache[b] = None
    return hits


# ------------------------------------------------------------------- workload


def test_default_workload_deterministic_per_seed() -> None:
    a, b, c = default_workload(0), default_workload(0), default_workload(1)
    assert a == b
    assert a != c


def test_default_workload_well_formed_and_sized(tmp_path: Path) -> None:
    w = default_workload()
    assert 250 <= len(w) <= 400
    avg_blocks = sum(len(r.hash_ids) for r in w) / len(w)
    assert 20 <= avg_blocks <= 40
    assert [r.index for r in w] == list(range(len(w)))
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(w, w[1:]))
    parent: dict[int, int | None] = {}
    for r in w:
        assert len(r.hash_ids) == -(-r.input_length // BLOCK_TOKENS)
        for pos, h in enumerate(r.hash_ids):
            p = r.hash_ids[pos - 1] if pos else None
            assert parent.setdefault(h, p) == p, "hash ids must be chained"
    # survives the file format unchanged, session included
    write_trace(tmp_path / "w.jsonl", w)
    assert load_trace(tmp_path / "w.jsonl") == w


def test_default_workload_shares_system_prompts() -> None:
    w = default_workload(seed=3, system_prompts=4)
    firsts = Counter(r.hash_ids[0] for r in w if r.session is not None)
    assert len(firsts) <= 4
    assert max(firsts.values()) >= 0.15 * len(w)
    assert sum(1 for r in w if r.session is None) == 30  # single-shot requests


def test_default_workload_turns_extend_their_prefix() -> None:
    w = default_workload(seed=5)
    by_session: dict[int, list[TraceRequest]] = defaultdict(list)
    for r in w:
        if r.session is not None:
            by_session[r.session].append(r)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert len(multi) >= 20
    for turns in multi:
        for prev, nxt in zip(turns, turns[1:]):
            # the previous prompt's full blocks (and that turn's answer) are
            # a prefix of the next prompt; the open tail block is not reused
            k = prev.full_blocks
            assert nxt.hash_ids[:k] == prev.hash_ids[:k]
            assert nxt.input_length >= prev.input_length + prev.output_length
            assert nxt.timestamp_ms >= prev.timestamp_ms
            if len(prev.hash_ids) > k:
                assert prev.hash_ids[k] not in nxt.hash_ids


def test_default_workload_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="at least one request"):
        default_workload(sessions=0, single_shot=0)
    with pytest.raises(ValueError, match="user_tokens"):
        default_workload(user_tokens=(10, 5))


# -------------------------------------------------------- infinite capacity


def test_infinite_capacity_known_answer() -> None:
    reqs = _trace([1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 3, 6], [7])
    reqs.append(_req(5, [1, 2, 3], tail=10))  # full blocks 1, 2; tail 3 excluded
    # hits: 0, 2 (1,2), 1 (1), 3 (1,2,3), 0, 2 (1,2); blocks 3+3+2+4+1+2
    assert infinite_capacity_hit_rate(reqs) == BoundResult(8, 15)
    assert infinite_capacity_hit_rate(reqs).hit_rate == pytest.approx(8 / 15)


def test_infinite_capacity_uses_prefix_not_block_identity() -> None:
    # block 9 was seen, but never after block 5: a radix tree cannot match it
    reqs = _trace([9], [5, 9], [5, 9])
    assert infinite_capacity_hit_rate(reqs) == BoundResult(2, 5)


def test_empty_trace_bounds() -> None:
    assert infinite_capacity_hit_rate([]) == BoundResult(0, 0)
    assert belady_hit_rate([], 4).hit_rate == 0.0


# --------------------------------------------------------------------- Belady


# A = [1, 2], B = [3], alternating A B A B A: accesses
#   t: 0 1 2 3 4 5 6 7
#   b: 1 2 3 1 2 3 1 2
ALTERNATING = _trace([1, 2], [3], [1, 2], [3], [1, 2])


@pytest.mark.parametrize(
    ("capacity", "hits"),
    [
        # cap 1: keep block 1 (next use t3), bypass 2 and 3: hits at t3, t6
        (1, 2),
        # cap 2: keep {1, 2}, bypass 3 (next use farther): hits t3, t4, t6, t7
        (2, 4),
        # cap 3: everything fits, only the three cold misses
        (3, 5),
    ],
)
def test_belady_known_answer(capacity: int, hits: int) -> None:
    assert belady_hit_rate(ALTERNATING, capacity) == BoundResult(hits, 8)
    assert _lru_prefix_hits(ALTERNATING, capacity) <= hits


def test_belady_lru_gap_on_known_trace() -> None:
    # LRU at capacity 2 always evicts the block needed next: zero hits
    assert _lru_prefix_hits(ALTERNATING, 2) == 0
    assert _lru_prefix_hits(ALTERNATING, 3) == 5


def test_belady_forced_insertion_breaks_prefix() -> None:
    # Forced insertion at capacity 2:
    # t0 +1, t1 +2, t2 3 misses: evict 2 (next t4 > 1's t3)      {1, 3}
    # t3 1 hit                                                    {1, 3}
    # t4 2 misses: evict 1 (next t6 > 3's t5), the running
    #    request's own parent                                     {3, 2}
    # t5 3 hit                                                    {3, 2}
    # t6 1 misses: evict 3 (never again)                          {2, 1}
    # t7 2 is cached but behind the miss at t6: no prefix hit
    assert _belady(ALTERNATING, 2, bypass=False) == (2, 3, 8)
    assert belady_hit_rate(ALTERNATING, 2, bypass=False) == BoundResult(2, 8)
    assert belady_hit_rate(ALTERNATING, 0) == BoundResult(0, 8)
    with pytest.raises(ValueError):
        belady_hit_rate(ALTERNATING, -1)


def test_belady_excludes_partial_tail() -> None:
    reqs = [_req(0, [1, 2], tail=100), _req(1, [1, 2], tail=100)]
    # only block 1 is a full block of each request
    assert belady_hit_rate(reqs, 1) == BoundResult(1, 2)
    assert infinite_capacity_hit_rate(reqs) == BoundResult(1, 2)


@st.composite
def chained_traces(draw: st.DrawFn) -> list[TraceRequest]:
    """Random small traces with chained ids: each request extends a random
    prefix of an earlier request (or nothing) with fresh blocks."""
    steps = draw(
        st.lists(
            st.tuples(
                st.integers(0, 10_000),  # which earlier request to branch from
                st.integers(0, 8),  # how many of its blocks to keep
                st.integers(0, 4),  # fresh blocks to add
                st.integers(0, BLOCK_TOKENS - 1),  # partial tail tokens
            ),
            min_size=1,
            max_size=25,
        )
    )
    chains: list[tuple[int, ...]] = []
    reqs: list[TraceRequest] = []
    fresh = 0
    for i, (src, keep, add, tail) in enumerate(steps):
        base = chains[src % len(chains)][:keep] if chains and src % 3 else ()
        full = base + tuple(range(fresh, fresh + add))
        fresh += add
        chains.append(full)
        ids = full + ((fresh,) if tail else ())
        fresh += 1 if tail else 0
        reqs.append(_req(i, ids, tail))
    return reqs


@settings(max_examples=300, deadline=None)
@given(chained_traces(), st.integers(0, 12))
def test_belady_bounds_properties(reqs: list[TraceRequest], capacity: int) -> None:
    inf = infinite_capacity_hit_rate(reqs)
    prefix_hits, block_hits, total = _belady(reqs, capacity, bypass=True)
    # the cached set stays prefix-closed, so the prefix rule costs nothing
    assert prefix_hits == block_hits
    assert total == inf.total_blocks
    bel = belady_hit_rate(reqs, capacity)
    assert bel.hit_blocks <= inf.hit_blocks
    assert bel.hit_blocks >= _lru_prefix_hits(reqs, capacity)
    assert belady_hit_rate(reqs, capacity + 1).hit_blocks >= bel.hit_blocks
    # forced insertion is a reference point below the optional-insertion bound
    forced = belady_hit_rate(reqs, capacity, bypass=False)
    assert forced.hit_blocks <= bel.hit_blocks
    # enough room for every full block: Belady reaches the infinite bound
    assert belady_hit_rate(reqs, max(1, unique_blocks(reqs))) == inf


@pytest.mark.skipif(
    not SHARED_TRACE.exists(),
    reason=f"shared trace not present at {SHARED_TRACE} (the repo does not ship it)",
)
def test_bounds_on_shared_trace_fast() -> None:
    reqs = load_trace(SHARED_TRACE)
    t0 = time.perf_counter()
    inf = infinite_capacity_hit_rate(reqs)
    bel = belady_hit_rate(reqs, unique_blocks(reqs) // 10)
    elapsed = time.perf_counter() - t0
    assert inf.total_blocks == bel.total_blocks == sum(r.full_blocks for r in reqs)
    assert 0.0 < bel.hit_rate < inf.hit_rate < 1.0
    assert elapsed < 10.0
