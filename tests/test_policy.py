"""Eviction policies: the ghost table, `reuse_lru`'s order and learning, the
hooks the cache calls, LRU's order unchanged, and determinism across runs
and CP ranks.

Scenario tests drive a real cache (`make_cache`, invariant checks on) and
comment the state after each step; the ghost table is checked against a
scalar model with hypothesis; the seeded protocol stress of
test_cache_stateful runs again with `reuse_lru` (invariants after every
step, both CP ranks' trees identical after every step).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import test_cache_stateful
from conftest import evict_all_l1, evict_all_l2, run_request, tiny_config, tokens_of
from hicache_harness.replay import command as replay
from hicache_cp.policy import make_policy, policy_names
from hicache_cp.policy.base import EvictionPolicy
from hicache_cp.policy.ghost import GhostTable
from hicache_cp.policy.reuse_lru import EXTENSION, FRESH, ReuseLruPolicy
from hicache_cp.radix import Node

PS = 4  # page size of the hook-level tests


# ---- the ghost table ------------------------------------------------------------------------


class GhostModel:
    """A scalar direct-mapped table with the same slots: what GhostTable must equal."""

    def __init__(self, table: GhostTable) -> None:
        self.table = table
        self.slots: dict[int, tuple[int, int, int]] = {}  # slot -> (hash, count, tag)

    def _slot(self, h: int) -> int:
        return int(self.table._slots(np.array([h], np.uint64))[0])

    def count(self, h: int) -> int:
        e = self.slots.get(self._slot(h))
        return e[1] if e is not None and e[0] == h else 0

    def touch(self, hashes: list[int]) -> tuple[list[int], list[int]]:
        before = [self.count(h) for h in hashes]
        tags = [(self.slots[self._slot(h)][2] if b or self.slots.get(self._slot(h), (None,))[0] == h else 0)
                for h, b in zip(hashes, before)]  # fmt: skip
        for h, b, t in zip(hashes, before, tags):  # in order: the last write of a slot wins
            self.slots[self._slot(h)] = (h, b + 1, t)
        return before, tags

    def tag(self, hashes: list[int], tag: int) -> None:
        for h in hashes:
            s = self._slot(h)
            if s in self.slots and self.slots[s][0] == h:
                self.slots[s] = (h, self.slots[s][1], tag)


HASHES = st.sampled_from([3, 5, 8, 2**40 + 1, 2**63 + 7, 12345678901234567, 2**64 - 1, 99])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(HASHES, min_size=1, max_size=6), st.integers(1, 3)), max_size=25))
def test_ghost_table_equals_a_scalar_direct_mapped_model(ops: list[tuple[bool, list[int], int]]) -> None:
    table = GhostTable(4)  # 8 distinct hashes over 4 slots: collisions happen
    model = GhostModel(table)
    truth: dict[int, int] = {}
    for is_touch, hashes, tag in ops:
        hs = list(dict.fromkeys(hashes))  # distinct within one call, as prefix hashes of one request are
        arr = np.array(hs, np.uint64)
        if is_touch:
            before, tags = table.touch(arr)
            want_before, want_tags = model.touch(hs)
            assert before.tolist() == want_before and tags.tolist() == want_tags
            for h in hs:
                truth[h] = truth.get(h, 0) + 1
        else:
            table.tag(arr, tag)
            model.tag(hs, tag)
        probe = sorted(truth)
        counts = table.counts(np.array(probe, np.uint64)).tolist()
        assert counts == [model.count(h) for h in probe]
        # Approximate, never inflated: a count is at most the true number of accesses.
        assert all(c <= truth[h] for c, h in zip(counts, probe))


def test_ghost_table_counts_and_forgets() -> None:
    g = GhostTable(1 << 10)
    a = np.array([11, 22, 33], np.uint64)
    before, tags = g.touch(a)
    # First sight: counts 0, untagged; now 1 each.
    assert before.tolist() == [0, 0, 0] and tags.tolist() == [0, 0, 0]
    g.tag(a[:2], 2)
    before, tags = g.touch(a)
    # Second sight: the counts and tags from before this access.
    assert before.tolist() == [1, 1, 1] and tags.tolist() == [2, 2, 0]
    assert g.counts(a).tolist() == [2, 2, 2]
    assert g.counts(np.array([44], np.uint64)).tolist() == [0]
    assert g.nbytes == (1 << 10) * 13


@pytest.mark.parametrize("slots", [0, 1, 3, 100])
def test_ghost_table_rejects_bad_sizes(slots: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        GhostTable(slots)


def test_ghost_tag_range() -> None:
    with pytest.raises(ValueError, match="0..255"):
        GhostTable(2).tag(np.array([1], np.uint64), 256)


# ---- the interface: LRU unchanged, hooks default to nothing --------------------------------------


def _node(last_access: int, hit_count: int = 0, *, first_position: int = 0, num_pages: int = 1,
          parent: Node | None = None) -> Node:  # fmt: skip
    tokens = np.arange(num_pages * PS, dtype=np.int64) + 1000 * first_position
    n = Node(parent=parent, tokens=tokens, num_pages=num_pages, first_position=first_position)
    n.last_access, n.hit_count = last_access, hit_count
    return n


@pytest.mark.parametrize("name", ["lru", "hit_weighted"])
def test_existing_policies_order_both_tiers_by_their_key(name: str) -> None:
    policy = make_policy(name)
    policy.bind(page_size=PS, l1_pages=8, l2_pages=64)
    nodes = [_node(last, hits) for last, hits in [(5, 0), (3, 4), (9, 1), (1, 0)]]
    for tier in ("l1", "l2"):
        assert [policy.key_in(n, tier) for n in nodes] == [policy.key(n) for n in nodes]
    if name == "lru":
        assert [policy.key(n) for n in nodes] == [5, 3, 9, 1]
    # The hooks are no-ops for them: keys unchanged afterwards.
    policy.on_match(np.zeros(2 * PS, np.int64), nodes[:1], 10)
    policy.on_insert(np.zeros(PS, np.int64), nodes[0], 10)
    policy.on_evict(nodes[0], "l2", 10)
    assert policy.key(nodes[0]) == make_policy(name).key(nodes[0])


def test_registry_lists_reuse_lru_and_rejects_unknown_names() -> None:
    assert {"lru", "hit_weighted", "reuse_lru"} <= set(policy_names())
    assert isinstance(make_policy("reuse_lru"), ReuseLruPolicy)
    with pytest.raises(ValueError, match="supported: .*reuse_lru"):
        make_policy("belady")


def _host_resident(cache: Any) -> set[int]:
    """First token of every node whose host copy is visible (one id per page here)."""
    return {int(n.tokens[0]) for n in cache.tree.nodes() if n.host_visible}


def test_lru_evicts_in_last_access_order(make_cache) -> None:
    cache = make_cache(l1_pages=32, host_pages=6, eviction_policy="lru")
    for pages in ([1, 2], [3, 4], [5, 6]):
        run_request(cache, tokens_of(*pages))
    run_request(cache, tokens_of(1, 2))  # [1, 2] hit again: the most recent now
    # L2 full (6 pages, no free room). A new 2-page backup evicts the least recent: [3, 4].
    run_request(cache, tokens_of(7, 8))
    assert _host_resident(cache) == {1, 5, 7}


# ---- reuse_lru: order ---------------------------------------------------------------------------


def test_reuse_lru_keeps_a_reused_node_over_newer_first_timers(make_cache) -> None:
    for name in ("lru", "reuse_lru"):
        cache = make_cache(l1_pages=32, host_pages=6, eviction_policy=name)
        run_request(cache, tokens_of(1, 2))  # clock 1: A
        run_request(cache, tokens_of(1, 2))  # clock 2: A hit (hit_count 1): protected under reuse_lru
        run_request(cache, tokens_of(3, 4))  # clock 3: B, a first-timer
        run_request(cache, tokens_of(5, 6))  # clock 4: C, a first-timer; L2 now full
        assert _host_resident(cache) == {1, 3, 5}
        run_request(cache, tokens_of(7, 8))  # clock 5: D needs 2 L2 pages
        # LRU evicts A (last access 2 < 3); reuse_lru evicts the oldest first-timer, B.
        assert _host_resident(cache) == ({3, 5, 7} if name == "lru" else {1, 5, 7})


def test_reuse_lru_remembers_content_after_it_left_the_cache(make_cache) -> None:
    cache = make_cache(l1_pages=32, host_pages=32, eviction_policy="reuse_lru")
    policy = cache.policy
    assert isinstance(policy, ReuseLruPolicy) and policy.ghost.slots >= 4 * (32 + 32)
    first = run_request(cache, tokens_of(1, 2, 3)).node
    assert first is not None and first.reuse_hint == 0 and not policy.protected(first)
    evict_all_l1(cache)
    evict_all_l2(cache)
    # Evicted from both tiers: the node is pruned, only the ghost remembers it.
    assert not list(cache.tree.nodes())
    again = run_request(cache, tokens_of(1, 2, 3)).node
    assert again is not None and again is not first
    # Second access, a miss: recomputed, and protected from the start.
    assert again.reuse_hint == 1 and again.hit_count == 0 and policy.protected(again)
    other = run_request(cache, tokens_of(9, 8)).node
    assert other is not None and other.reuse_hint == 0


def test_reuse_lru_l1_order_is_plain_lru_and_l2_window_follows_turnover() -> None:
    policy = ReuseLruPolicy()
    policy.bind(page_size=PS, l1_pages=8, l2_pages=64)
    old_hit, new_cold = _node(10, hit_count=2), _node(50)
    # Before any L2 eviction the window is unbounded: protected beats any age.
    assert policy.window == math.inf
    assert policy.key_in(old_hit, "l2") > policy.key_in(new_cold, "l2")
    # L1 is plain LRU whatever the protection.
    assert policy.key_in(old_hit, "l1") == 10 < policy.key_in(new_cold, "l1") == 50
    policy.on_evict(_node(40), "l2", 60)  # a first-timer left L2 at age 20
    assert policy.turnover == 20 and policy.window == ReuseLruPolicy.PROTECT * 20
    policy.on_evict(_node(0, hit_count=1), "l2", 60)  # protected victims do not count
    policy.on_evict(_node(0), "l1", 60)  # nor L1 victims
    assert policy.turnover == 20
    # A protected node outlives first-timers up to W ticks younger, not more.
    w = policy.window
    assert policy.key(_node(100, hit_count=1)) == 100 + w
    assert policy.key(_node(int(100 + w) + 1)) > policy.key(_node(100, hit_count=1))


def test_unbound_reuse_lru_is_plain_lru() -> None:
    policy = ReuseLruPolicy()  # a cache always binds; unbound the hooks do nothing
    n = _node(7)
    policy.on_match(np.zeros(PS, np.int64), [n], 7)
    policy.on_insert(np.zeros(PS, np.int64), n, 7)
    assert n.reuse_hint == 0 and policy.key(n) == 7
    with pytest.raises(ValueError, match="page_size"):
        policy.bind(page_size=0, l1_pages=1, l2_pages=1)


# ---- reuse_lru: learning which first-timers to protect --------------------------------------------


def _pages(*ids: int) -> np.ndarray:
    return np.concatenate([np.full(PS, i, np.int64) for i in ids])


class HookDriver:
    """Calls the hooks as the cache does for one request: match (all its pages),
    then insert of the pages after the cached prefix as one node."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.clock = 0
        self.root = Node(parent=None, tokens=np.empty(0, np.int64), num_pages=0, first_position=0)

    def request(self, ids: list[int], cached: int) -> Node | None:
        self.clock += 1
        tokens = _pages(*ids)
        self.policy.on_match(tokens, [], self.clock)
        if cached == len(ids):
            return None  # a full hit inserts nothing
        node = Node(parent=self.root, tokens=tokens[cached * PS :], num_pages=len(ids) - cached, first_position=cached)
        self.policy.on_insert(tokens, node, self.clock)
        return node


