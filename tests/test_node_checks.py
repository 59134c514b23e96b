"""The node tier under the restore checks and the KV events: one checksum function, one
check path, one removal path (docs/node-tier.md, docs/integrity.md, docs/events.md).

    two ranks      a bit flipped in the shared segment, in a page rank 1 copied (its slice),
                   is caught by rank 0's load against the checksum rank 1 stored in the
                   shared table; the copy is dropped on every rank with a BlockRemoved
                   (integrity) event, and the journal forgets it; a clean copy written in
                   both ranks' slices loads checked on both, with no failure
    SIGKILL        after a real SIGKILL and a restart, an adopted page with a flipped bit
                   is caught at its first use and recomputed, never served (under `all`,
                   and under `sample` with a sample that would have skipped it)
    events         a restarted cache announces every adopted copy after AllCleared,
                   parents first: a router's view equals what L2 holds
    reset          a cache closed as a reset (`discard`) leaves nothing to adopt
"""

from __future__ import annotations

import json
import mmap
import multiprocessing
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hicache_cp.cache import HiCache
from hicache_cp.cache.node_tier import node_geometry
from hicache_cp.checksum import Verify
from hicache_cp.events import AllCleared, BlockRemoved, BlockStored, ChainKeyer, EventLog, Medium, Removal
from hicache_harness.engines import crash
from hicache_harness.engines.synthetic import ReferenceServer
from hicache_harness.launch import RankContext, spawn_ranks
from hicache_cp.layout import Part
from hicache_cp.node.share import write_share
from hicache_cp.radix import HostState
from hostmem.segment import find_segment

from conftest import PAGE, tiny_config

PAGES = 6
TIMEOUT_S = 300.0


def prompt(base: int) -> np.ndarray:
    """A prompt of PAGES whole pages, distinct for each `base`."""
    return np.arange(base * 10_000, base * 10_000 + PAGES * PAGE, dtype=np.int64)


def config(name: str, **over: Any) -> Any:
    values: dict[str, Any] = dict(host_pages=64, l1_pages=48, node_segment=name)
    values.update(over)
    return tiny_config(**values)


def host_pages_of(cache: HiCache, tokens: np.ndarray) -> np.ndarray:
    """The logical L2 pages of the committed copy of `tokens` (all its nodes)."""
    path = cache.tree.match(tokens)
    assert path and all(n.host_state is HostState.COMMITTED for n in path), path
    return np.concatenate([n.host_pages for n in path])


def keys(tokens: np.ndarray) -> list[bytes]:
    return list(ChainKeyer().chain(None, tokens, PAGE))


# ---- two ranks: the shared checksum table --------------------------------------------------------


def _flip_in_the_other_ranks_slice(ctx: RankContext, name: str, device: str = "cpu") -> dict[str, Any]:
    """The story on one rank; `device` cuda:0: L1 and the checks on the GPU (tests/test_node_gpu.py)."""
    log = EventLog(media=[Medium.HOST])
    gpu = {"io_backend": "auto", "pin_host": True} if device != "cpu" else {}
    cache = HiCache(config(name, node_drop_on_close=True, **gpu), agreement=ctx.agreement, events=log, device=device)
    try:
        server = ReferenceServer(cache)
        clean, bad = prompt(1), prompt(2)
        server.serve(0, clean)
        server.serve(1, bad)
        cache.drain()
        cache.evict_device()  # both copies L2-only
        pages = host_pages_of(cache, bad)
        lo, hi = write_share(0, PAGES, 1, ctx.world_size)  # the pages rank 1 copied (its slice)
        ctx.agreement.min_int(0)  # every rank committed and evicted: the copies are at rest
        if ctx.rank == 0:
            layout = cache.layout.part(Part.TARGET_KV)
            cache.host_pool.layer_view(Part.TARGET_KV, layout.slot(1))[pages[lo + 1], 5] ^= 0x10
        ctx.agreement.min_int(0)  # the flip is in the shared bytes before anyone loads
        log.take()
        ok = server.serve(2, clean)  # pages of both slices, checked against the shared table
        clean_checked = cache.stats()["verified_units"]
        caught = server.serve(3, bad)
        cache.drain()
        cache.check_invariants()
        events = log.take()
        held = any(n.host_state is HostState.COMMITTED for n in cache.tree.match(bad))
        journal = cache._node.journal.committed_pages().tolist() if ctx.rank == 0 else []  # type: ignore[union-attr]
        cache.evict_device()
        again = server.serve(4, bad)
        cache.drain()
        s = cache.stats()
        return {
            "slice": [lo, hi], "ok_hit": ok.l2_hit_pages, "clean_checked": clean_checked,
            "caught_hit": caught.l2_hit_pages, "again_hit": again.l2_hit_pages, "again_computed": again.computed_pages,
            "mismatches": server.integrity.mismatches, "complete": server.integrity.complete,
            "failures": s["verify_failures_l2_target_kv"] if "verify_failures_l2_target_kv" in s else 0,
            "aborted": s["loads_aborted"], "dropped": s["integrity_dropped_pages"],
            "removed": [(ev.reason.value, ev.keys) for ev in events if isinstance(ev, BlockRemoved)],
            "bad_pages": pages.tolist(), "journal": journal,
            "still_held": held,
        }  # fmt: skip
    finally:
        cache.close()


