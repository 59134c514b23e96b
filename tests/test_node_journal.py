"""hicache_cp.node: the segment's geometry, its opening decisions, the journal, write shares
and adoption (no cache, no processes)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_cp.presets import PRESETS
from hicache_cp.errors import ConsistencyError
from hicache_cp.keys import chain_hashes
from hicache_cp.node.adopt import adopt
from hicache_cp.node.geometry import NodeGeometry, Sharing
from hicache_cp.node.journal import COMMITTED, FREE, ROOT, Journal
from hicache_cp.node.segment import HEADER, Decision, NodeSegment
from hicache_cp.node.share import write_share
from hicache_cp.allocator import LanePageAllocator
from hicache_cp.radix import HostState, RadixTree
from hostmem.segment import SegmentBusy

PAGE = 16
LAYOUT = PRESETS["tiny"].layout(PAGE)
PARTS = frozenset(p.part for p in LAYOUT.parts)


def geometry(**over: object) -> NodeGeometry:
    values: dict[str, object] = dict(layout=LAYOUT, model="tiny", physical_pages=65, cp_size=1, copies=1,
                                     sharing=Sharing.REPLICATED, align=1 << 16)  # fmt: skip
    values.update(over)
    return NodeGeometry(**values)  # type: ignore[arg-type]



# ---- geometry ----------------------------------------------------------------------------------


def test_regions_are_aligned_disjoint_and_inside_the_segment() -> None:
    for g in (geometry(), geometry(cp_size=2, copies=2, sharing=Sharing.PER_RANK, physical_pages=33)):
        spans = sorted((g.part_offset(c, p.part), g.part_bytes(p.part)) for c in range(g.copies) for p in LAYOUT.parts)
        sums = sorted((g.sums_offset(c), g.sums_bytes) for c in range(g.copies))
        assert sums[0][0] >= g.tokens_offset + g.logical_pages * PAGE * 8 and spans[0][0] >= sums[-1][0] + sums[-1][1]
        for (a, n), (b, _) in zip(sums, sums[1:] + spans[:1]):
            assert a % g.align == 0 and a + n <= b
        assert g.sums_bytes == 8 * g.physical_pages * sum(p.num_slots for p in LAYOUT.parts)  # HostPool's table
        for (a, n), (b, _) in zip(spans, spans[1:]):
            assert a % g.align == 0 and a + n <= b
        assert spans[-1][0] + spans[-1][1] <= g.total_bytes
        assert g.copy_bytes == g.physical_pages * LAYOUT.bytes_per_page
        assert g.logical_pages == (g.physical_pages - 1) * g.cp_size + 1
    with pytest.raises(ValueError, match="no checksum table"):
        geometry(verify=False).sums_offset(0)
    with pytest.raises(ValueError, match="replicated"):
        geometry(cp_size=2)


def test_every_field_that_changes_the_bytes_changes_the_fingerprint() -> None:
    base = geometry().fingerprint()
    variants = [
        geometry(model="other"), geometry(physical_pages=66), geometry(kv_dtype="fp8"), geometry(verify=False),
        geometry(copies=2, sharing=Sharing.PER_RANK), geometry(layout=PRESETS["tiny"].layout(32)),
        geometry(layout=dataclasses.replace(PRESETS["tiny"], state_layers=(1, 3)).layout(PAGE)),
    ]  # fmt: skip
    prints = [v.fingerprint() for v in variants]
    assert base not in prints and len(set(prints)) == len(prints)
    assert geometry().fingerprint() == base


# ---- write shares ----------------------------------------------------------------------------------


@given(st.integers(0, 10_000), st.integers(0, 300), st.integers(1, 9))
def test_write_shares_cover_every_page_once_and_are_balanced(first: int, n: int, world: int) -> None:
    shares = [write_share(first, n, r, world) for r in range(world)]
    covered = np.zeros(n, dtype=int)
    for lo, hi in shares:
        covered[lo:hi] += 1
        assert hi - lo in (n // world, n // world + 1)
    assert (covered == 1).all()


def test_single_page_ops_rotate_over_the_ranks() -> None:
    owners = [next(r for r in range(4) if write_share(p, 1, r, 4) != (0, 0)) for p in range(8)]
    assert sorted(owners[:4]) == [0, 1, 2, 3] and owners[:4] == owners[4:]


# ---- the journal and adoption ---------------------------------------------------------------------


def _tokens(rng: np.random.Generator, pages: int) -> np.ndarray:
    return rng.integers(0, 50, pages * PAGE, dtype=np.int64)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 12), st.integers(0, 4), st.integers(0, 3))
def test_adoption_rebuilds_exactly_the_committed_reachable_pages(seed: int, chains: int, released: int, damaged: int) -> None:
    """Commit random branching chains, release a few pages, damage a few entries: the
    adopted tree holds exactly the committed pages whose whole prefix is committed and
    sound, each under its own tokens, and the allocator holds exactly those."""
    rng = np.random.default_rng(seed)
    seg = _FakeSegment(geometry(physical_pages=200))
    journal = Journal(seg, writer=True)  # type: ignore[arg-type]
    free = list(range(1, 200))
    rng.shuffle(free)
    paths: list[tuple[np.ndarray, list[int]]] = []  # (tokens, pages) of every chain from position 0
    for _ in range(chains):
        if paths and rng.random() < 0.6:  # branch off an existing chain
            tokens, pages = paths[rng.integers(len(paths))]
            keep = int(rng.integers(0, len(pages) + 1))
            tokens, pages = tokens[: keep * PAGE], pages[:keep]
        else:
            tokens, pages = np.empty(0, np.int64), []
        more = int(rng.integers(1, 5))
        if len(free) < more:
            break
        new_tokens = _tokens(rng, more)
        new_pages = [free.pop() for _ in range(more)]
        parent = chain_hashes(tokens, PAGE)[-1] if len(pages) else ROOT
        journal.commit(np.array(new_pages), len(pages), new_tokens, parent)
        paths.append((np.concatenate([tokens, new_tokens]), pages + new_pages))
    committed = journal.committed_pages()
    gone = set(rng.choice(committed, min(released, len(committed)), replace=False).tolist()) if len(committed) else set()
    journal.release(np.array(sorted(gone), np.int64))
    bad = set(rng.choice(journal.committed_pages(), min(damaged, len(journal.committed_pages())), replace=False).tolist()) \
        if len(journal.committed_pages()) else set()  # fmt: skip
    for page in bad:
        seg.tokens[page, 0] += 1  # the entry's key no longer matches its tokens
    expected: dict[int, np.ndarray] = {}  # page -> tokens of its whole prefix, for pages every ancestor of which survived
    for tokens, pages in paths:
        for i, page in enumerate(pages):
            if any(p in gone or p in bad for p in pages[: i + 1]):
                break
            expected[page] = tokens[: (i + 1) * PAGE]
    tree, alloc = RadixTree(PAGE), LanePageAllocator(200)
    result = adopt(journal.committed(), tree, alloc, PARTS)
    tree.check_invariants()
    alloc.check_invariants()
    got: dict[int, np.ndarray] = {}
    for node in tree.nodes():
        assert node.host_state is HostState.COMMITTED and node.device_pages is None and node.host_parts == PARTS
        prefix, n = [], node
        while n.parent is not None:
            prefix.append(n.tokens)
            n = n.parent
        whole = np.concatenate(prefix[::-1])
        for i, page in enumerate(node.host_pages):  # type: ignore[union-attr]
            got[int(page)] = whole[: (node.first_position + i + 1) * PAGE]
    assert sorted(got) == sorted(expected)
    entries = journal.committed()
    seq = dict(zip(entries.pages.tolist(), entries.seq.tolist()))
    newest = max(seq.values(), default=0) + 1
    for node in tree.nodes():  # recency survives as commit order, older than any access after the restart
        assert node.last_access == max(seq[int(p)] for p in node.host_pages) - newest < 0  # type: ignore[union-attr]
    for page, tokens in expected.items():
        assert np.array_equal(got[page], tokens), page
    assert alloc.used_pages == result.pages == len(expected)
    assert result.damaged == len(bad) and set(result.dropped.tolist()) | set(expected) == set(journal.committed_pages().tolist())


def test_an_entry_is_committed_only_after_its_fields_and_free_before_reuse() -> None:
    seg = _FakeSegment(geometry())
    journal = Journal(seg, writer=True)  # type: ignore[arg-type]
    real, writes = seg.directory, []

    class Field:  # one field of the directory, recording each write into it
        def __init__(self, name: str) -> None:
            self.name = name

        def __setitem__(self, index: object, value: object) -> None:
            writes.append(self.name)
            real[self.name][index] = value

        def __getitem__(self, index: object) -> object:
            return real[self.name][index]

    class Tokens(np.ndarray):
        def __setitem__(self, index: object, value: object) -> None:
            writes.append("tokens")
            super().__setitem__(index, value)

    seg.directory = type("Recorder", (), {"__getitem__": lambda self, name: Field(name)})()
    seg.tokens = seg.tokens.view(Tokens)
    journal.commit(np.array([3, 4]), 0, _tokens(np.random.default_rng(0), 2), ROOT)
    assert writes[-1] == "state" and {"position", "key", "parent", "seq", "tokens"} <= set(writes[:-1])
    assert "state" not in writes[1:-1]  # the only earlier state write is the reset to FREE, first
    assert real["state"][[3, 4]].tolist() == [COMMITTED, COMMITTED]
    writes.clear()
    journal.release(np.array([3, 5]))  # 5 was never committed
    assert writes == ["state"] and real["state"][3] == FREE and journal.releases == 1


class _FakeSegment:
    """A NodeSegment's arrays in private memory (the journal reads only these)."""

    def __init__(self, g: NodeGeometry) -> None:
        from hicache_cp.node.geometry import ENTRY

        self.geometry = g
        self.directory = np.zeros(g.logical_pages, ENTRY)
        self.tokens = np.zeros((g.logical_pages, PAGE), np.int64)


