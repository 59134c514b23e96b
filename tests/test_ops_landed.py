""""Landed" means the bytes landed (issue 19): a layer of a part counts only
when copies covering every page the rank owns were submitted and completed.

Each test breaks one part of one direction's submission (a copy that covers
one page too few, or no copy at all for a rank that owns pages) and checks
that the op fails on poll: the backup's host copy never becomes visible, its
reservation is released, and a load aborts instead of returning a hit.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import evict_all_l1, expected_bytes, fill_pattern, land, run_request, tokens_of
from hicache_cp.cache.lifecycle import Lifecycle
from hicache_cp.config import Config
from hicache_cp.errors import ConsistencyError
from hicache_cp.io.base import CopyTicket, Direction, TicketState
from hicache_cp.layout import Model, Part
from hicache_cp.ops import BackupOp, BackupState, LoadOp, LoadState

PARTS = list(Part)


def _short_submissions(monkeypatch: pytest.MonkeyPatch, direction: Direction, part: Part, *, drop_all: bool) -> None:
    """Make the cache's submissions for (direction, part) cover one page too few (or none)."""
    real = Lifecycle._submit_layer

    def short(self, op, d, parts, layer):  # type: ignore[no-untyped-def]
        if d is not direction or part not in parts:
            return real(self, op, d, parts, layer)
        others = tuple(p for p in parts if p is not part)
        got = dict(zip(others, real(self, op, d, others, layer))) if others else {}
        dev, host = op.device_pages[:-1], op.host_pages[:-1]
        if drop_all:
            got[part] = None
        elif d is Direction.D2H:
            got[part] = self.s.engine.submit_backup(part, layer, dev, host)
        else:
            got[part] = self.s.engine.submit_load(part, layer, host, dev)
        return [got[p] for p in parts]

    def short_all(self, op, d, jobs):  # type: ignore[no-untyped-def]
        return [short(self, op, d, parts, layer) for parts, layer in jobs]

    monkeypatch.setattr(Lifecycle, "_submit_layer", short)
    monkeypatch.setattr(Lifecycle, "_submit_layers", short_all)


@pytest.mark.parametrize("drop_all", [False, True], ids=["one-page-short", "nothing-submitted"])
@pytest.mark.parametrize("part", PARTS, ids=[p.value for p in PARTS])
def test_backup_with_a_short_part_never_commits(make_cache, monkeypatch, part: Part, drop_all: bool) -> None:
    cache = make_cache(l1_pages=32, host_pages=32)
    l2 = cache.host_pool.allocator
    free0 = l2.free_pages
    _short_submissions(monkeypatch, Direction.D2H, part, drop_all=drop_all)
    r = run_request(cache, tokens_of(1, 2, 3), stop_after="poll")
    bk = r.bk
    assert bk is not None
    # The op failed on the agreed poll: aborted, reservation released, nothing visible.
    assert bk.state is BackupState.ABORTED
    assert isinstance(bk.error, ConsistencyError) and bk.error.part == part.value
    assert l2.free_pages == free0
    assert r.node is not None and r.node.host_pages is None and not r.node.host_visible
    r.release()
    evict_all_l1(cache)
    m = cache.match_prefix(tokens_of(1, 2, 3))
    assert m.matched_pages == 0, "a backup missing a part must never become a hit"
    cache.release(m.last_node)


@pytest.mark.parametrize("drop_all", [False, True], ids=["one-page-short", "nothing-submitted"])
@pytest.mark.parametrize("part", PARTS, ids=[p.value for p in PARTS])
def test_load_with_a_short_part_aborts(make_cache, monkeypatch, part: Part, drop_all: bool) -> None:
    cache = make_cache(l1_pages=32, host_pages=32)
    first = run_request(cache, tokens_of(4, 5, 6))
    assert first.bk is not None and first.bk.state is BackupState.COMMITTED
    evict_all_l1(cache)
    _short_submissions(monkeypatch, Direction.H2D, part, drop_all=drop_all)
    r = run_request(cache, tokens_of(4, 5, 6), stop_after="load")
    assert r.m is not None and r.m.host_len == 3 and r.load is not None
    land(cache)
    # Agreed: the load is not done; it aborted and its pages are stale (no hit for anyone).
    assert r.load.state is LoadState.ABORTED
    assert isinstance(r.load.error, ConsistencyError) and r.load.error.part == part.value
    assert all(n.stale_load is r.load for n in r.load.nodes)
    r.release()