def test_a_flip_in_another_ranks_slice_is_caught_by_this_ranks_load_and_dropped_everywhere(seg_name: str) -> None:
    check_flip_in_another_ranks_slice(seg_name, "cpu")


def check_flip_in_another_ranks_slice(seg_name: str, device: str) -> None:
    results = spawn_ranks(_flip_in_the_other_ranks_slice, 2, (seg_name, device), timeout_s=TIMEOUT_S, backend="gloo")
    for rank, r in enumerate(results):
        assert r["slice"] == [3, 6]
        assert r["mismatches"] == 0 and r["complete"], (rank, r)  # nothing corrupt was served, on any rank
        assert r["ok_hit"] == PAGES and r["clean_checked"] > 0  # rank 1's slice verified on rank 0 too, and back
        assert r["caught_hit"] == PAGES and r["failures"] >= 1 and r["aborted"] == 1, (rank, r)  # its own check
        assert r["dropped"] == PAGES and not r["still_held"]  # dropped on every rank
        assert r["removed"] == [("integrity", keys(prompt(2)))], (rank, r["removed"])  # announced
        assert r["again_hit"] == 0 and r["again_computed"] == PAGES  # never served again
    assert not set(results[0]["bad_pages"]) & set(results[0]["journal"])  # the journal forgot it: never adopted
    assert find_segment(seg_name) is None


# ---- a SIGKILL restart: the first use of an adopted page is checked ----------------------------


def _serve_and_die(name: str, out: str, verify: str) -> None:
    """Serve two prompts, write down where the second's copy is, then die by SIGKILL."""
    cache = HiCache(config(name, verify_restores=verify))
    server = ReferenceServer(cache)
    server.serve(0, prompt(1))
    server.serve(1, prompt(2))
    cache.drain()
    Path(out).write_text(json.dumps({"pages": host_pages_of(cache, prompt(2)).tolist()}))
    crash()


def _flip_in_the_file(name: str, cfg: Any, page: int) -> None:
    """One bit of `page`'s target KV layer 1, written into the segment while no engine maps it."""
    layout = cfg.layout()
    g = node_geometry(cfg, layout, int(cfg.host_budget_bytes), 1)
    part = layout.part(Part.TARGET_KV)
    at = g.part_offset(0, Part.TARGET_KV) + (part.slot(1) * g.physical_pages + page) * part.page_bytes + 5
    path = find_segment(name)
    assert path is not None
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        mm[at] ^= 0x10


