"""PD transfer: real Mooncake TransferEngine between processes on 127.0.0.1.

One decode peer process and one sender-side engine serve the whole module
(each engine teardown costs about a second); the peer-killed test spawns its
own peer. Every transfer is verified byte for byte by the decode peer
against `integrity.content`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from hicache_cp.cp import mapping as cp_mapping
from hicache_harness import integrity  # noqa: E402
from hicache_cp.errors import IllegalTransition  # noqa: E402
from hicache_cp.layout import KVLayout, Part  # noqa: E402
from hicache_cp.pd.registration import RegistrationDescriptor, RegistrationMismatch, check_compatible  # noqa: E402
from hicache_cp.pd.room import Room, RoomFailed, RoomState, RoomTable  # noqa: E402

try:
    import mooncake.engine  # noqa: F401

    HAVE_MOONCAKE = True
except ImportError as exc:  # pragma: no cover - depends on the machine
    HAVE_MOONCAKE = False
    MOONCAKE_REASON = f"mooncake.engine cannot be imported ({exc}); pip install mooncake-transfer-engine-non-cuda"

needs_mooncake = pytest.mark.skipif(not HAVE_MOONCAKE, reason=MOONCAKE_REASON if not HAVE_MOONCAKE else "")

PAGES = 64  # physical pages per pool
DECODE_PAGES = 256
AUTHKEY = os.urandom(32)


def tiny_layout(draft_state: bool = True, state_layers: tuple[int, ...] = (0, 2)) -> KVLayout:
    return KVLayout.build(page_size=4, num_layers=3, kv_bytes_per_token=64, state_bytes_per_token=16,
                          state_layers=state_layers, draft_layers=1, draft_kv_bytes_per_token=64,
                          draft_state_bytes_per_token=16 if draft_state else 0)


# -- pure units (no engine) ----------------------------------------------------------
def test_room_transitions_are_checked() -> None:
    released: list[Room] = []
    table = RoomTable(timeout_s=5)
    room = table.open(1, 10, 4, release=released.append)
    with pytest.raises(IllegalTransition):
        room.transition(RoomState.SUCCESS)  # BOOTSTRAPPING -> SUCCESS skips TRANSFERRING
    room.transition(RoomState.TRANSFERRING)
    room.check_invariants()
    table.poll(now=room.deadline + 1)  # past the deadline -> FAILED, released once
    assert room.state is RoomState.FAILED and room.failure == "timeout after 5 s"
    assert released == [room]
    with pytest.raises(RoomFailed):
        room.require_open()
    room.fail("again")  # a second failure keeps the first reason, no second release
    assert room.failure == "timeout after 5 s" and released == [room]
    room.check_invariants()


def test_no_destination_concludes_failed(caplog: pytest.LogCaptureFixture) -> None:
    room = RoomTable().open(2, 20, 4)
    with caplog.at_level("WARNING"):
        room.conclude_without_destination()
    assert room.state is RoomState.FAILED and "no destination" in (room.failure or "")
    assert any("no destination" in r.message for r in caplog.records)


def test_check_compatible_lists_both_sides() -> None:
    a = RegistrationDescriptor.from_buffers("L2", tiny_layout(), {p: 1 << 20 for p in Part}, 8)
    b = RegistrationDescriptor.from_buffers("decode", tiny_layout(draft_state=False, state_layers=(0, 1)),
                                            {p: 1 << 30 for p in Part}, 16)
    assert RegistrationDescriptor.from_json(a.to_json()) == a
    assert (a.draft_state_start, a.draft_state_count, b.draft_state_count) == (2, 1, 0)
    with pytest.raises(RegistrationMismatch) as err:
        check_compatible(a, b)
    diffs = {what: (x, y) for what, x, y in err.value.differences}
    assert diffs["target_state layer_ids"] == ([0, 2], [0, 1])
    assert diffs["draft_state registered"] == (True, False)
    assert diffs["draft_state_count"] == (1, 0)
    check_compatible(a, RegistrationDescriptor.from_buffers("decode", tiny_layout(), {p: 0 for p in Part}, 99))
    # A decode side that stores the target KV narrower (fp8 against bf16): every count
    # agrees, only the page size tells them apart.
    fp8 = KVLayout.build(page_size=4, num_layers=3, kv_bytes_per_token=32, state_bytes_per_token=16,
                         state_layers=(0, 2), draft_layers=1, draft_kv_bytes_per_token=64,
                         draft_state_bytes_per_token=16)
    with pytest.raises(RegistrationMismatch) as err:
        check_compatible(a, RegistrationDescriptor.from_buffers("decode", fp8, {p: 1 << 20 for p in Part}, 8))
    assert err.value.differences == [("target_kv page_bytes", 256, 128)]


# -- engine-backed ------------------------------------------------------------------
@pytest.fixture(scope="module")
def decode_peer():
    from hicache_harness.decode_peer import spawn_decode_peer

    proc, address = spawn_decode_peer(tiny_layout(), DECODE_PAGES, AUTHKEY)
    yield address
    proc.terminate()
    proc.join(10)


@pytest.fixture(scope="module")
def adapter():
    from hicache_cp.pd.engine import TransferEngineAdapter

    eng = TransferEngineAdapter()
    yield eng
    eng.close()


def stats(address) -> dict:
    from hicache_harness.decode_peer import control_request

    return control_request(address, AUTHKEY, {"op": "stats"})


class Prefill:
    """One CP group's pools (every rank) with deterministic content written in."""

    def __init__(self, layout: KVLayout, cp_size: int = 1) -> None:
        from hicache_cp.pools import DevicePool, HostPool

        self.layout = layout
        self.cp_size = cp_size
        self.l1 = [DevicePool(layout, PAGES, cp_size=cp_size, rank=r) for r in range(cp_size)]
        self.l2 = [HostPool(layout, layout.bytes_per_page * PAGES, cp_size=cp_size, rank=r, pin=False)
                   for r in range(cp_size)]

    def request(self, n: int, rng: np.random.Generator, tiers: np.ndarray | None = None):
        """PageHomes for positions 0..n-1: random tiers, random (sorted) pages per lane, content written."""
        from hicache_cp.pd.sender import PageHomes

        pos = np.arange(n, dtype=np.int64)
        tier = rng.integers(0, 2, n) if tiers is None else np.asarray(tiers)
        pages = np.zeros(n, dtype=np.int64)
        for t in (0, 1):
            for r in range(self.cp_size):
                sel = (tier == t) & (pos % self.cp_size == r)
                k = int(sel.sum())
                phys = np.sort(rng.choice(np.arange(1, self.l2[0].physical_pages if t else PAGES), k, replace=False))
                pages[sel] = cp_mapping.to_logical(phys, r, self.cp_size)
        hashes = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64)
        for i in range(n):
            pool = (self.l1 if tier[i] == 0 else self.l2)[i % self.cp_size]
            ph = int(cp_mapping.to_physical(np.array([pages[i]]), self.cp_size)[0])
            for p in self.layout.parts:
                for slot, layer in enumerate(p.layer_ids):
                    pool.layer_view(p.part, slot)[ph] = integrity.content(hashes[i:i + 1], p.part, layer,
                                                                          p.page_bytes)[0]
        return PageHomes(pos, tier, pages, hashes)

    def senders(self, address, adapter, **kw):
        from hicache_cp.pd.sender import PdSender

        return [PdSender(self.layout, self.l1[r], self.l2[r], decode_address=address, authkey=AUTHKEY,
                         rank=r, cp_size=self.cp_size, adapter=adapter, **kw) for r in range(self.cp_size)]

    def close(self) -> None:
        for pool in self.l2:
            pool.close()


