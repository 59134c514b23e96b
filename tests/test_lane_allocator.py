"""LanePageAllocator: fast paths against the general ones, errors, and a hypothesis state machine."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from hicache_cp.cp import mapping as cpm
from hicache_cp.allocator import LanePageAllocator


def lane_runs(a: LanePageAllocator) -> list[list[tuple[int, int]]]:
    return [[(s, k) for s, k in lane.free_runs().tolist()] for lane in a.lanes]


# -- scenarios ------------------------------------------------------------------


def test_cp1_multi_run_alloc_and_slices() -> None:
    a = LanePageAllocator(21, 1)  # logical pages 1..20
    x = a.alloc(20)
    assert x.tolist() == list(range(1, 21))
    a.free(x[2:5])  # free: 3..5
    a.free(x[10:14])  # free: 3..5, 11..14
    y = a.alloc(6)  # no run of 6: the largest (11..14) whole, then the best fit for 2
    assert y.tolist() == [3, 4, 11, 12, 13, 14]  # free: 5
    a.free(y[1:5])  # a slice spanning two runs: 4, 11, 12, 13; free: 4..5, 11..13
    assert lane_runs(a) == [[(4, 2), (11, 3)]]
    a.free(np.array([14, 3]))  # any order; free: 3..5, 11..14
    assert lane_runs(a) == [[(3, 3), (11, 4)]]
    a.check_invariants()


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_lanes_multi_run(cp: int) -> None:
    a = LanePageAllocator(9, cp)  # 8 physical pages a lane
    x = a.alloc(8 * cp)
    owners = cpm.owner(x, cp)
    assert owners.tolist() == [i % cp for i in range(8 * cp)]
    a.free(x[2 * cp : 4 * cp])  # two physical pages of every lane
    a.free(x[6 * cp : 7 * cp])  # one more of every lane: each lane has two free runs
    y = a.alloc(3 * cp, first_position=1)
    assert y is not None and len(np.unique(y)) == 3 * cp
    assert cpm.owner(y, cp).tolist() == [(1 + i) % cp for i in range(3 * cp)]
    for r in range(cp):  # every lane took both of its runs: physical 3, 4 and 7
        assert sorted(cpm.to_physical(y[cpm.owner(y, cp) == r], cp).tolist()) == [3, 4, 7]
    a.free(y[::-1])  # reversed: the general path
    a.free(np.concatenate([x[: 2 * cp], x[4 * cp : 6 * cp], x[7 * cp :]]))
    assert a.free_pages == a.capacity
    a.check_invariants()


@pytest.mark.parametrize("cp", [1, 2])
def test_bad_frees_change_nothing(cp: int) -> None:
    a = LanePageAllocator(11, cp)
    x = a.alloc(6 * cp)
    a.free(x[:cp])
    before = (a.free_pages, lane_runs(a))
    bad_inputs = [
        x[:cp],  # double free (fast path)
        x[: 2 * cp][::-1],  # partly double free (general path)
        np.array([0]),  # the dummy page
        np.array([-1]),
        np.array([a.capacity + 1]),
        np.concatenate([x[cp : 2 * cp], x[cp : cp + 1]]),  # a repeated page
        np.array([x[2 * cp], 7 * cp + 1]),  # a page never reserved: physical 8 of lane 0
    ]
    for bad in bad_inputs:
        with pytest.raises(ValueError):
            a.free(bad)
        assert (a.free_pages, lane_runs(a)) == before, bad
    a.check_invariants()


def test_a_run_shaped_list_with_a_repeat_is_not_a_run() -> None:
    """[p, p, p + 2] spans three pages like a run does; freeing it must not free p + 1."""
    a = LanePageAllocator(20, 1)
    x = a.alloc(10)
    p = int(x[3])
    before = (a.free_pages, lane_runs(a))
    with pytest.raises(ValueError, match="duplicate"):
        a.free(np.array([p, p, p + 2]))
    with pytest.raises(ValueError, match="duplicate"):
        a.free(np.array([p, p + 2, p + 2, p + 3]))  # ascending runs with a repeat
    assert (a.free_pages, lane_runs(a)) == before
    a.free(np.array([p, p + 2]))  # two runs of one page: page p + 1 stays reserved
    assert not a.lanes[0].page_is_free(p + 1)
    a.check_invariants()


def test_dummy_page_never_handed_out_or_freed() -> None:
    a = LanePageAllocator(3, 1)
    assert a.alloc(2).tolist() == [1, 2]
    assert a.alloc(1) is None
    with pytest.raises(ValueError, match="out of range"):
        a.free(np.array([0, 1]))
    a.lanes[0].free_pairs([(0, 1)])  # corrupt: the dummy page freed behind the allocator's back
    with pytest.raises(AssertionError, match="dummy page"):
        a.check_invariants()


def test_free_takes_lists_and_other_dtypes() -> None:
    a = LanePageAllocator(10, 1)
    x = a.alloc(5)
    a.free(x[:2].astype(np.int32))
    a.free([int(p) for p in x[2:]])
    assert a.free_pages == a.capacity
    a.check_invariants()


def test_replicas_agree() -> None:
    """Two replicas fed the same calls return the same pages (no hidden nondeterminism)."""
    rng = np.random.default_rng(5)
    a, b = LanePageAllocator(300, 2), LanePageAllocator(300, 2)
    held: list[np.ndarray] = []
    for _ in range(400):
        if held and rng.random() < 0.5:
            pages = held.pop(int(rng.integers(len(held))))
            lo = int(rng.integers(len(pages)))
            a.free(pages[lo:])
            b.free(pages[lo:].copy())
            if lo:
                held.append(pages[:lo])
        else:
            n, first = int(rng.integers(1, 40)), int(rng.integers(0, 7))
            x, y = a.alloc(n, first), b.alloc(n, first)
            assert (x is None and y is None) or np.array_equal(x, y)
            if x is not None:
                held.append(x)
    assert lane_runs(a) == lane_runs(b)


# -- hypothesis state machine ------------------------------------------------------


class LaneMachine(RuleBasedStateMachine):
    """Alloc, free whole or in slices or shuffled; a set model and the invariants after every step."""

    PHYSICAL = 24
    held = Bundle("held")

    @initialize(cp=st.integers(1, 3))
    def setup(self, cp: int) -> None:
        self.alloc = LanePageAllocator(self.PHYSICAL, cp)
        self.cp = cp
        self.used: set[int] = set()

    @rule(target=held, n=st.integers(1, 30), first=st.integers(0, 5))
    def allocate(self, n: int, first: int) -> np.ndarray:
        fits = self.alloc.fits(n, first)
        pages = self.alloc.alloc(n, first)
        assert (pages is not None) == fits
        if pages is None:
            return np.empty(0, dtype=np.int64)
        assert len(pages) == n and len(set(pages.tolist())) == n
        assert not set(pages.tolist()) & self.used
        assert pages.min() >= 1 and pages.max() <= self.alloc.capacity
        assert cpm.owner(pages, self.cp).tolist() == [(first + i) % self.cp for i in range(n)]
        self.used |= set(pages.tolist())
        return pages

    @rule(pages=consumes(held), order=st.sampled_from(["as_is", "reversed", "shuffled"]), data=st.data())
    def free(self, pages: np.ndarray, order: str, data: st.DataObject) -> None:
        if pages.size == 0:
            return
        if order == "reversed":
            pages = pages[::-1]
        elif order == "shuffled":
            pages = np.array(data.draw(st.permutations(pages.tolist())), dtype=np.int64)
        self.alloc.free(pages)
        self.used -= set(pages.tolist())

    @rule(target=held, pages=consumes(held), data=st.data())
    def free_slice(self, pages: np.ndarray, data: st.DataObject) -> np.ndarray:
        if pages.size == 0:
            return pages
        lo = data.draw(st.integers(0, pages.size - 1))
        hi = data.draw(st.integers(lo + 1, pages.size))
        self.alloc.free(pages[lo:hi])
        self.used -= set(pages[lo:hi].tolist())
        return np.concatenate([pages[:lo], pages[hi:]])

    @rule(data=st.data())
    def bad_free_rejected(self, data: st.DataObject) -> None:
        free = sorted(set(range(self.alloc.capacity + 2)) - self.used)  # includes page 0 and capacity + 1
        page = data.draw(st.sampled_from(free))
        extra = sorted(self.used)[:1]
        before = (self.alloc.free_pages, lane_runs(self.alloc))
        with pytest.raises(ValueError):
            self.alloc.free(np.array(extra + [page], dtype=np.int64))
        assert (self.alloc.free_pages, lane_runs(self.alloc)) == before

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "alloc"):
            return
        self.alloc.check_invariants()
        assert self.alloc.used_pages == len(self.used)


LaneMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestLaneMachine = LaneMachine.TestCase
