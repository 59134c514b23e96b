"""PD restore checks (`hicache_cp.pd.verify`): the decode side checks every page it
received against the checksums prefill sent with "done", before it reports success.

Real Mooncake TransferEngine on 127.0.0.1: the decode peer runs in this process
(a thread, its own engine), so a test can corrupt what landed. Prefill pools keep
checksums as a cache's do: content written, its checksums stored beside L2 copies
and the copies' identity tags set (what a committed backup leaves).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from test_pd import AUTHKEY, needs_mooncake, tiny_layout  # noqa: E402

from hicache_cp import checksum  # noqa: E402
from hicache_harness import integrity  # noqa: E402
from hicache_cp.layout import Part  # noqa: E402
from hicache_cp.pd.plan import PageHomes  # noqa: E402
from hicache_cp.pd.room import RoomState  # noqa: E402

pytestmark = [needs_mooncake, pytest.mark.mooncake]
PAGES = 32


class Side:
    """One prefill rank's pools with content, checksums and tags, and a sender to an
    in-process decode peer whose received bytes a test may corrupt (`after_wait`)."""

    def __init__(self, verify: bool = True) -> None:
        from hicache_harness.decode_peer import DecodePeer
        from hicache_cp.pd.engine import TransferEngineAdapter
        from hicache_cp.pd.sender import PdSender
        from hicache_cp.pools import DevicePool, HostPool

        self.layout = tiny_layout()
        self.l1 = DevicePool(self.layout, PAGES)
        self.l2 = HostPool(self.layout, self.layout.bytes_per_page * PAGES, pin=False, checksums=True)
        self.peer = DecodePeer(self.layout, 128, authkey=AUTHKEY)
        self.peer.start()
        self.after_wait = None
        side = self

        class Adapter(TransferEngineAdapter):
            def wait(self, batch, timeout=None):  # type: ignore[no-untyped-def]
                super().wait(batch, timeout)
                if side.after_wait is not None:
                    side.after_wait()

        self.adapter = Adapter()
        self.sender = PdSender(self.layout, self.l1, self.l2, decode_address=self.peer.address, authkey=AUTHKEY,
                               adapter=self.adapter, verify=verify)  # fmt: skip

    def request(self, n: int, seed: int) -> PageHomes:
        """Positions 0..n-1, even ones in L1, odd ones in L2 (stored checksums, tags)."""
        rng = np.random.default_rng(seed)
        pos = np.arange(n, dtype=np.int64)
        tier = (pos % 2).astype(np.int8)
        pages = rng.permutation(np.arange(1, PAGES))[:n].astype(np.int64)
        hashes = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64)
        for p in self.layout.parts:
            for slot, layer in enumerate(p.layer_ids):
                content = integrity.content(hashes, p.part, layer, p.page_bytes)
                for i in range(n):
                    pool = self.l1 if tier[i] == 0 else self.l2
                    pool.layer_view(p.part, slot)[pages[i]] = content[i]
                l2 = tier == 1
                self.l2.sums(p.part)[slot, pages[l2]] = checksum.checksums(content[l2], p.part, layer)
        self.l2.set_tags(pages[tier == 1], hashes[tier == 1])
        return PageHomes(pos, tier, pages, hashes)

    def close(self) -> None:
        self.sender.close()
        self.adapter.close()
        self.peer.close()
        self.l2.close()


@contextlib.contextmanager
def side(verify: bool = True):  # type: ignore[no-untyped-def]
    s = Side(verify)
    try:
        yield s
    finally:
        s.close()


def test_every_received_page_is_checked_and_a_clean_room_verifies() -> None:
    with side() as s:
        homes = s.request(10, 1)
        s.sender.open_room(1, 1, 10)
        s.sender.send(1, homes)
        res = s.sender.finish(1)
        assert res.ok, res.failure
        units = sum(p.num_slots for p in s.layout.parts)
        assert s.peer.checksum_units == 10 * units and s.peer.checksum_failures == 0


@pytest.mark.parametrize("verify", [True, False])
def test_a_flipped_bit_in_the_transfer_is_caught_by_the_decode_side(verify: bool) -> None:
    """A byte flips between the wire and decode's buffer: the decode side fails the
    room before it reports success. The harness's byte oracle catches it too (the
    control: without checksums the oracle is what fails it)."""
    with side(verify) as s:
        homes = s.request(8, 2)
        s.sender.open_room(2, 7, 8)
        s.sender.send(2, homes)
        slot = s.layout.part(Part.DRAFT_KV).slot(0)

        def flip() -> None:
            room = s.peer.rooms[2]
            s.peer.views[Part.DRAFT_KV][slot, room.dst_pages[3], 11] ^= 0x04

        s.after_wait = flip
        res = s.sender.finish(2)
        assert res.state is RoomState.FAILED and res.mismatches == ["request 7 page 3 draft_kv layer 0 rank 0"]
        assert s.peer.checksum_failures == (1 if verify else 0)


def test_a_flipped_bit_in_an_l2_page_sent_is_caught_by_the_decode_side() -> None:
    """The L2 copy a page is sent from is corrupt (its stored checksum is the backup's):
    the bytes cross intact and the decode side's check sees the flip."""
    with side() as s:
        homes = s.request(8, 3)
        page = int(homes.pages[5])  # position 5: L2
        s.l2.layer_view(Part.TARGET_STATE, 1)[page, 2] ^= 0x80
        s.sender.open_room(3, 8, 8)
        s.sender.send(3, homes)
        res = s.sender.finish(3)
        assert res.state is RoomState.FAILED and s.peer.checksum_failures == 1
        assert res.mismatches == ["request 8 page 5 target_state layer 2 rank 0"]


def test_an_l2_page_holding_another_copy_is_refused_before_it_is_sent() -> None:
    """A stale L2 page (freed and reused: its identity tag is another prefix's) fails
    the room at send: nothing of it goes out."""
    with side() as s:
        homes = s.request(6, 4)
        s.l2.tags[homes.pages[3]] = 12345  # reused by another copy
        s.sender.open_room(4, 9, 6)
        with pytest.raises(Exception, match="another copy"):
            s.sender.send(4, homes)
        res = s.sender.finish(4)
        assert res.state is RoomState.FAILED and "another copy" in (res.failure or "")


def test_check_received_refuses_units_of_another_layout() -> None:
    from hicache_cp.pd import verify as pd_verify

    layout = tiny_layout()
    with pytest.raises(ValueError, match="units differ"):
        pd_verify.check_received(layout, {}, np.arange(4), np.arange(2), [("target_kv", 0)], np.zeros((1, 2), np.uint64))
    with pytest.raises(ValueError, match="bytes for"):
        pd_verify.decode(pd_verify.encode(np.zeros((2, 3), np.uint64)), 2, 4)