@contextlib.contextmanager
def one_sender(address, adapter, layout: KVLayout | None = None, **kw):
    """A one-rank prefill (pools with content) and its sender; both closed after."""
    pre = Prefill(layout or tiny_layout())
    (s,) = pre.senders(address, adapter, **kw)
    try:
        yield pre, s
    finally:
        s.close()
        pre.close()


def finish_all(senders, room_id):
    """finish() on every rank at once (the decode peer answers when all ranks said done)."""
    results = [None] * len(senders)

    def run(i):
        results[i] = senders[i].finish(room_id)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(senders))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


@needs_mooncake
@pytest.mark.mooncake
@pytest.mark.parametrize("cp_size", [1, 2])
def test_byte_exact_all_parts(decode_peer, adapter, cp_size: int) -> None:
    rng = np.random.default_rng(cp_size)
    layout = tiny_layout()
    pre = Prefill(layout, cp_size)
    senders = pre.senders(decode_peer, adapter)
    free_before = stats(decode_peer)["free_pages"]
    try:
        for room_id, n in ((100 + cp_size * 10, 23), (101 + cp_size * 10, 1)):
            homes = pre.request(n, rng)
            released: list[Room] = []
            for s in senders:
                s.open_room(room_id, room_id, n, release=released.append)
                s.send(room_id, homes)  # every rank gets the whole request; each sends its lane
            results = finish_all(senders, room_id)
            for s, res in zip(senders, results):
                assert res.ok, res.failure
                owned = int((homes.positions % cp_size == s.rank).sum())
                for p in layout.parts:  # honest bytes: pages actually sent x layers x page bytes
                    assert res.bytes_per_part[p.part.value] == owned * p.num_slots * p.page_bytes
                    assert res.pages_per_part[p.part.value] == owned
                    assert res.descriptors_per_part[p.part.value] <= owned * p.num_slots
                s.rooms.check_invariants()
            assert [r.state for r in released] == [RoomState.SUCCESS] * cp_size
        assert stats(decode_peer)["free_pages"] == free_before  # decode freed the rooms' pages
    finally:
        for s in senders:
            s.close()
        pre.close()