def test_empty_submission_is_landed_only_for_a_rank_that_owns_nothing() -> None:
    layout = Config(model="tiny").layout()
    pages = np.array([1, 2], np.int64)
    owns_none = BackupOp(layout, pages, pages, 0, local_pages=0, rank=1)
    owns_none.record_submit(Part.TARGET_KV, 0, [])
    assert 0 in owns_none.landed[Part.TARGET_KV] and owns_none.error is None
    owns_two = BackupOp(layout, pages, pages, 0, local_pages=2, rank=0)
    owns_two.record_submit(Part.TARGET_KV, 0, [])
    assert 0 not in owns_two.landed[Part.TARGET_KV]
    assert isinstance(owns_two.error, ConsistencyError) and owns_two.error.layer == 0
    assert not owns_two.local_vote().ok


class _Ticket(CopyTicket):
    """A test double: a copy whose completion the test decides."""

    def __init__(self, part: Part, layer: int, nbytes: int) -> None:
        super().__init__(Direction.D2H, part, layer, nbytes)
        self.state = TicketState.PENDING

    def query(self) -> TicketState:
        return self.state

    def wait(self) -> None:
        pass

    def make_compute_wait(self) -> None:
        pass


def test_a_layer_of_several_copies_lands_when_the_last_one_does() -> None:
    """A layer may be copied by several submissions (e.g. one per run): it
    counts as landed only once none of them is in flight."""
    layout = Config(model="tiny").layout()
    page_bytes = layout.part(Part.TARGET_KV).page_bytes
    pages = np.array([1, 2, 3, 4], np.int64)
    op = BackupOp(layout, pages, pages, 0)
    first, second = _Ticket(Part.TARGET_KV, 0, 2 * page_bytes), _Ticket(Part.TARGET_KV, 0, 2 * page_bytes)
    op.record_submit(Part.TARGET_KV, 0, [first, second])
    assert op.error is None
    first.state = TicketState.DONE
    op.reap()
    assert 0 not in op.landed[Part.TARGET_KV], "landed with half of its pages still in flight"
    second.state = TicketState.DONE
    op.reap()
    assert 0 in op.landed[Part.TARGET_KV]


@pytest.mark.parametrize("fault", ["a-part-short", "a-layer-short"])
def test_a_whole_op_recorded_at_once_needs_one_ticket_per_part_of_every_layer(fault: str) -> None:
    """`record_layers` (the all-layer paths): tickets for every part of every layer land
    the op; a layer with a ticket missing for one part, or a layer missing from the
    engine's answer, is a ConsistencyError naming it and the op never lands."""
    layout = Config(model="tiny").layout()
    pages = np.array([1, 2, 3], np.int64)
    op = LoadOp(layout, pages, pages, 0)
    jobs = op.all_layers()
    assert [layer for _, layer in jobs] == [0, 1, 2, 3, 0]  # target layers, then the draft's
    tickets = [[_Ticket(p, layer, 3 * layout.part(p).page_bytes) for p in parts] for parts, layer in jobs]
    whole = LoadOp(layout, pages, pages, 0)
    whole.record_layers(jobs, tickets)
    assert whole.error is None and whole.all_submitted()
    assert whole.by_layer[(Part.TARGET_STATE, 2)] == [tickets[2][1]]
    if fault == "a-part-short":
        tickets[2] = tickets[2][:1]  # layer 2 owns KV and state: the state's ticket is missing
    else:
        tickets = tickets[:-1]  # the draft layer is missing
    op.record_layers(jobs, tickets)
    assert isinstance(op.error, ConsistencyError)
    assert op.error.layer == (2 if fault == "a-part-short" else None)
    for t in (t for per_part in tickets for t in per_part):
        t.state = TicketState.DONE
    assert not op.local_vote().ok and not op.all_landed()


@pytest.mark.parametrize("model", list(Model))
def test_a_layer_wait_covers_every_part_of_the_layer(make_cache, model: Model) -> None:
    """The forward reads a layer's KV and its state (the NSA indexer keys) together:
    `wait_layer` returns only once every part of the model at that layer is loaded,
    even when the last part's copy is slow."""
    slow_part = [p for p in Part if p.model is model][-1]  # the state part: copied after the KV part

    def slow_copy(direction: Direction, part: Part, layer: int) -> None:
        if (direction, part, layer) == (Direction.H2D, slow_part, 0):
            time.sleep(0.3)

    cache = make_cache()
    tokens = tokens_of(1, 2, 3)
    run_request(cache, tokens, write=fill_pattern)  # computed and backed up
    evict_all_l1(cache)  # the freed pages are poisoned (debug checks): only the load brings the bytes back
    cache.engine.fault = slow_copy
    r = run_request(cache, tokens, stop_after="load")
    assert r.load is not None and r.load.first_position == 0
    r.load.wait_layer(0, model)
    for p in cache.layout.parts_of(model):
        if not p.has_layer(0):
            continue
        view = cache.device_pool.layer_view(p.part, p.slot(0))
        for pos, page in enumerate(r.load.device_pages):
            assert (view[page] == expected_bytes(tokens, pos, p.part, 0, p.page_bytes)).all(), (p.part, pos)
    land(cache)
    assert r.load.state is LoadState.DONE