def test_reuse_lru_learns_to_protect_chat_extensions() -> None:
    policy = ReuseLruPolicy()
    policy.bind(page_size=PS, l1_pages=64, l2_pages=1024)
    d = HookDriver(policy)
    ids = iter(range(1, 10**6))
    for _ in range(40):
        # A chat: each turn extends the previous prompt by one page, so every
        # extension page comes back with the next turn; a one-off prompt never does.
        prompt = [next(ids), next(ids)]
        d.request(prompt, cached=0)
        for _turn in range(3):
            prompt.append(next(ids))
            d.request(prompt, cached=len(prompt) - 1)
        d.request([next(ids), next(ids), next(ids)], cached=0)  # one-off
    assert policy.extension_protected()
    assert policy.reused[EXTENSION] / policy.admitted[EXTENSION] > policy.reused[FRESH] / policy.admitted[FRESH]
    prompt = [next(ids), next(ids)]
    d.request(prompt, cached=0)
    ext, fresh = d.request(prompt + [next(ids)], cached=2), d.request([next(ids)], cached=0)
    assert ext is not None and ext.reuse_hint == 1  # an extension: protected
    assert fresh is not None and fresh.reuse_hint == 0  # a fresh prompt: probationary


def test_reuse_lru_keeps_extensions_probationary_when_documents_are_reread() -> None:
    policy = ReuseLruPolicy()
    policy.bind(page_size=PS, l1_pages=64, l2_pages=1024)
    d = HookDriver(policy)
    ids = iter(range(1, 10**6))
    for _ in range(40):
        # A document read again whole (its fresh pages come back), and a re-read
        # with a new last page whose extension never comes back.
        doc = [next(ids) for _ in range(3)]
        d.request(doc, cached=0)
        d.request(doc, cached=3)
        d.request(doc + [next(ids)], cached=3)
    assert not policy.extension_protected()
    doc = [next(ids), next(ids)]
    d.request(doc, cached=0)
    ext = d.request(doc + [next(ids)], cached=2)
    assert ext is not None and ext.reuse_hint == 0