class _SubmitWatch:
    """The adapter's TransferEngine, recording how many transfers to the peer are in
    flight, the new batch included, as each engine batch is submitted."""

    def __init__(self, engine, adapter) -> None:  # type: ignore[no-untyped-def]
        self._engine, self._adapter = engine, adapter
        self.in_flight: list[int] = []

    def batch_transfer_async_write(self, peer, srcs, dsts, lens):  # type: ignore[no-untyped-def]
        self.in_flight.append(self._adapter.in_flight(peer) + len(srcs))
        return self._engine.batch_transfer_async_write(peer, srcs, dsts, lens)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._engine, name)


@needs_mooncake
@pytest.mark.mooncake
def test_a_buffer_is_registered_once_with_one_size(adapter) -> None:
    buf = np.zeros(8192, np.uint8)
    ptr = buf.ctypes.data
    adapter.register(ptr, 4096)
    try:
        adapter.register(ptr, 4096)  # again, the same: nothing to do
        with pytest.raises(ValueError, match="already registered with 4096 bytes, not 8192"):
            adapter.register(ptr, 8192)
        assert adapter.registered[ptr] == 4096
    finally:
        adapter.unregister(ptr)
    with pytest.raises(ValueError, match="not registered"):
        adapter.unregister(ptr)


@needs_mooncake
@pytest.mark.mooncake
def test_closing_with_a_watched_wait_still_queued_ends_the_watcher_quietly(monkeypatch) -> None:
    """Ctrl-C closes the adapter while the watcher waits on a batch whose engine wait is
    still queued (every waiter thread busy): close() cancels it. The watcher ends
    without a traceback (a replay printed one, test_processes), and a wait on that
    batch raises TransferError saying the adapter closed, not a bare CancelledError."""
    from hicache_cp.pd.engine import Batch, TransferEngineAdapter, TransferError, _EngineBatch

    adapter = TransferEngineAdapter()
    gate = threading.Event()
    uncaught: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)
    monkeypatch.setattr(adapter, "_engine_wait", lambda peer, eb: gate.wait(10) and 0)
    try:
        busy = [adapter._waiter.submit(gate.wait, 10) for _ in range(adapter._waiter._max_workers)]
        batch = Batch("127.0.0.1:1", [_EngineBatch(batch_id=1, transfers=3, nbytes=300)])
        adapter.watch(batch)
        deadline = time.monotonic() + 5
        while batch.parts[0].future is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batch.parts[0].future is not None and not batch.parts[0].future.running()
    finally:
        adapter.close()
        gate.set()
    adapter._watcher.join(5)
    assert not adapter._watcher.is_alive() and uncaught == []
    assert all(f.result(5) for f in busy)
    with pytest.raises(TransferError, match="closed before this batch's wait ran"):
        adapter.wait(batch)


