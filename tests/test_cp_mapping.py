"""CP shared-KV page mapping and the lane allocator (docs/invariants.md, CP shared KV)."""

from __future__ import annotations

import numpy as np
import pytest

from hicache_cp.cp import mapping as cpm
from hicache_cp.allocator import LanePageAllocator


def test_docstring_example_cp2() -> None:
    logical = np.arange(7)
    assert cpm.owner(logical, 2).tolist() == [-1, 0, 1, 0, 1, 0, 1]  # page 0: dummy, never owned
    assert cpm.to_physical(logical, 2).tolist() == [0, 1, 1, 2, 2, 3, 3]


def test_cp3_and_inverse() -> None:
    logical = np.arange(10)
    assert cpm.owner(logical, 3).tolist() == [-1, 0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert cpm.to_physical(logical, 3).tolist() == [0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    for cp in (1, 2, 3, 4):
        pages = np.arange(1, 50)
        back = cpm.to_logical(cpm.to_physical(pages, cp), cpm.owner(pages, cp), cp)
        assert back.tolist() == pages.tolist()
    assert cpm.to_logical(np.array([0]), 1, 3).tolist() == [0]
    assert cpm.logical_capacity(5, 2) == 9


def test_owned_pages_positions_are_request_absolute() -> None:
    pages = np.array([7, 8, 9, 10])  # a chunk whose first page is request position 4
    phys, pos = cpm.owned_pages(pages, 0, 2, first_position=4)
    assert phys.tolist() == cpm.to_physical(np.array([7, 9]), 2).tolist() == [4, 5]
    assert pos.tolist() == [4, 6]  # never chunk-local [0, 2]
    phys1, pos1 = cpm.owned_pages(pages, 1, 2, first_position=4)
    assert pos1.tolist() == [5, 7] and phys1.tolist() == [4, 5]


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("first", [0, 1, 5])
def test_lane_allocator_lanes_and_runs(cp: int, first: int) -> None:
    a = LanePageAllocator(9, cp)
    assert a.capacity == 8 * cp and a.free_pages == a.capacity
    n = 3 * cp + 1
    pages = a.alloc(n, first)
    assert pages is not None and len(np.unique(pages)) == n
    owners = cpm.owner(pages, cp)
    assert owners.tolist() == [(first + i) % cp for i in range(n)]  # position i from lane i % cp
    for r in range(cp):  # each lane hands out one contiguous physical run on a fresh pool
        phys = cpm.to_physical(pages[owners == r], cp)
        assert phys.tolist() == list(range(phys[0], phys[0] + len(phys)))
        assert 0 not in phys  # the dummy page is never handed out
    assert a.used_pages == n
    a.free(pages)
    assert a.free_pages == a.capacity and a.used_pages == 0
    a.check_invariants()


def test_lane_allocator_short_lane_returns_none() -> None:
    a = LanePageAllocator(3, 2)  # 2 pages per lane
    assert a.alloc(3, 0) is not None  # lanes 0, 1, 0
    assert not a.fits(2, 0) and a.fits(1, 1)
    assert a.alloc(2, 0) is None  # lane 0 is empty: nothing reserved
    assert a.free_pages == 1


def test_bad_free_changes_nothing() -> None:
    a = LanePageAllocator(9, 2)
    pages = a.alloc(6, 0)
    assert pages is not None
    before = (a.free_pages, a.lane_free_pages())
    for bad in (np.array([0]), np.array([999]), np.array([-3])):
        with pytest.raises(ValueError):
            a.free(bad)
        assert (a.free_pages, a.lane_free_pages()) == before
    free_page = int(np.setdiff1d(np.arange(1, a.capacity + 1), pages)[0])
    with pytest.raises(ValueError):  # one good page and one never allocated: neither freed
        a.free(np.array([pages[0], free_page]))
    assert (a.free_pages, a.lane_free_pages()) == before
    a.free(pages[:2])
    with pytest.raises(ValueError):  # double free
        a.free(pages[:1])
    a.check_invariants()


def test_allocator_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        LanePageAllocator(1, 1)
    with pytest.raises(ValueError):
        LanePageAllocator(4, 0)
    with pytest.raises(ValueError):
        LanePageAllocator(4, 1).alloc(-1)