# ---- determinism: runs, CP ranks, random protocol interleavings --------------------------------------


def _replay(*argv: str) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    replay.add_arguments(p)
    with contextlib.redirect_stderr(io.StringIO()):
        return replay.replay(p.parse_args([*argv, "--device", "cpu"]))


DECISIONS = ("l1_hit_tokens", "l2_hit_tokens", "miss_tokens", "evictions_l1", "evictions_l2", "backups_committed")


def test_reuse_lru_replay_is_deterministic_with_integrity() -> None:
    args = ("--limit", "150", "--l2-fraction", "0.1", "--policy", "reuse_lru")
    one, two = _replay(*args), _replay(*args)
    assert one["evictions_l2"] > 0  # the policy decided something
    assert [one[k] for k in DECISIONS] == [two[k] for k in DECISIONS]
    assert one["integrity_mismatches"] == 0 and one["integrity_checked_pages"] > 0


def test_reuse_lru_cp2_ranks_decide_alike() -> None:
    # Under eviction pressure both ranks make every replicated decision alike:
    # combine_reports raises ConsistencyError naming the key if they diverge.
    # (cp 2 need not equal cp 1 here: a lane short of pages forces extra
    # evictions that cp 1 does not make; LRU's hits differ too at this size.)
    two = _replay("--limit", "120", "--l2-fraction", "0.1", "--policy", "reuse_lru", "--cp-size", "2")
    assert two["evictions_l2"] > 0 and two["integrity_mismatches"] == 0 and two["integrity_checked_pages"] > 0
    assert [r["collectives"] for r in two["per_rank"]] == [two["per_rank"][0]["collectives"]] * 2


@pytest.mark.parametrize("seed,ranks", [(0, 1), (1, 1), (7, 2)])
def test_protocol_stress_with_reuse_lru(seed: int, ranks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """test_cache_stateful's seeded stress (every invariant after every step; with
    two ranks, identical trees after every step) with reuse_lru evicting."""
    monkeypatch.setattr(
        test_cache_stateful, "tiny_config", lambda **kw: tiny_config(**kw, eviction_policy="reuse_lru")
    )
    assert test_cache_stateful.stress(seed, 600 if ranks == 1 else 400, ranks=ranks, manual=ranks == 2) > 0


@pytest.mark.parametrize("fraction", ["0.1", "0.25"])
def test_reuse_lru_not_below_lru_on_the_embedded_workload(fraction: str) -> None:
    lru = _replay("--l2-fraction", fraction, "--policy", "lru", "--no-verify")
    mine = _replay("--l2-fraction", fraction, "--policy", "reuse_lru", "--no-verify")
    assert mine["hit_rate"] >= lru["hit_rate"]
