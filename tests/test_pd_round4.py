"""PD faults the tests let through before (issue 48, item 6): drain before reclaim
and "abort, never done", each against the real Mooncake TransferEngine and a
decode peer process on 127.0.0.1.

The engine is the real one; a test double wraps it (`_Engine`) only to hold a
batch's completion (its status call waits on a gate, as a slow network would)
or to refuse one submission (as a full engine queue does). What each asserts:

* a sender-level abort whose batch outlives the drain tells decode "abort" only
  once that batch ended (decode frees the pages the batch still writes into);
* a room aborted while its per-layer jobs wait behind a slow event gets no batch
  after the abort;
* an engine that refuses the submission of a synchronous send fails the room at
  once: "abort", never "done";
* under CP, a page of another rank's lane is refused as a contract violation
  (pure planning, no engine);
* a room whose submission was split into several engine batches stays draining
  until every one of them ended;
* a submission refused after some of its engine batches went out: the room keeps
  those batches, so the abort waits for them before it releases the pages and
  tells decode.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from test_pd import AUTHKEY, DECODE_PAGES, Prefill, needs_mooncake, one_sender, stats, tiny_layout  # noqa: E402

from hicache_cp.errors import ConsistencyError  # noqa: E402
from hicache_cp.layout import Part  # noqa: E402
from hicache_cp.pd.room import RoomFailed, RoomState, RoomTable  # noqa: E402

DRAIN_S = 0.05  # the sender's inline drain: far shorter than the batches these tests hold


class _Engine:
    """The adapter's TransferEngine, with submissions that can be refused and
    completions that can be held (a test double around the real engine)."""

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        self._engine = engine
        self.submissions = 0  # batch_transfer_async_write calls so far
        self.refuse: set[int] = set()  # submission numbers (1-based) answered with 0, refused
        self.hold_from: int | None = None  # hold the completion of this submission and every later one
        self.gate = threading.Event()
        self._held: set[int] = set()

    def batch_transfer_async_write(self, peer, srcs, dsts, lens):  # type: ignore[no-untyped-def]
        self.submissions += 1
        if self.submissions in self.refuse:
            return 0
        bid = self._engine.batch_transfer_async_write(peer, srcs, dsts, lens)
        if self.hold_from is not None and self.submissions >= self.hold_from:
            self._held.add(bid)
        return bid

    def get_batch_transfer_status(self, ids):  # type: ignore[no-untyped-def]
        if self._held.intersection(ids):
            self.gate.wait(30)
        return self._engine.get_batch_transfer_status(ids)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._engine, name)


def _control_ops(sender) -> list[str]:  # type: ignore[no-untyped-def]
    """The ops the sender sends to the decode peer from now on, in order."""
    ops: list[str] = []
    real = sender._request

    def request(msg, timeout):  # type: ignore[no-untyped-def]
        ops.append(msg["op"])
        return real(msg, timeout)

    sender._request = request
    return ops


def _until(cond, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def decode_peer() -> Iterator[tuple[str, int]]:
    from hicache_harness.decode_peer import spawn_decode_peer

    proc, address = spawn_decode_peer(tiny_layout(), DECODE_PAGES, AUTHKEY)
    yield address
    proc.terminate()
    proc.join(10)


@pytest.fixture(scope="module")
def adapter():  # type: ignore[no-untyped-def]
    from hicache_cp.pd.engine import TransferEngineAdapter

    eng = TransferEngineAdapter()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def small_cap_adapter():  # type: ignore[no-untyped-def]
    """An adapter that splits a submission into engine batches of two transfers."""
    from hicache_cp.pd.engine import TransferEngineAdapter

    eng = TransferEngineAdapter(max_in_flight=2)
    yield eng
    eng.close()


@pytest.fixture
def engine(request, monkeypatch):  # type: ignore[no-untyped-def]
    """`_Engine` around the adapter the test names first (`adapter` unless it asks for the small one)."""
    name = "small_cap_adapter" if "small_cap_adapter" in request.fixturenames else "adapter"
    adapter = request.getfixturevalue(name)
    eng = _Engine(adapter.engine)
    monkeypatch.setattr(adapter, "engine", eng)
    yield eng
    eng.gate.set()


def _scattered(pre: Prefill, n: int, rng: np.random.Generator):  # type: ignore[no-untyped-def]
    """A request of n L1 pages, none consecutive: one descriptor per page, part and layer."""
    from hicache_cp.cp import mapping as cp_mapping
    from hicache_harness import integrity
    from hicache_cp.pd.sender import PageHomes

    phys = np.arange(1, 2 * n, 2, dtype=np.int64)[:n]
    hashes = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64)
    for i in range(n):
        for p in pre.layout.parts:
            for slot, layer in enumerate(p.layer_ids):
                pre.l1[0].layer_view(p.part, slot)[phys[i]] = integrity.content(hashes[i:i + 1], p.part, layer,
                                                                                p.page_bytes)[0]
    return PageHomes(np.arange(n), np.zeros(n, np.int8), cp_mapping.to_logical(phys, 0, 1), hashes)


@needs_mooncake
@pytest.mark.mooncake
def test_an_abort_whose_batch_outlives_the_drain_tells_decode_only_after_it_ended(decode_peer, adapter,
                                                                                  engine) -> None:
    rng = np.random.default_rng(41)
    with one_sender(decode_peer, adapter, drain_s=DRAIN_S) as (pre, s):
        free = stats(decode_peer)["free_pages"]
        homes = pre.request(5, rng)
        s.open_room(4100, 4100, 5)
        ops = _control_ops(s)
        engine.hold_from = engine.submissions + 1
        s.send(4100, homes)
        s.abort(4100, "request cancelled")  # the drain gives up: the batch is still writing
        room = s.rooms.get(4100)
        assert room.state is RoomState.FAILED and room.draining and not room.released
        assert "abort" not in ops, "decode was told to free pages a batch still writes into"
        assert 4100 in stats(decode_peer)["rooms"]  # decode still holds them
        s.poll()
        assert "abort" not in ops
        engine.gate.set()
        _until(lambda: all(b.done for b in room.in_flight))
        s.poll()  # drained: released, and now decode is told
        assert room.released and ops.count("abort") == 1
        after = stats(decode_peer)
        assert after["free_pages"] == free and 4100 not in after["rooms"] + after["draining"]


class _SlowEvent:
    """The CUDA event a layer hook passes as `after`, completing when the test says so."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def synchronize(self) -> None:
        self.gate.wait(30)


