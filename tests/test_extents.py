"""Tests for hostmem.extents: scenarios, errors, random stress, state machine."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from hostmem.extents import ExtentAllocator, ExtentStats, pages_to_pairs, pages_to_runs, runs_to_pages


def extents(a: ExtentAllocator) -> list[tuple[int, int]]:
    """Free extents as half-open ``(start, end)`` pairs."""
    return [(s, s + n) for s, n in a.free_runs().tolist()]


# -- scenarios (free extents written as [start, end)) ---------------------------


def test_scenario_reserve_free_merge() -> None:
    a = ExtentAllocator(10)  # free: [0, 10)
    x = a.reserve(3)  # free: [3, 10)
    y = a.reserve(3)  # free: [6, 10)
    z = a.reserve(4)  # free: (none)
    assert x.tolist() == [[0, 3]] and y.tolist() == [[3, 3]] and z.tolist() == [[6, 4]]
    assert extents(a) == [] and a.free_pages == 0 and a.fragmentation == 0.0
    assert a.reserve(1) is None  # shortfall is a return value, nothing changes
    a.free(x)  # free: [0, 3)
    a.free(z)  # free: [0, 3) [6, 10)
    assert extents(a) == [(0, 3), (6, 10)]
    assert a.largest_free_run == 4 and a.fragmentation == pytest.approx(1 - 4 / 7)
    a.free(y)  # free: [0, 10)  (merged with both neighbours)
    assert extents(a) == [(0, 10)] and a.num_free_extents == 1
    a.check_invariants()


def test_scenario_best_fit_then_fewest_runs() -> None:
    a = ExtentAllocator(20)
    held = [a.reserve(2) for _ in range(10)]  # free: (none); held [0,2) [2,4) ... [18,20)
    a.free(np.concatenate([held[1], held[3]]))  # free: [2, 4) [6, 8)
    a.free(np.array([[10, 6]]))  # pages of held[5..7]; free: [2, 4) [6, 8) [10, 16)
    # best fit: the smallest extent holding 2 pages, lowest start on ties
    assert a.reserve(2).tolist() == [[2, 2]]  # free: [6, 8) [10, 16)
    # 3 pages fit only in [10, 16): take its front
    assert a.reserve(3).tolist() == [[10, 3]]  # free: [6, 8) [13, 16)
    # 5 pages fit nowhere: largest first ([13, 16)), then best fit for the rest
    assert a.reserve(5).tolist() == [[6, 2], [13, 3]]  # free: (none)
    assert a.free_pages == 0
    a.check_invariants()


def test_scenario_first_fit() -> None:
    a = ExtentAllocator(12)
    a.reserve(12)  # free: (none)
    a.free([[0, 2], [5, 1], [8, 4]])  # free: [0, 2) [5, 6) [8, 12)
    # lowest addresses first, even though [8, 12) holds all 4
    assert a.reserve(4, prefer_contiguous=False).tolist() == [[0, 2], [5, 1], [8, 1]]  # free: [9, 12)
    assert extents(a) == [(9, 12)]
    a.check_invariants()


def test_partial_free_splits_a_held_run() -> None:
    a = ExtentAllocator(16)
    r = a.reserve(16)  # free: (none)
    assert r.tolist() == [[0, 16]]
    a.free([[4, 4]])  # free: [4, 8)
    a.free([[12, 2], [8, 2]])  # free: [4, 10) [12, 14)
    assert extents(a) == [(4, 10), (12, 14)]
    a.free([[10, 2]])  # free: [4, 14)
    assert extents(a) == [(4, 14)]
    a.check_invariants()


def test_stats_dataclass() -> None:
    a = ExtentAllocator(100)
    a.reserve(10)
    assert a.stats() == ExtentStats(
        num_pages=100,
        free_pages=90,
        used_pages=10,
        num_free_extents=1,
        largest_free_run=90,
        fragmentation=0.0,
    )


# -- errors --------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -3])
def test_reserve_non_positive(n: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        ExtentAllocator(8).reserve(n)


@pytest.mark.parametrize(
    ("runs", "match"),
    [
        ([[4, 2]], r"pages \[4, 6\) overlap free extent \[4, 8\)"),  # double free of r
        ([[6, 1]], r"pages \[6, 7\) overlap free extent"),  # never reserved
        ([[7, 3]], r"outside pages \[0, 8\)"),  # out of range
        ([[-1, 1]], "outside"),  # negative page
        ([[1, 0]], "non-positive length"),
        ([[1, -2]], "non-positive length"),
        ([[0, 2], [1, 1]], "overlap each other"),
        ([[0, 1, 2]], "shape"),
    ],
)
def test_invalid_free_raises_and_changes_nothing(runs: list[list[int]], match: str) -> None:
    a = ExtentAllocator(8)
    a.reserve(4)  # free: [4, 8)
    r = a.reserve(2)  # free: [6, 8)
    a.free(r)  # free: [4, 8) ; pages [0, 4) held
    before = (extents(a), a.free_pages)
    with pytest.raises(ValueError, match=match):
        a.free(runs)
    assert (extents(a), a.free_pages) == before
    a.check_invariants()


def test_failing_free_is_atomic_across_runs() -> None:
    a = ExtentAllocator(10)
    a.reserve(10)
    a.free([[8, 2]])  # free: [8, 10)
    with pytest.raises(ValueError, match=r"\[9, 10\)"):
        a.free([[0, 2], [9, 1]])  # first run valid, second a double free
    assert extents(a) == [(8, 10)] and a.free_pages == 2


def test_empty_free_is_a_noop() -> None:
    a = ExtentAllocator(4)
    a.free(np.empty((0, 2), dtype=np.int64))
    assert a.free_pages == 4


# -- runs <-> pages --------------------------------------------------------------


def test_runs_pages_round_trip() -> None:
    runs = np.array([[3, 2], [9, 1], [20, 4]])
    pages = runs_to_pages(runs)
    assert pages.tolist() == [3, 4, 9, 20, 21, 22, 23]
    assert pages_to_runs(pages[::-1]).tolist() == runs.tolist()
    assert pages_to_runs([5, 6, 7, 4]).tolist() == [[4, 4]]
    assert pages_to_runs([]).shape == (0, 2)
    assert runs_to_pages(np.empty((0, 2), dtype=np.int64)).size == 0
    with pytest.raises(ValueError, match="duplicate"):
        pages_to_runs([1, 2, 2])


# -- properties --------------------------------------------------------------------


def test_best_fit_and_fewest_runs_properties() -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        a = ExtentAllocator(300)
        held = [a.reserve(int(rng.integers(1, 12))) for _ in range(40)]
        for i in rng.permutation(len(held))[:20]:
            if held[i] is not None:
                a.free(held[i])
        n = int(rng.integers(1, 40))
        lengths = sorted(a.free_runs()[:, 1].tolist(), reverse=True)
        free = extents(a)
        got = a.reserve(n)
        if n > sum(lengths):
            assert got is None
            continue
        assert got is not None and int(got[:, 1].sum()) == n
        fits = [(e - s, s) for s, e in free if e - s >= n]
        if fits:
            length, start = min(fits)  # smallest, then lowest start
            assert got.tolist() == [[start, n]]
        else:
            fewest = int(np.searchsorted(np.cumsum(lengths), n)) + 1
            assert got.shape[0] == fewest
        a.check_invariants()


# -- seeded random stress against a bitmap model ------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_random_stress_against_bitmap(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_pages = 2000
    a = ExtentAllocator(num_pages)
    model = np.ones(num_pages, dtype=bool)  # True = free
    held: list[np.ndarray] = []
    for step in range(10_000):
        action = rng.random()
        if action < 0.5 or not held:
            n = int(rng.integers(1, 80))
            runs = a.reserve(n, prefer_contiguous=bool(rng.random() < 0.8))
            if runs is None:
                assert model.sum() < n
            else:
                pages = runs_to_pages(runs)
                assert pages.size == n and model[pages].all(), f"step {step}: handed out used pages"
                model[pages] = False
                assert np.all(np.diff(runs[:, 0]) > 0)
                held.append(runs)
        elif action < 0.85:
            runs = held.pop(int(rng.integers(len(held))))
            a.free(runs)
            model[runs_to_pages(runs)] = True
        else:  # partial free: give back a sub-run of one held run
            i = int(rng.integers(len(held)))
            pages = runs_to_pages(held[i])
            lo = int(rng.integers(pages.size))
            hi = int(rng.integers(lo + 1, pages.size + 1))
            part = pages[lo:hi]
            a.free(pages_to_runs(part))
            model[part] = True
            rest = np.concatenate([pages[:lo], pages[hi:]])
            if rest.size:
                held[i] = pages_to_runs(rest)
            else:
                held.pop(i)
        a.check_invariants()
        assert a.free_pages == int(model.sum())
        assert extents(a) == [(s, s + n) for s, n in pages_to_runs(np.flatnonzero(model)).tolist()]


# -- hypothesis state machine ----------------------------------------------------------


class ExtentMachine(RuleBasedStateMachine):
    """Reserve, free and partially free; invariants and a set model after every step."""

    NUM_PAGES = 128
    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.alloc = ExtentAllocator(self.NUM_PAGES)
        self.used: set[int] = set()

    @rule(target=held, n=st.integers(1, 48), contiguous=st.booleans())
    def reserve(self, n: int, contiguous: bool) -> np.ndarray:
        runs = self.alloc.reserve(n, prefer_contiguous=contiguous)
        if runs is None:
            assert self.NUM_PAGES - len(self.used) < n
            return np.empty(0, dtype=np.int64)
        pages = set(runs_to_pages(runs).tolist())
        assert len(pages) == n and not pages & self.used
        if contiguous and runs.shape[0] > 1:
            assert self.alloc.largest_free_run < n  # split only when no free run could hold n
        self.used |= pages
        return runs_to_pages(runs)

    @rule(pages=consumes(held))
    def free(self, pages: np.ndarray) -> None:
        if pages.size:
            self.alloc.free(pages_to_runs(pages))
            self.used -= set(pages.tolist())

    @rule(target=held, pages=consumes(held), data=st.data())
    def free_part(self, pages: np.ndarray, data: st.DataObject) -> np.ndarray:
        if pages.size == 0:
            return pages
        lo = data.draw(st.integers(0, pages.size - 1))
        hi = data.draw(st.integers(lo + 1, pages.size))
        self.alloc.free(pages_to_runs(pages[lo:hi]))
        self.used -= set(pages[lo:hi].tolist())
        return np.concatenate([pages[:lo], pages[hi:]])

    @rule(data=st.data())
    def free_of_free_page_rejected(self, data: st.DataObject) -> None:
        free = sorted(set(range(self.NUM_PAGES)) - self.used)
        if not free:
            return
        page = data.draw(st.sampled_from(free))
        before = extents(self.alloc)
        with pytest.raises(ValueError, match="overlap free extent"):
            self.alloc.free([[page, 1]])
        assert extents(self.alloc) == before

    @invariant()
    def consistent(self) -> None:
        self.alloc.check_invariants()
        assert self.alloc.free_pages == self.NUM_PAGES - len(self.used)


ExtentMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestExtentMachine = ExtentMachine.TestCase


# -- the tuple API, fast paths and the invariant check ------------------------------


def test_pairs_api_makes_the_same_choices_as_the_numpy_api() -> None:
    """reserve_pairs/free_pairs and reserve/free are one allocator: same pages, same state."""
    rng = np.random.default_rng(11)
    a, b = ExtentAllocator(500), ExtentAllocator(500)
    held: list[list[tuple[int, int]]] = []
    for _ in range(600):
        if held and rng.random() < 0.45:
            pairs = held.pop(int(rng.integers(len(held))))
            a.free_pairs(pairs)
            b.free(np.array(pairs))
        else:
            n = int(rng.integers(1, 60))
            got = a.reserve_pairs(n)
            runs = b.reserve(n)
            assert (got is None) == (runs is None)
            if got is not None:
                assert [list(p) for p in got] == runs.tolist() and got == sorted(got)
                held.append(got)
        assert extents(a) == extents(b)
    a.check_invariants()


def test_free_pairs_any_order_merges_and_rejects_overlaps() -> None:
    a = ExtentAllocator(20)
    a.reserve_pairs(20)  # free: (none)
    a.free_pairs([(10, 2), (2, 3), (5, 5)])  # unsorted; free: [2, 12)
    assert extents(a) == [(2, 12)] and a.free_pages == 10
    with pytest.raises(ValueError, match=r"overlap each other: pages \[12, 15\) and \[13, 14\)"):
        a.free_pairs([(13, 1), (12, 3)])
    with pytest.raises(ValueError, match=r"pages \[11, 13\) overlap free extent \[2, 12\)"):
        a.free_pairs([(11, 2)])
    with pytest.raises(ValueError, match="non-positive"):
        a.free_pairs([(14, 0)])
    assert extents(a) == [(2, 12)] and a.free_pages == 10
    a.validate_free_pairs([(12, 8), (0, 2)])  # changes nothing
    assert extents(a) == [(2, 12)]
    a.free_pairs([(12, 8), (0, 2)])  # free: [0, 20)
    assert extents(a) == [(0, 20)] and a.num_free_extents == 1
    a.check_invariants()


def test_largest_first_takes_the_highest_start_on_ties() -> None:
    a = ExtentAllocator(12)
    a.reserve_pairs(12)
    a.free_pairs([(0, 3), (4, 3), (8, 3)])  # free: [0, 3) [4, 7) [8, 11)
    # 7 pages fit nowhere: largest whole (three of length 3: highest start first), then best fit
    assert a.reserve_pairs(7) == [(0, 1), (4, 3), (8, 3)]  # free: [1, 3)
    assert extents(a) == [(1, 3)]
    a.check_invariants()


def test_page_is_free() -> None:
    a = ExtentAllocator(4)
    a.reserve_pairs(2)  # free: [2, 4)
    assert [a.page_is_free(p) for p in range(4)] == [False, False, True, True]
    with pytest.raises(IndexError):
        a.page_is_free(4)


@pytest.mark.parametrize(
    ("pages", "pairs"),
    [
        ([5], [(5, 1)]),
        ([5, 6, 7], [(5, 3)]),  # one run: the byte comparison
        ([5, 6, 9, 10, 20], [(5, 2), (9, 2), (20, 1)]),  # ascending with gaps: one difference
        ([9, 3, 4], [(3, 2), (9, 1)]),  # any order: the sort
        ([5, 7, 6], [(5, 3)]),  # the span of one run, out of order
        ([4, 6, 5, 5], None),  # a duplicate inside a run's span
        ([1, 2, 2, 3], None),  # a duplicate in ascending order
        (list(range(0, 200, 2)), [(p, 1) for p in range(0, 200, 2)]),  # past _FEW_BREAKS: the sort
        ([], []),
    ],
)
def test_pages_to_pairs(pages: list[int], pairs: list[tuple[int, int]] | None) -> None:
    if pairs is None:
        with pytest.raises(ValueError, match="duplicate"):
            pages_to_pairs(np.array(pages, dtype=np.int64))
        return
    assert pages_to_pairs(np.array(pages, dtype=np.int64)) == pairs
    assert pages_to_pairs(pages) == [tuple(r) for r in pages_to_runs(pages).tolist()]


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (lambda a: a._by_end.pop(next(iter(a._by_end))), "start and end indices disagree"),
        (lambda a: a._starts_of[a._lengths[0]].append(9999), "length buckets disagree"),
        (lambda a: a._lengths.append(12345), "length list"),
        (lambda a: a._free_map.__setitem__(0, 1), "byte map disagrees"),
    ],
)
def test_check_invariants_catches_corruption(corrupt: object, match: str) -> None:
    a = ExtentAllocator(100)
    held = [a.reserve_pairs(10) for _ in range(5)]
    a.free_pairs(held[1])
    a.free_pairs(held[3])  # free: [10, 20) [30, 40) [50, 100)
    a.check_invariants()
    corrupt(a)  # type: ignore[operator]
    with pytest.raises(AssertionError, match=match):
        a.check_invariants()
