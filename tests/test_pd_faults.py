"""PD faults: each test fails on one fault of the transfer rules (docs/invariants.md rules 8-9).

Real Mooncake TransferEngine between processes on 127.0.0.1 (a decode peer
process per module, its own for the kill tests). What each asserts:

* positions that do not fit a room fail it (never truncated);
* finish checks every part and layer for every owned position, and a room
  that fails it is aborted, never "done" (the decode peer never verifies it);
* a destination gone on "done" concludes FAILED with a WARNING;
* exact page counts: the decode side refuses a room whose page count is not
  what the prompt needs, and a reply of the wrong length fails the room;
* abort from either side (decode cancel, prefill abort, peer killed, deadline):
  no page is released while a write can land, every page comes back, and a
  later request's bytes verify;
* an abort of an unknown room is logged and counted on the decode side;
* the registration summary is logged at INFO; the partition dump is logging only.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from test_pd import AUTHKEY, DECODE_PAGES, Prefill, needs_mooncake, one_sender, stats, tiny_layout  # noqa: E402

from hicache_cp.errors import ConsistencyError  # noqa: E402
from hicache_cp.layout import Part  # noqa: E402
from hicache_cp.pd.engine import TransferError  # noqa: E402
from hicache_cp.pd.room import Room, RoomFailed, RoomState  # noqa: E402

pytestmark = [needs_mooncake, pytest.mark.mooncake]
DRAIN_S = 30.0  # decode side: long enough that only an acknowledgement frees an aborted room in these tests


@pytest.fixture(scope="module")
def decode_peer():
    from hicache_harness.decode_peer import spawn_decode_peer

    proc, address = spawn_decode_peer(tiny_layout(), DECODE_PAGES, AUTHKEY, drain_s=DRAIN_S)
    yield address
    proc.terminate()
    proc.join(10)


@pytest.fixture(scope="module")
def adapter():
    from hicache_cp.pd.engine import TransferEngineAdapter

    eng = TransferEngineAdapter()
    yield eng
    eng.close()


def _all_layers(s, room_id, homes, skip=()):
    for p in s.layout.parts:
        for layer in p.layer_ids:
            if (p.part, layer) not in skip:
                s.send_layer(room_id, p.part, layer, homes)


def _later_request_verifies(pre, s, room_id, rng, n=7) -> None:
    homes = pre.request(n, rng)
    s.open_room(room_id, room_id, n)
    s.send(room_id, homes)
    res = s.finish(room_id)
    assert res.ok, res.failure


# -- exact contracts (issue 29 class 7) ----------------------------------------------
def test_positions_beyond_the_room_fail_it_never_truncate(decode_peer, adapter) -> None:
    """A 6-page request into a 4-page room: the send raises and the room is FAILED
    (a send that kept the 4 fitting pages would end SUCCESS with 4 pages)."""
    from hicache_cp.pd.sender import PageHomes

    rng = np.random.default_rng(21)
    with one_sender(decode_peer, adapter) as (pre, s):
        before = stats(decode_peer)
        homes = pre.request(6, rng)
        released: list[Room] = []
        s.open_room(1000, 1000, 4, release=released.append)
        with pytest.raises(ValueError, match="outside the request's 4 pages"):
            s.send(1000, homes)
        assert s.rooms.get(1000).state is RoomState.FAILED and "nothing is truncated" in s.rooms.get(1000).failure
        assert len(released) == 1 and released[0].state is RoomState.FAILED
        with pytest.raises(RoomFailed):  # the 4 pages that fit are not sent afterwards either
            s.send(1000, PageHomes(homes.positions[:4], homes.tier[:4], homes.pages[:4], homes.prefix_hashes[:4]))
        res = s.finish(1000)
        assert not res.ok and res.nbytes == 0
        after = stats(decode_peer)
        assert after["verified_rooms"] == before["verified_rooms"]  # never said "done"
        assert after["free_pages"] == before["free_pages"] and 1000 not in after["draining"]


@pytest.mark.parametrize("gap", ["a layer", "a position"])
def test_finish_checks_every_part_and_layer_for_every_position(decode_peer, adapter, gap: str) -> None:
    """finish() itself refuses partial KV: one layer of one part missing, or one
    position missing from every part and layer. The room is aborted, so a decode
    server that trusts "done" never sees it (our peer's verification count stays)."""
    from hicache_cp.pd.sender import PageHomes

    rng = np.random.default_rng(22)
    with one_sender(decode_peer, adapter) as (pre, s):
        before = stats(decode_peer)
        homes = pre.request(9, rng)
        room_id = 1100 if gap == "a layer" else 1101
        s.open_room(room_id, room_id, 9)
        if gap == "a layer":
            _all_layers(s, room_id, homes, skip={(Part.DRAFT_STATE, 0)})
        else:  # every part and layer of positions 0..7: consistent among themselves, short of the room
            _all_layers(s, room_id, PageHomes(homes.positions[:8], homes.tier[:8], homes.pages[:8],
                                              homes.prefix_hashes[:8]))
        res = s.finish(room_id)
        assert res.state is RoomState.FAILED
        assert res.failure.startswith("all-or-nothing:"), res.failure
        assert ("draft_state layer 0 sent 0 of the 9" if gap == "a layer" else "sent 8 of the 9") in res.failure
        after = stats(decode_peer)
        assert after["verified_rooms"] == before["verified_rooms"]  # "abort", never "done"
        assert after["free_pages"] == before["free_pages"]


class _FaultedEvent:
    """A test double of the CUDA event a layer hook passes as `after`, whose wait
    reports an asynchronous fault of the forward (as `torch.cuda.Event.synchronize`
    raises one)."""

    def synchronize(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_per_layer_send_that_fails_on_the_feeder_fails_the_room(decode_peer, adapter) -> None:
    """Per-layer sends run on the feeder thread after the layer's event; one that fails
    there (the layer's KV may be garbage) fails the room at finish, never "done"."""
    rng = np.random.default_rng(23)
    with one_sender(decode_peer, adapter) as (pre, s):
        before = stats(decode_peer)
        homes = pre.request(6, rng)
        s.open_room(1150, 1150, 6)
        for p in s.layout.parts:
            for layer in p.layer_ids:
                after = _FaultedEvent() if (p.part, layer) == (Part.TARGET_KV, 1) else None
                s.send_layer(1150, p.part, layer, homes, after=after, background=True)
        res = s.finish(1150)
        assert res.state is RoomState.FAILED
        assert "per-layer submission failed: CUDA error: an illegal memory access" in res.failure, res.failure
        assert stats(decode_peer)["verified_rooms"] == before["verified_rooms"]  # "abort", never "done"
        _later_request_verifies(pre, s, 1151, rng)


def test_destination_gone_on_done_concludes_failed_loudly(adapter, caplog: pytest.LogCaptureFixture) -> None:
    """Every byte landed, then the decode peer dies: the "done" gets no answer.
    The room concludes FAILED with a WARNING, never SUCCESS."""
    from hicache_harness.decode_peer import spawn_decode_peer

    layout = tiny_layout()
    proc, address = spawn_decode_peer(layout, DECODE_PAGES, AUTHKEY)
    rng = np.random.default_rng(23)
    try:
        with one_sender(address, adapter, layout) as (pre, s):
            homes = pre.request(5, rng)
            released: list[Room] = []
            room = s.open_room(1200, 1200, 5, release=released.append)
            s.send(1200, homes)
            for batch in room.in_flight:
                adapter.wait(batch, timeout=10)  # the bytes are at the destination
            proc.kill()
            proc.join(10)
            with caplog.at_level(logging.WARNING, logger="hicache_cp.pd.room"):
                res = s.finish(1200)
            assert res.state is RoomState.FAILED
            assert "no destination and transfer not complete" in res.failure
            assert "connection lost on done" in res.failure
            assert any(r.levelno == logging.WARNING and "no destination" in r.message for r in caplog.records)
            assert [r.state for r in released] == [RoomState.FAILED]
    finally:
        if proc.is_alive():
            proc.kill()


def test_exact_page_counts_both_ways(decode_peer, adapter, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode side needs exactly the prompt's pages; a reply with another
    count fails the room with both numbers."""
    with one_sender(decode_peer, adapter) as (pre, s):
        free = stats(decode_peer)["free_pages"]
        ps = pre.layout.page_size
        with pytest.raises(TransferError, match="needs exactly 6 pages here.*offered 4"):
            s.open_room(1300, 1300, 4, prompt_tokens=6 * ps)
        assert s.rooms.get(1300).state is RoomState.FAILED
        real = s._request

        def short_reply(msg, timeout):  # type: ignore[no-untyped-def]
            reply = real(msg, timeout)
            if msg["op"] == "open":
                reply["dst_pages"] = reply["dst_pages"][:-1]
            return reply

        monkeypatch.setattr(s, "_request", short_reply)
        with pytest.raises(ConsistencyError, match="wrong number of pages") as err:
            s.open_room(1301, 1301, 4)
        assert err.value.details == {"room": 1301, "asked": 4, "got": 3}
        assert s.rooms.get(1301).state is RoomState.FAILED
        after = stats(decode_peer)
        assert after["free_pages"] == free and 1301 not in after["rooms"] + after["draining"]  # told to give it back


# -- abort from either side, drain before reclaim ----------------------------------
def test_decode_abort_mid_room_holds_pages_until_prefill_drained(decode_peer, adapter) -> None:
    from hicache_harness.decode_peer import control_request

    rng = np.random.default_rng(24)
    with one_sender(decode_peer, adapter) as (pre, s):
        free = stats(decode_peer)["free_pages"]
        homes = pre.request(11, rng)
        released: list[Room] = []
        s.open_room(1400, 1400, 11, release=released.append)
        s.send_layer(1400, Part.TARGET_KV, 0, homes)
        assert control_request(decode_peer, AUTHKEY, {"op": "cancel", "room": 1400, "reason": "user"})["known"]
        mid = stats(decode_peer)
        # The decode side failed the room but keeps its pages: prefill may still be writing.
        assert 1400 in mid["draining"] and mid["free_pages"] == free - 11
        time.sleep(0.2)  # the event is on its way
        with pytest.raises(RoomFailed, match="decode aborted: cancelled by decode: user"):
            s.send_layer(1400, Part.TARGET_KV, 1, homes)  # learned at the next chunk
        assert [r.state for r in released] == [RoomState.FAILED] and s.decode_aborts == 1
        assert adapter.in_flight(s.peer) == 0  # drained before the release and the acknowledgement
        after = stats(decode_peer)
        assert after["free_pages"] == free and after["draining"] == []  # reclaimed once prefill said so
        assert not s.finish(1400).ok
        _later_request_verifies(pre, s, 1401, rng)


def test_prefill_abort_mid_room_drains_before_release(decode_peer, adapter) -> None:
    rng = np.random.default_rng(25)
    with one_sender(decode_peer, adapter) as (pre, s):
        free = stats(decode_peer)["free_pages"]
        homes = pre.request(13, rng)
        in_flight_at_release: list[int] = []

        def release(room: Room) -> None:
            in_flight_at_release.append(sum(not b.done for b in room.in_flight) + adapter.in_flight(s.peer))

        s.open_room(1500, 1500, 13, release=release)
        _all_layers(s, 1500, homes, skip={(Part.DRAFT_KV, 0)})
        s.abort(1500, "request cancelled on prefill")
        assert in_flight_at_release == [0]  # released only once nothing can land
        room = s.rooms.get(1500)
        assert room.state is RoomState.FAILED and room.released and not room.draining
        with pytest.raises(RoomFailed):
            s.send_layer(1500, Part.DRAFT_KV, 0, homes)
        after = stats(decode_peer)
        assert after["free_pages"] == free and after["draining"] == []
        _later_request_verifies(pre, s, 1501, rng)


def test_expired_room_refuses_the_next_chunk_at_once(decode_peer, adapter) -> None:
    rng = np.random.default_rng(26)
    with one_sender(decode_peer, adapter, timeout_s=0.4) as (pre, s):
        free = stats(decode_peer)["free_pages"]
        homes = pre.request(4, rng)
        s.open_room(1600, 1600, 4)
        s.send_layer(1600, Part.TARGET_KV, 0, homes)
        time.sleep(0.5)  # no poll(): the chunk itself must be refused
        with pytest.raises(RoomFailed, match="timeout after 0.4 s"):
            s.send_layer(1600, Part.TARGET_KV, 1, homes)
        room = s.rooms.get(1600)
        assert room.state is RoomState.FAILED and room.released
        assert room.sent.get((Part.TARGET_KV, 1)) is None  # nothing of it was recorded or sent
        assert stats(decode_peer)["free_pages"] == free


def test_decode_peer_killed_mid_room_reclaims_and_a_new_peer_verifies(adapter) -> None:
    from hicache_harness.decode_peer import spawn_decode_peer

    layout = tiny_layout()
    proc, address = spawn_decode_peer(layout, DECODE_PAGES, AUTHKEY)
    rng = np.random.default_rng(27)
    try:
        with one_sender(address, adapter, layout, timeout_s=3.0, drain_s=5.0) as (pre, s):
            homes = pre.request(20, rng)
            released: list[Room] = []
            s.open_room(1700, 1700, 20, release=released.append)
            s.send_layer(1700, Part.TARGET_KV, 0, homes)
            proc.kill()
            proc.join(5)
            try:
                _all_layers(s, 1700, homes, skip={(Part.TARGET_KV, 0)})
                assert s.finish(1700).state is RoomState.FAILED
            except RoomFailed:  # the engine may refuse a submission outright
                pass
            deadline = time.monotonic() + 40  # Mooncake's own TCP timeout bounds the drain
            while not released and time.monotonic() < deadline:
                s.poll()
                time.sleep(0.2)
            assert [r.state for r in released] == [RoomState.FAILED]
            assert all(b.done for b in released[0].in_flight)
    finally:
        if proc.is_alive():
            proc.kill()
    proc2, address2 = spawn_decode_peer(layout, DECODE_PAGES, AUTHKEY)
    try:
        with one_sender(address2, adapter, layout) as (pre, s):
            _later_request_verifies(pre, s, 1701, rng)
    finally:
        proc2.terminate()
        proc2.join(10)


def test_abort_of_an_unknown_room_is_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    from hicache_harness.decode_peer import DecodePeer, control_request

    peer = DecodePeer(tiny_layout(), 8, authkey=AUTHKEY)
    peer.start()
    try:
        with caplog.at_level(logging.WARNING, logger="hicache_harness.decode_peer"):
            reply = control_request(peer.address, AUTHKEY, {"op": "abort", "room": 4242, "reason": "stale"})
        assert reply["ok"] and reply["known"] is False
        assert peer.unknown_aborts == 1
        assert control_request(peer.address, AUTHKEY, {"op": "stats"})["unknown_aborts"] == 1
        assert any("abort of unknown room 4242" in r.message for r in caplog.records)
    finally:
        peer.close()


# -- logging -------------------------------------------------------------------------
def test_registration_summary_and_partition_dump(decode_peer, adapter, caplog: pytest.LogCaptureFixture) -> None:
    """INFO on connect: buffer counts per part, the draft state's start index,
    logical layer ids. The partition dump (DEBUG on hicache_cp.pd.partition)
    lists each part's positions, sources and decode pages and changes nothing."""
    rng = np.random.default_rng(28)
    results = []
    for dump in (False, True):
        caplog.clear()
        level = logging.DEBUG if dump else logging.INFO
        with caplog.at_level(logging.INFO, logger="hicache_cp.pd.session"), \
                caplog.at_level(level, logger="hicache_cp.pd.partition"):
            with one_sender(decode_peer, adapter) as (pre, s):
                homes = pre.request(5, np.random.default_rng(29))
                s.open_room(1800 + dump, 1800 + dump, 5)
                s.send(1800 + dump, homes)
                results.append(s.finish(1800 + dump))
        summary = [r.message for r in caplog.records if r.name == "hicache_cp.pd.session"]
        assert any("L2: kv buffers 4 (draft kv at 3, 1), state buffers 3 (draft state at 2, 1)" in m
                   and "target_state 2 buffers layers [0, 2]" in m for m in summary), summary
        dumps = [r.message for r in caplog.records if r.name == "hicache_cp.pd.partition"]
        if not dump:
            assert dumps == []
            continue
        assert len(dumps) == len(pre.layout.parts)
        tkv = next(m for m in dumps if " target_kv " in m)
        assert "positions [0, 1, 2, 3, 4]" in tkv and "decode pages" in tkv
        sources = [f"{'L1' if t == 0 else 'L2'}:{g}" for t, g in zip(homes.tier, homes.pages)]
        assert str(sources) in tkv
    assert all(r.ok for r in results)
    assert results[0].bytes_per_part == results[1].bytes_per_part
    assert results[0].descriptors_per_part == results[1].descriptors_per_part
    del rng