@needs_mooncake
@pytest.mark.mooncake
def test_a_room_aborted_while_its_layer_jobs_wait_gets_no_batch_after(decode_peer, adapter, engine) -> None:
    rng = np.random.default_rng(42)
    slow = threading.Event()
    with one_sender(decode_peer, adapter) as (pre, s):
        homes = pre.request(6, rng)
        s.open_room(4200, 4200, 6)
        for p in s.layout.parts:
            for layer in p.layer_ids:  # every job queued on the feeder behind the first layer's event
                s.send_layer(4200, p.part, layer, homes, after=_SlowEvent(slow))
        before = engine.submissions
        s.abort(4200, "request cancelled")
        slow.set()
        assert s._feeder.flush(20)
        assert engine.submissions == before, "a layer of an aborted room was submitted after the abort"
        room = s.rooms.get(4200)
        assert room.state is RoomState.FAILED and room.released and room.in_flight == []
        assert not s.finish(4200).ok


@needs_mooncake
@pytest.mark.mooncake
def test_a_refused_submission_of_a_synchronous_send_fails_the_room_never_done(decode_peer, adapter,
                                                                               engine) -> None:
    rng = np.random.default_rng(43)
    with one_sender(decode_peer, adapter) as (pre, s):
        before = stats(decode_peer)
        homes = pre.request(4, rng)
        s.open_room(4300, 4300, 4)
        ops = _control_ops(s)
        engine.refuse = {engine.submissions + 1}
        with pytest.raises(RoomFailed, match="engine refused batch 1 of 1"):
            s.send(4300, homes)
        room = s.rooms.get(4300)
        assert room.state is RoomState.FAILED and room.released
        res = s.finish(4300)
        assert not res.ok and "done" not in ops and ops.count("abort") == 1
        after = stats(decode_peer)
        assert after["verified_rooms"] == before["verified_rooms"]  # never verified: never "done"
        assert after["free_pages"] == before["free_pages"]


