"""L3 keys, object byte layout, chunk lists and error classes (no store needed)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_cp.presets import PRESETS
from hicache_cp.l3.client import MAX_CHUNKS_PER_CALL, call_spans
from hicache_cp.l3.config import L3Config
from hicache_cp.l3.keys import KeyScheme, chain_hashes, chunk_list, layout_fingerprint
from hicache_cp.l3.store import L3Error, L3Timeout, StoreCode

TINY = PRESETS["tiny"]


def _tokens(*ids: int, page: int = 16) -> np.ndarray:
    return np.concatenate([np.full(page, i, dtype=np.int64) for i in ids])


def test_chain_hash_commits_to_the_whole_prefix() -> None:
    a = chain_hashes(_tokens(1, 2, 3), 16)
    b = chain_hashes(_tokens(1, 2, 3, 4), 16)
    c = chain_hashes(_tokens(9, 2, 3), 16)
    assert a == b[:3] and len(set(a)) == 3
    assert all(x != y for x, y in zip(a, c))  # same page 2 and 3, other prefix: other keys
    assert chain_hashes(_tokens(1, 2), 16, parent=a[0])[-1] != a[1]
    assert chain_hashes(_tokens(2), 16, parent=a[0]) == [a[1]]  # continuing a chain


def test_every_layout_field_changes_the_fingerprint() -> None:
    layout = TINY.layout(16)
    base = layout_fingerprint(layout, "tiny", L3Config(), 1)
    variants = [
        layout_fingerprint(TINY.layout(32), "tiny", L3Config(), 1),
        layout_fingerprint(dataclasses.replace(TINY, state_layers=(1, 3)).layout(16), "tiny", L3Config(), 1),
        layout_fingerprint(dataclasses.replace(TINY, kv_bytes_per_token=24).layout(16), "tiny", L3Config(), 1),
        layout_fingerprint(layout, "other-model", L3Config(), 1),
        layout_fingerprint(layout, "tiny", L3Config(kv_dtype="bf16"), 1),
        layout_fingerprint(layout, "tiny", L3Config(pages_per_object=2), 1),
        layout_fingerprint(layout, "tiny", L3Config(group_parts=False), 1),
        layout_fingerprint(layout, "tiny", L3Config(), 2),
    ]
    assert base not in variants and len(set(variants)) == len(variants)
    assert layout_fingerprint(layout, "tiny", L3Config(namespace="x", master="h:1"), 1) == base  # not layout


def test_cp_ranks_own_disjoint_objects_and_whole_groups_only() -> None:
    layout = TINY.layout(16)
    hashes = chain_hashes(_tokens(*range(1, 11)), 16)
    for g in (1, 2, 3):
        cfg = L3Config(pages_per_object=g)
        schemes = [KeyScheme(layout, "tiny", cfg, 2, r) for r in range(2)]
        groups = schemes[0].whole_groups(0, 10)
        assert groups == range(0, 10 // g)
        objs = [s.objects(hashes, groups) for s in schemes]
        pos = [np.concatenate([o.positions for o in os]) for os in objs]
        assert set(pos[0]) | set(pos[1]) == set(range(10 // g * g)) and not set(pos[0]) & set(pos[1])
        assert all(p % 2 == r for r, ps in enumerate(pos) for p in ps)
        assert all(o.key.endswith(f"/all/{r}") for r, os in enumerate(objs) for o in os)
    # a read from position 5 with groups of 4 needs group 1 (positions 4..7) whole
    assert KeyScheme(layout, "tiny", L3Config(pages_per_object=4), 1, 0).whole_groups(5, 10) == range(1, 2)


def test_parts_split_into_objects_of_their_own() -> None:
    layout = TINY.layout(16)
    s = KeyScheme(layout, "tiny", L3Config(group_parts=False, pages_per_object=1), 1, 0)
    objs = s.objects(chain_hashes(_tokens(1, 2), 16), range(0, 2))
    assert len(objs) == 2 * len(layout.parts)
    assert sum(o.nbytes for o in objs) == 2 * layout.bytes_per_page


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12, unique=True))
def test_chunk_list_covers_the_object_in_order_and_coalesces(pages: list[int]) -> None:
    """Chunks are (part, layer, page) ordered, each inside the part's arena at
    its page's slot, and runs of consecutive physical pages become one chunk."""
    layout = TINY.layout(16)
    physical_pages = 41
    bases = {p.part: (i + 1) << 32 for i, p in enumerate(layout.parts)}
    phys = np.array(pages, dtype=np.int64)
    ptrs, sizes = chunk_list(layout.parts, phys, bases, physical_pages)
    assert sum(sizes) == len(pages) * layout.bytes_per_page
    runs = 1 + int((np.diff(phys) != 1).sum())
    assert len(ptrs) == runs * sum(p.num_slots for p in layout.parts)
    expect = []  # byte addresses of the object, in order
    for p in layout.parts:
        for slot in range(p.num_slots):
            for pg in pages:
                expect.append(bases[p.part] + (slot * physical_pages + pg) * p.page_bytes)
    got = []
    for ptr, size in zip(ptrs, sizes):
        part = next(p for p in layout.parts if bases[p.part] <= ptr < bases[p.part] + (1 << 32))
        got += [ptr + k * part.page_bytes for k in range(size // part.page_bytes)]
    assert got == expect


@given(st.lists(st.integers(1, 700), max_size=40))
def test_call_spans_bound_the_transfers_per_call(chunks: list[int]) -> None:
    ptrs = [[0] * n for n in chunks]
    spans = call_spans(ptrs)
    assert [i for lo, hi in spans for i in range(lo, hi)] == list(range(len(chunks)))
    for lo, hi in spans:
        assert hi - lo == 1 or sum(chunks[lo:hi]) <= MAX_CHUNKS_PER_CALL


def test_error_classes() -> None:
    down = L3Error("exists", "lookup failed", code=StoreCode.RPC_FAIL)
    assert down.store_down and not down.io_may_be_in_flight
    missing = L3Error("get", "get failed", code=StoreCode.OBJECT_NOT_FOUND, key="k")
    assert missing.missing and not missing.store_down and "OBJECT_NOT_FOUND" in str(missing) and "key=k" in str(missing)
    assert L3Error("get", "x", code=StoreCode.TRANSFER_FAIL).io_may_be_in_flight
    assert L3Error("get", "x", code=-12345).io_may_be_in_flight and "UNKNOWN(-12345)" in str(L3Error("g", "x", code=-12345))
    assert not L3Error("get", "short read").io_may_be_in_flight
    assert isinstance(L3Timeout("get", "late"), L3Error)
    with pytest.raises(L3Error):
        raise down
