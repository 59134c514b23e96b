"""CP + PD: two real CP ranks (torch.distributed, gloo on CPU), each with its own
Mooncake engine, send one request in chunks to one decode peer process.

Asserts: positions are request-absolute across chunks; each rank submits only
the positions it owns (and their pages are on its lane); the decode peer gets
and verifies the full logical layout; a room's outcome is agreed in the ranks'
one MIN collective, so a failure seen by one rank fails the room on both.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from test_pd import AUTHKEY, DECODE_PAGES, Prefill, needs_mooncake, stats, tiny_layout  # noqa: E402

from hicache_harness.launch import RankContext, spawn_ranks  # noqa: E402

pytestmark = [needs_mooncake, pytest.mark.mooncake, pytest.mark.slow]
N = 12
CHUNKS = ((0, 5), (5, 4), (9, 3))  # (first page, pages): cumulative offsets


def _rank(ctx: RankContext, address: tuple[str, int], authkey: bytes) -> dict:
    from hicache_cp.pd.sender import PageHomes, PdSender
    from hicache_cp.pd.room import RoomState

    layout = tiny_layout()
    pre = Prefill(layout, 2)  # both ranks build the same request (same seed); each registers its own pools
    homes = pre.request(N, np.random.default_rng(5))
    r = ctx.rank
    s = PdSender(layout, pre.l1[r], pre.l2[r], decode_address=address, authkey=authkey, rank=r, cp_size=2,
                 agreement=ctx.agreement)
    out: dict = {"submitted": []}
    try:
        s.open_room(1, 1, N)
        for first, n in CHUNKS:
            sel = (homes.positions >= first) & (homes.positions < first + n)
            chunk = PageHomes(homes.positions[sel], homes.tier[sel], homes.pages[sel], homes.prefix_hashes[sel])
            for p in layout.parts:
                for layer in p.layer_ids:
                    plan = s.send_layer(1, p.part, layer, chunk, chunk_first_position=first)
                    out["submitted"].append(plan.positions.tolist())
        res = s.finish(1)
        out["ok"], out["pages"], out["failure"] = res.ok, res.pages_per_part, res.failure
        # Room 2: the decode peer verifies it, but rank 1 then sees a failure of its own
        # (a decode server that answers per rank): the collective must fail it on rank 0 too.
        s.open_room(2, 2, N)
        if r == 1:
            real = s._request

            def failing_done(msg, timeout):  # type: ignore[no-untyped-def]
                reply = real(msg, timeout)
                if msg["op"] == "done":
                    reply = {**reply, "ok": False, "error": "rank-local failure after the verdict"}
                return reply

            s._request = failing_done  # type: ignore[method-assign]
        s.send(2, homes)
        res2 = s.finish(2)
        out["room2"] = (res2.state is RoomState.SUCCESS, res2.failure)
        out["collectives"] = ctx.agreement.collectives
    finally:
        s.close()
        pre.close()
    return out


def test_cp2_chunked_pd_owned_pages_full_layout_and_one_agreed_outcome() -> None:
    from hicache_harness.decode_peer import spawn_decode_peer

    proc, address = spawn_decode_peer(tiny_layout(), DECODE_PAGES, AUTHKEY)
    try:
        before = stats(address)
        results = spawn_ranks(_rank, 2, (address, AUTHKEY), timeout_s=120)  # a child's AUTHKEY differs
        after = stats(address)
    finally:
        proc.terminate()
        proc.join(10)
    for r, res in enumerate(results):
        assert res["ok"], res["failure"]
        assert all(p % 2 == r for sub in res["submitted"] for p in sub)  # only its own positions
        owned = [p for first, n in CHUNKS for p in range(first, first + n) if p % 2 == r]
        parts = len(tiny_layout().parts)
        # every (chunk, part, layer) submission covered that chunk's owned positions, absolute
        assert sorted({p for sub in res["submitted"] for p in sub}) == owned
        assert res["pages"] == {p.part.value: 6 for p in tiny_layout().parts} and parts == 4
    assert after["verified_rooms"] - before["verified_rooms"] == 2  # the full layout, twice
    assert after["free_pages"] == before["free_pages"]
    ok0, why0 = results[0]["room2"]
    ok1, why1 = results[1]["room2"]
    assert not ok0 and not ok1  # one rank's failure failed the room on both
    assert "another CP rank failed this room" in why0 and "rank-local failure" in why1
    assert results[0]["collectives"] == results[1]["collectives"] > 0