@pytest.mark.parametrize("verify", ["all", "sample"])
def test_after_a_sigkill_an_adopted_page_with_a_flipped_bit_is_caught_at_its_first_use(
    seg_name: str, tmp_path: Path, verify: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "before.json"
    child = multiprocessing.get_context("spawn").Process(target=_serve_and_die, args=(seg_name, str(out), verify))
    child.start()
    child.join(TIMEOUT_S)
    assert child.exitcode == -signal.SIGKILL
    pages = json.loads(out.read_text())["pages"]
    cfg = config(seg_name, verify_restores=verify, node_drop_on_close=True)
    _flip_in_the_file(seg_name, cfg, pages[4])
    if verify == "sample":  # a sample that would check no page at all: only the first-use rule checks
        monkeypatch.setattr("hicache_cp.cache.lifecycle.sample_positions",
                            lambda n, op_id, mode: None if mode is Verify.ALL else np.empty(0, np.int64))  # fmt: skip
    log = EventLog(media=[Medium.HOST])
    cache = HiCache(cfg, events=log)
    try:
        assert cache.stats()["node_adopted_pages"] == 2 * PAGES
        log.take()
        server = ReferenceServer(cache)
        caught = server.serve(0, prompt(2))  # its first use: loaded, checked, the load aborts, recomputed
        cache.drain()
        s = cache.stats()
        assert server.integrity.mismatches == 0 and server.integrity.complete, server.integrity  # never served
        assert caught.l2_hit_pages == PAGES and s["loads_aborted"] == 1 and s["verify_failures_l2_target_kv"] == 1
        assert s["node_verify_failures"] == 1 and s["integrity_dropped_pages"] == PAGES
        assert [(ev.reason, ev.keys) for ev in log.take() if isinstance(ev, BlockRemoved)] == [
            (Removal.INTEGRITY, keys(prompt(2)))]  # fmt: skip
        clean = server.serve(1, prompt(1))  # the other adopted copy: its first use checked, and it passes
        cache.drain()
        assert clean.l2_hit_pages == PAGES and cache.stats()["node_verified_pages"] == PAGES
        cache.evict_device()
        again = server.serve(2, prompt(2))
        assert again.l2_hit_pages == 0 and again.computed_pages == PAGES  # the bad copy never comes back
        assert server.integrity.mismatches == 0
        cache.drain()
        cache.check_invariants()
    finally:
        cache.close()
    assert find_segment(seg_name) is None


# ---- events and resets ---------------------------------------------------------------------------


def test_a_restart_announces_every_adopted_copy_after_all_cleared(seg_name: str) -> None:
    first_log = EventLog(media=[Medium.HOST])
    first = HiCache(config(seg_name), events=first_log)
    server = ReferenceServer(first)
    for i in range(4):  # branching prefixes: a shared first half, four continuations
        server.serve(i, np.concatenate([prompt(1)[: 3 * PAGE], prompt(2 + i)[: 3 * PAGE]]))
    first.drain()
    held = {k for n in first.tree.nodes() if n.host_state is HostState.COMMITTED for k in first_log.keys_of(n)}
    first.close()
    log = EventLog(media=[Medium.HOST])
    again = HiCache(config(seg_name, node_drop_on_close=True), events=log)
    try:
        events = log.take()
        assert isinstance(events[0], AllCleared) and all(isinstance(ev, BlockStored) for ev in events[1:])
        seen: set[bytes] = set()
        for ev in events[1:]:  # a router can attach each block to its parent
            assert ev.medium is Medium.HOST and (ev.parent is None or ev.parent in seen)
            assert ev.keys == list(ChainKeyer().chain(ev.parent, ev.tokens, PAGE))
            seen.update(ev.keys)
        assert seen == held and len(held) == 3 + 4 * 3  # exactly what L2 held, once each
    finally:
        again.close()


def test_a_reset_leaves_nothing_to_adopt(seg_name: str) -> None:
    """A reset (SGLang's flush_cache, vLLM's reset_connector) closes the cache with `discard`:
    the journal forgets every copy, so the next cache on the segment starts empty."""
    first = HiCache(config(seg_name))
    ReferenceServer(first).serve(0, prompt(1))
    first.drain()
    first.close(discard=True)
    log = EventLog(media=[Medium.HOST])
    again = HiCache(config(seg_name, node_drop_on_close=True), events=log)
    try:
        assert again.stats()["node_adopted_pages"] == 0 and again.host_pool.allocator.used_pages == 0
        assert log.take() == [AllCleared()]
        assert again._node.journal.committed_pages().size == 0  # type: ignore[union-attr]
    finally:
        again.close()
