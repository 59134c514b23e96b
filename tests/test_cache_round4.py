"""Backups computed on a failing load, and loads refused midway (issue 48, item 6).

Scenario tests on the tiny cache (cpu copy engine, invariant checks after every
operation). A CP group is modelled where it matters by an agreement double
(`OtherRankCopying`): another rank whose copies are still in flight, so that no
vote is settled yet, as the MIN collective reports it.

* a backup whose prefix load is failing but not settled (another rank still
  copies) does not commit when its own copies land; it aborts with the load;
* a write-through backup inserted after its prefix's load aborted aborts and
  never becomes a hit (its node is stale: no device hit either);
* a request whose load fails after its own backups landed leaves nothing of
  them in L2 (the allocator is back where it was, no node holds a copy of them);
* `load_into` refused midway (the engine raises CopyFailed after it started
  some layers) returns only after the copies it already submitted returned.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from conftest import Faults, evict_all_l1, fill_pattern, land, run_request, tokens_of, wait_copies
from test_cache_scenarios import _l2_only_then_fail_next_load

from hicache_cp.cp.agreement import LocalAgreement
from hicache_cp.io.base import CopyFailed, TicketState
from hicache_cp.ops import BackupState, LoadState, Vote
from hicache_cp.radix import HostState


class OtherRankCopying(LocalAgreement):
    """One rank of a CP group whose other rank still has copies in flight: of every op
    while `copying`, or of the ops in `held` only (`watch` names the cache whose ops
    vote, in the order `Lifecycle.poll` sends them: backups, loads, then L3's)."""

    def __init__(self) -> None:
        self.copying = False
        self.held: set[int] = set()  # ids of ops (load, backup, prefetch)
        self.cache: Any = None

    def watch(self, cache: Any) -> None:
        self.cache = cache

    def reduce(self, votes: Sequence[Vote]) -> list[Vote]:
        ids = [op.id for op in [*self.cache._state.backups, *self.cache._state.loads]] if self.cache else []
        ids += [None] * (len(votes) - len(ids))
        return [Vote(ok=v.ok, settled=v.settled and not self.copying and i not in self.held)
                for v, i in zip(votes, ids)]  # fmt: skip


def _computed_on_a_failing_load(make_cache):  # type: ignore[no-untyped-def]
    """Prefix in L2 only, a request of it plus one page whose load's first copy fails;
    every copy of the request (its load, its backup) has returned, but another rank
    still copies: the load is FAILING, nothing is decided for the backup yet."""
    faults, agreement = Faults(), OtherRankCopying()
    cache = make_cache(l1_pages=32, host_pages=32, fault=faults, agreement=agreement)
    agreement.watch(cache)
    prefix = tokens_of(71, 72)
    _l2_only_then_fail_next_load(cache, faults, prefix)
    used = cache.host_pool.allocator.used_pages
    r = run_request(cache, np.concatenate([prefix, tokens_of(73)]), stop_after="insert", write=fill_pattern)
    assert r.load is not None and r.bk is not None and r.bk.after == [r.load] and r.node is not None
    wait_copies(cache)
    assert r.load.error is not None and r.bk.local_vote() == Vote(ok=True, settled=True)  # every copy landed
    agreement.held = {r.load.id}  # the other rank still copies the load; the backup landed everywhere
    cache.poll()
    assert r.load.state is LoadState.FAILING
    return cache, agreement, r, used


def test_a_backup_on_a_failing_load_does_not_commit_when_its_copies_land(make_cache) -> None:
    cache, agreement, r, _ = _computed_on_a_failing_load(make_cache)
    # every copy of the backup landed and the vote is ok, but its prefix's load is failing
    assert r.bk.state is not BackupState.COMMITTED and r.node.host_state is HostState.PENDING
    cache.poll()
    assert r.bk.state is not BackupState.COMMITTED and not r.node.host_visible
    agreement.held = set()  # the other rank's copies returned: the load aborts, the backup with it
    cache.poll()
    assert r.load.state is LoadState.ABORTED and r.bk.state is BackupState.ABORTED
    assert r.node.host_state is HostState.NONE and r.node.stale_load is r.load
    r.release()


def test_a_failed_load_leaves_nothing_of_the_requests_landed_backups_in_l2(make_cache) -> None:
    cache, agreement, r, used = _computed_on_a_failing_load(make_cache)
    agreement.held = set()
    cache.poll()
    assert r.bk.state is BackupState.ABORTED
    assert cache.host_pool.allocator.used_pages == used  # the backup's reservation is free again
    assert [n for n in cache.tree.nodes() if n.first_position >= 2 and n.host_pages is not None] == []
    r.release()
    evict_all_l1(cache)
    probe = cache.match_prefix(r.tokens)
    assert (probe.device_len, probe.host_len) == (0, 2)  # the prefix's own copy only
    cache.release(probe.last_node)
    cache.check_invariants()


def test_a_backup_inserted_after_its_prefixs_load_aborted_never_becomes_a_hit(make_cache) -> None:
    """The forward ran on the load (which failed), the poll aborted the load, and only
    then does the request insert its new pages with their write-through backup."""
    faults = Faults()
    cache = make_cache(l1_pages=32, host_pages=32, fault=faults)
    prefix = tokens_of(81, 82)
    _l2_only_then_fail_next_load(cache, faults, prefix)
    toks = np.concatenate([prefix, tokens_of(83)])
    r = run_request(cache, toks, stop_after="draft", write=fill_pattern)
    land(cache)
    assert r.load is not None and r.load.state is LoadState.ABORTED
    r.insert()
    land(cache)
    land(cache)
    assert r.bk is not None and r.bk.state is BackupState.ABORTED
    assert r.node is not None and r.node.host_state is HostState.NONE and r.node.stale_load is r.load
    probe = cache.match_prefix(toks)
    assert probe.matched_pages == 0  # computed on invalid KV: no device hit, no host copy
    cache.release(probe.last_node)
    r.release()
    evict_all_l1(cache)
    probe = cache.match_prefix(toks)
    assert probe.host_len == 2 and probe.matched_pages == 2  # the prefix's own copy, never the third page
    cache.release(probe.last_node)
    cache.check_invariants()


def test_load_into_refused_midway_returns_after_the_copies_it_started(make_cache, monkeypatch) -> None:
    """The engine starts two layers, then refuses the third (CopyFailed at submit).
    Those two still write into the engine's device pages: `load_into` raises only once
    they returned (here: held until the test opens the gate)."""
    faults = Faults()
    cache = make_cache(l1_pages=32, host_pages=32, fault=faults)
    toks = tokens_of(91, 92)
    run_request(cache, toks, write=fill_pattern)
    evict_all_l1(cache)
    m = cache.match_prefix(toks)
    assert (m.device_len, m.host_len) == (0, 2)
    engine, started = cache.engine, []
    real = engine.submit_layer

    def refuse_the_third(plan, parts, layer):  # type: ignore[no-untyped-def]
        if len(started) == 2:
            raise CopyFailed("injected: the engine refused the third layer")
        tickets = real(plan, parts, layer)
        started.append(tickets)
        return tickets

    monkeypatch.setattr(engine, "submit_layer", refuse_the_third)
    faults.hold()
    at_raise: list[list[TicketState]] = []
    errors: list[BaseException] = []

    def load() -> None:
        try:
            cache.load_into(m, np.array([5, 6]), 0)
        except CopyFailed as exc:
            at_raise.append([t.query() for ts in started for t in ts if t is not None])
            errors.append(exc)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    time.sleep(0.3)  # a load_into that did not wait has raised by now, its copies still held
    faults.open()
    t.join(30)
    assert not t.is_alive() and len(errors) == 1 and "refused the third layer" in str(errors[0])
    assert at_raise and TicketState.PENDING not in at_raise[0], f"raised with copies in flight: {at_raise}"
    assert len(errors[0].submitted) == sum(t is not None for ts in started for t in ts)  # type: ignore[attr-defined]
    assert cache.in_flight() == ([], [])
    cache.release(m.last_node)
    cache.check_invariants()