def test_under_cp_a_page_of_another_ranks_lane_is_a_contract_violation() -> None:
    """Rank 0 of 2 owns positions 0, 2, 4...; their pages must come from lane 0. A page
    of lane 1 at position 2 is refused (planning changes nothing), never sent."""
    from hicache_cp.cp import mapping as cp_mapping
    from hicache_cp.pd.plan import L1, PageHomes, plan_transfer
    from hicache_cp.pd.registration import RegistrationDescriptor

    layout = tiny_layout()
    src = {L1: RegistrationDescriptor.from_buffers("L1", layout, {p.part: 1 << 30 for p in layout.parts}, 32)}
    dest = RegistrationDescriptor.from_buffers("decode", layout, {p.part: 1 << 40 for p in layout.parts}, 64)
    room = RoomTable().open(1, 1, 4)
    room.transition(RoomState.TRANSFERRING)
    room.dst_pages = np.arange(10, 14)

    def homes(lanes: list[int]) -> PageHomes:
        pages = np.concatenate([cp_mapping.to_logical(np.array([3 + i]), lane, 2) for i, lane in enumerate(lanes)])
        return PageHomes(np.array([0, 2]), np.zeros(2, np.int8), pages, np.array([7, 8], np.uint64))

    kw = dict(rank=0, cp_size=2, chunk_first_position=None)
    plan = plan_transfer(layout, src, {L1: 32}, dest, room, homes([0, 0]), None, **kw)
    assert plan.positions.tolist() == [0, 2]
    with pytest.raises(ConsistencyError, match="not owned by the rank") as err:
        plan_transfer(layout, src, {L1: 32}, dest, room, homes([0, 1]), None, **kw)
    assert err.value.rank == 0 and list(err.value.details["positions"]) == [2]
    assert room.sent == {}


@needs_mooncake
@pytest.mark.mooncake
def test_a_room_split_into_engine_batches_drains_until_every_one_ended(decode_peer, small_cap_adapter,
                                                                      engine) -> None:
    rng = np.random.default_rng(44)
    with one_sender(decode_peer, small_cap_adapter, drain_s=DRAIN_S) as (pre, s):
        free = stats(decode_peer)["free_pages"]
        homes = _scattered(pre, 3, rng)
        s.open_room(4400, 4400, 3)
        n = len(s.plan(4400, homes).lens)
        parts = -(-n // small_cap_adapter.max_in_flight)
        assert parts >= 3
        engine.hold_from = engine.submissions + parts  # the last engine batch of the send stays in flight
        s.send(4400, homes)
        (batch,) = s.rooms.get(4400).in_flight
        assert len(batch.parts) == parts and not batch.done
        s.abort(4400, "request cancelled")
        room = s.rooms.get(4400)
        assert [p.status is not None for p in batch.parts] == [True] * (parts - 1) + [False]
        assert room.draining and not room.released, "released while one of its engine batches was in flight"
        s.poll()
        assert not room.released
        engine.gate.set()
        _until(lambda: batch.done)
        s.poll()
        assert room.released
        assert stats(decode_peer)["free_pages"] == free


@needs_mooncake
@pytest.mark.mooncake
def test_a_submission_refused_part_way_keeps_what_went_out_until_it_ended(decode_peer, small_cap_adapter,
                                                                         engine, monkeypatch) -> None:
    """More transfers than one engine batch takes; the engine refuses the second one
    while the first is in flight (here held; the adapter's cap makes it wait for the
    first before submitting the second today, which this contract must not rely on:
    the wait is patched out). The room keeps the first, so the abort neither releases
    the pages nor tells decode before it ended."""
    monkeypatch.setattr(small_cap_adapter, "_make_room", lambda peer, n: None)
    rng = np.random.default_rng(45)
    with one_sender(decode_peer, small_cap_adapter, drain_s=DRAIN_S) as (pre, s):
        free = stats(decode_peer)["free_pages"]
        homes = _scattered(pre, 2, rng)
        s.open_room(4500, 4500, 2)
        ops = _control_ops(s)
        engine.hold_from = engine.submissions + 1
        engine.refuse = {engine.submissions + 2}
        with pytest.raises(RoomFailed, match="engine refused batch 2 of"):
            s.send(4500, homes)
        room = s.rooms.get(4500)
        assert room.state is RoomState.FAILED
        assert room.draining and not room.released, "released while its first engine batch was in flight"
        assert "abort" not in ops and 4500 in stats(decode_peer)["rooms"]
        engine.gate.set()
        _until(lambda: all(b.done for b in room.in_flight))
        s.poll()
        assert room.released and ops.count("abort") == 1
        assert stats(decode_peer)["free_pages"] == free