def _mapped(addr: int) -> bool:
    """Whether `addr` lies in a mapping of this process."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split(maxsplit=1)[0].split("-"))
        if lo <= addr < hi:
            return True
    return False


@needs_mooncake
@pytest.mark.mooncake
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_registered_host_memory_stays_mapped_until_the_sender_closes(decode_peer, adapter) -> None:
    """An interrupted run unwinds its cache, whose host pool unmaps its arenas,
    before the sender is closed; the transfer engine reads registered memory by
    address and may still be sending from it (a replay crashed with SIGSEGV
    there). The arenas stay mapped until the sender has unregistered them."""
    pre = Prefill(tiny_layout())
    (s,) = pre.senders(decode_peer, adapter)
    bases = [int(a.ptr) for a in pre.l2[0].arenas.values()]
    pre.close()
    assert all(_mapped(b) for b in bases), "a host arena was unmapped while registered"
    s.close()
    assert adapter.registered == {}
    del pre, s
    gc.collect()
    assert not any(_mapped(b) for b in bases), "the host arenas outlived their pool and sender"


@needs_mooncake
@pytest.mark.mooncake
def test_runs_coalesce_and_in_flight_cap(decode_peer, adapter) -> None:
    from hicache_cp.pd.sender import PageHomes

    rng = np.random.default_rng(7)
    with one_sender(decode_peer, adapter) as (pre, s):
        layout = pre.layout
        homes = pre.request(40, rng, tiers=np.zeros(40, dtype=int))
        # Contiguous L1 pages 1..40 in order: runs break only where the decode pages do.
        homes = PageHomes(homes.positions, homes.tier, np.arange(1, 41), homes.prefix_hashes)
        for i in range(40):
            for p in layout.parts:
                for slot, layer in enumerate(p.layer_ids):
                    pre.l1[0].layer_view(p.part, slot)[i + 1] = integrity.content(
                        homes.prefix_hashes[i:i + 1], p.part, layer, p.page_bytes)[0]
        room = s.open_room(300, 300, 40)
        dst_runs = 1 + int((np.diff(room.dst_pages) != 1).sum())
        plan = s.plan(300, homes)
        for p in layout.parts:
            assert plan.descriptors_per_part[p.part] == dst_runs * p.num_slots
        # Source-page gaps split runs too: pages reversed -> one descriptor per page.
        rev = s.plan(300, PageHomes(homes.positions, homes.tier, homes.pages[::-1].copy(), homes.prefix_hashes))
        assert rev.descriptors_per_part[Part.TARGET_KV] == 40 * 3
        old, engine = adapter.max_in_flight, adapter.engine
        adapter.max_in_flight = 2  # forces splitting into engine batches and early waits
        adapter.engine = watch = _SubmitWatch(engine, adapter)
        try:
            s.send(300, homes)
        finally:
            adapter.max_in_flight, adapter.engine = old, engine
        assert len(watch.in_flight) > 1 and max(watch.in_flight) <= 2
        res = s.finish(300)
        assert res.ok, res.failure


@needs_mooncake
@pytest.mark.mooncake
def test_registration_mismatch_fails_on_both_sides(decode_peer, adapter) -> None:
    rejected_before = len(stats(decode_peer)["rejected"])
    for layout, needle in ((tiny_layout(draft_state=False), "draft_state registered"),
                           (tiny_layout(state_layers=(0, 1)), "target_state layer_ids")):
        released: list[Room] = []
        with one_sender(decode_peer, adapter, layout) as (_, s):
            with pytest.raises(RegistrationMismatch) as err:
                s.open_room(400, 400, 4, release=released.append)
            assert needle in str(err.value)
            assert "prefill=" in str(err.value) and "decode=" in str(err.value)
            assert released and released[0].state is RoomState.FAILED  # the room failed with both values
            assert needle in (released[0].failure or "")
    rejected = stats(decode_peer)["rejected"]
    assert len(rejected) == rejected_before + 2  # the decode side refused (and logged) both
    assert "draft_state" in rejected[-2] and "target_state layer_ids" in rejected[-1]


@needs_mooncake
@pytest.mark.mooncake
def test_chunked_per_layer_lands_at_absolute_positions(decode_peer, adapter) -> None:
    from hicache_cp.pd.sender import PageHomes

    rng = np.random.default_rng(3)
    with one_sender(decode_peer, adapter) as (pre, s):
        layout = pre.layout
        homes = pre.request(12, rng)
        s.open_room(500, 500, 12)
        for first in (0, 5, 9):  # chunks of 5, 4, 3 pages at cumulative offsets
            sel = (homes.positions >= first) & (homes.positions < first + (5 if first == 0 else 4 if first == 5 else 3))
            chunk = PageHomes(homes.positions[sel], homes.tier[sel], homes.pages[sel], homes.prefix_hashes[sel])
            for p in layout.parts:  # per layer, as layers finish
                for layer in p.layer_ids:
                    s.send_layer(500, p.part, layer, chunk, chunk_first_position=first)
        res = s.finish(500)
        assert res.ok, res.failure  # decode verified all 12 positions at their absolute places
        assert res.pages_per_part["target_kv"] == 12
        # A chunk-local 0 for chunk 1 (it once overwrote chunk 0) is refused and fails the room.
        s.open_room(501, 501, 12)
        first = PageHomes(homes.positions[:5], homes.tier[:5], homes.pages[:5], homes.prefix_hashes[:5])
        s.send_layer(501, Part.TARGET_KV, 0, first, chunk_first_position=0)
        local = PageHomes(np.arange(4), homes.tier[5:9], homes.pages[5:9], homes.prefix_hashes[5:9])
        with pytest.raises(ValueError, match="already sent"):  # chunk 0 owns positions 0-3
            s.send_layer(501, Part.TARGET_KV, 0, local, chunk_first_position=0)
        assert s.rooms.get(501).state is RoomState.FAILED
        with pytest.raises(RoomFailed):
            s.send_layer(501, Part.TARGET_KV, 1, first, chunk_first_position=0)
        assert not s.finish(501).ok


@needs_mooncake
@pytest.mark.mooncake
def test_a_position_resent_with_another_prefix_hash_fails_the_room(decode_peer, adapter) -> None:
    """Layers of one position are sent apart; a later layer that names another prefix hash
    for it means the sender mixed two requests' pages: the room fails at once, nothing of
    that send goes out."""
    from hicache_cp.errors import ConsistencyError
    from hicache_cp.pd.sender import PageHomes

    rng = np.random.default_rng(8)
    with one_sender(decode_peer, adapter) as (pre, s):
        homes = pre.request(6, rng)
        s.open_room(550, 550, 6)
        s.send_layer(550, Part.TARGET_KV, 0, homes)
        drifted = homes.prefix_hashes.copy()
        drifted[3] ^= np.uint64(1)
        other = PageHomes(homes.positions, homes.tier, homes.pages, drifted)
        with pytest.raises(ConsistencyError, match="prefix hash differs") as caught:
            s.send_layer(550, Part.TARGET_KV, 1, other)
        assert caught.value.details["positions"].tolist() == [3]  # the position is named
        room = s.rooms.get(550)
        assert room.state is RoomState.FAILED and "prefix hash" in (room.failure or "")
        assert (Part.TARGET_KV, 1) not in room.sent
        assert not s.finish(550).ok


@needs_mooncake
@pytest.mark.mooncake
def test_l2_only_pages_sent_without_load_back(decode_peer, adapter) -> None:
    rng = np.random.default_rng(11)
    with one_sender(decode_peer, adapter) as (pre, s):
        homes = pre.request(17, rng, tiers=np.ones(17, dtype=int))
        for buf in pre.l1[0].buffers.values():
            buf.fill_(0x5A)  # poison L1
        snapshot = {p: b.clone() for p, b in pre.l1[0].buffers.items()}
        s.open_room(600, 600, 17)
        s.send(600, homes)
        res = s.finish(600)
        assert res.ok, res.failure
        for p, b in pre.l1[0].buffers.items():
            assert bool((b == snapshot[p]).all()), f"L1 {p.value} was touched"


@needs_mooncake
@pytest.mark.mooncake
def test_timeout_aborts_releases_and_refuses_late_chunks(decode_peer, adapter) -> None:
    rng = np.random.default_rng(5)
    with one_sender(decode_peer, adapter, timeout_s=0.5) as (pre, s):
        free_before = stats(decode_peer)["free_pages"]
        homes = pre.request(6, rng)
        released: list[Room] = []
        s.open_room(700, 700, 6, release=released.append)
        s.send_layer(700, Part.TARGET_KV, 0, homes)
        assert s.poll() == []
        time.sleep(0.6)
        (room,) = s.poll()  # past the deadline: aborted
        assert room.state is RoomState.FAILED and room.failure == "timeout after 0.5 s"
        assert released == [room] and room.in_flight == []
        with pytest.raises(RoomFailed):  # a later chunk must not write into reclaimed pages
            s.send_layer(700, Part.TARGET_KV, 1, homes)
        assert not s.finish(700).ok
        assert stats(decode_peer)["free_pages"] == free_before  # decode reclaimed its pages too


@needs_mooncake
@pytest.mark.mooncake
def test_decode_peer_killed_mid_transfer(adapter) -> None:
    from hicache_harness.decode_peer import spawn_decode_peer

    layout = tiny_layout()
    proc, address = spawn_decode_peer(layout, DECODE_PAGES, AUTHKEY)
    rng = np.random.default_rng(9)
    try:
        with one_sender(address, adapter, layout, timeout_s=3.0) as (pre, s):
            homes = pre.request(20, rng)
            released: list[Room] = []
            s.open_room(800, 800, 20, release=released.append)
            s.send_layer(800, Part.TARGET_KV, 0, homes)
            proc.terminate()
            proc.join(5)
            t0 = time.monotonic()
            try:
                for p in layout.parts:
                    for layer in p.layer_ids:
                        if (p.part, layer) != (Part.TARGET_KV, 0):
                            s.send_layer(800, p.part, layer, homes)
                res = s.finish(800)
                assert res.state is RoomState.FAILED, res
            except RoomFailed:  # the engine may refuse the submission outright
                pass
            assert time.monotonic() - t0 < 4.0
            assert len(released) == 1 and released[0].state is RoomState.FAILED
            assert s.rooms.get(800).failure
    finally:
        if proc.is_alive():
            proc.kill()


@needs_mooncake
@pytest.mark.mooncake
def test_corrupt_page_is_reported_by_position_layer_part(decode_peer, adapter) -> None:
    rng = np.random.default_rng(13)
    with one_sender(decode_peer, adapter) as (pre, s):
        layout = pre.layout
        homes = pre.request(8, rng, tiers=np.ones(8, dtype=int))
        ph = int(cp_mapping.to_physical(homes.pages[5:6], 1)[0])
        slot = layout.part(Part.TARGET_STATE).slot(2)
        pre.l2[0].layer_view(Part.TARGET_STATE, slot)[ph, 3] ^= 0xFF  # one flipped byte
        s.open_room(900, 42, 8)
        s.send(900, homes)
        res = s.finish(900)
        assert res.state is RoomState.FAILED and res.mismatch_count == 1
        assert res.mismatches == ["request 42 page 5 target_state layer 2 rank 0"]


@needs_mooncake
@pytest.mark.mooncake
def test_a_rank_that_owns_no_position_finishes_without_sending(decode_peer, adapter) -> None:
    """CP 2, a 1-page room: rank 1 owns nothing and never calls send; its finish
    still says "done" (with no positions) and the room verifies on both ranks."""
    rng = np.random.default_rng(31)
    pre = Prefill(tiny_layout(), 2)
    senders = pre.senders(decode_peer, adapter)
    try:
        homes = pre.request(1, rng)
        for s in senders:
            s.open_room(950, 950, 1)
        senders[0].send(950, homes)
        results = finish_all(senders, 950)
        assert [r.ok for r in results] == [True, True], [r.failure for r in results]
        assert results[1].nbytes == 0 and results[0].pages_per_part["target_kv"] == 1
    finally:
        for s in senders:
            s.close()
        pre.close()