# ---- opening decisions ------------------------------------------------------------------------------


def test_join_adopt_clean_and_busy(seg_name: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hicache_cp.node.segment")
    first = NodeSegment(seg_name, geometry(), session=11)
    assert first.decision is Decision.CLEAN and first.reason == ""  # a new segment: nothing to say
    assert not [r for r in caplog.records if "not adopted" in r.getMessage()]
    peer = NodeSegment(seg_name, geometry(), session=11)  # another rank of the same engine
    assert peer.decision is Decision.JOIN and peer.generation == first.generation and not peer.adopted
    with pytest.raises(ConsistencyError, match="another layout"):
        NodeSegment(seg_name, geometry(physical_pages=66), session=11)
    with pytest.raises(SegmentBusy, match="in use"):
        NodeSegment(seg_name, geometry(), session=12)  # another engine while this one runs
    Journal(first, writer=True).commit(np.array([5]), 0, _tokens(np.random.default_rng(2), 1), ROOT)
    first.close()
    peer.close()
    restarted = NodeSegment(seg_name, geometry(), session=12)
    assert restarted.decision is Decision.ADOPT and restarted.generation == first.generation + 1
    joiner = NodeSegment(seg_name, geometry(), session=12)
    assert joiner.decision is Decision.JOIN and joiner.adopted  # learns the session kept the journal
    joiner.close()
    assert Journal(restarted, writer=False).committed_pages().tolist() == [5]
    restarted.close()
    caplog.clear()
    other = NodeSegment(seg_name, geometry(layout=PRESETS["tiny"].layout(32), physical_pages=40), session=13)
    assert other.decision is Decision.CLEAN
    lines = [r.getMessage() for r in caplog.records if "not adopted" in r.getMessage()]
    assert len(lines) == 1 and "page_size 16 in the segment, 32 here" in lines[0]
    assert Journal(other, writer=False).committed_pages().tolist() == []  # emptied
    other.close(drop=True)


def test_a_segment_left_initializing_or_without_verification_is_not_adopted(seg_name: str) -> None:
    seg = NodeSegment(seg_name, geometry(), session=1)
    Journal(seg, writer=True).commit(np.array([5]), 0, _tokens(np.random.default_rng(2), 1), ROOT)
    at = HEADER.fields["state"][1]
    seg.segment.mm[at : at + 4] = (1).to_bytes(4, "little")  # type: ignore[index] - INITIALIZING: a crash mid-write
    seg.close()
    again = NodeSegment(seg_name, geometry(), session=2)
    assert again.decision is Decision.CLEAN and "died while initialising" in again.reason
    Journal(again, writer=True).commit(np.array([5]), 0, _tokens(np.random.default_rng(2), 1), ROOT)
    again.close()
    off = NodeSegment(seg_name, geometry(), session=3, adopt=False)
    assert off.decision is Decision.CLEAN and "adoption is off" in off.reason
    assert not Journal(off, writer=False).committed_pages().size
    off.close(drop=True)
