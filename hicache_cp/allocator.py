"""LanePageAllocator: logical page ids over the CP lanes of one pool's physical pages.

Both pools (`hicache_cp.pools`) allocate through one: a reservation's logical
ids are valid in every part's buffer, and the page at request-absolute
position i comes from lane i mod cp_size (rank i mod cp_size's pages)."""

from __future__ import annotations

import numpy as np

from hicache_cp.cp import mapping as cp_mapping
from hostmem.extents import ExtentAllocator, pages_to_pairs, runs_to_pages

_INT64 = np.dtype(np.int64)


class LanePageAllocator:
    """Logical page allocator over `cp_size` lanes of physical pages.

    The page at request-absolute position i comes from lane i mod cp_size, so
    a prefix's pages have the same owners in every request that shares it.
    Each lane is an `ExtentAllocator` over physical pages [0, physical_pages)
    with physical page 0 held back as the dummy page; reserves prefer
    contiguous physical runs. The allocator is replicated: every rank runs the
    same calls and reaches the same state (every choice is a function of the
    call sequence), so allocation needs no collective.

    alloc: O(k (log e + m)) for k runs over e free extents (m: extents of one
    length, see `hostmem.extents`), plus one copy of a slice of a read-only
    table of every logical page id per run (8 bytes a page, kept for the
    allocator's life) to build the page array it returns.
    free: a slice of one reservation (ascending pages) is recognised by
    comparing it with the id table: one byte comparison for one run, one
    comparison and argmax a run for a few; anything else is sorted and
    coalesced, vectorised. No per-page Python loop either way. Measured with
    `hicache-cp bench-alloc` (bench/results/bench-alloc-cpu.json).
    """

    def __init__(self, physical_pages: int, cp_size: int = 1, name: str = "pool") -> None:
        if physical_pages < 2:
            raise ValueError(f"{name}: need at least 2 physical pages (page 0 is the dummy), got {physical_pages}")
        if cp_size < 1:
            raise ValueError(f"{name}: cp_size must be >= 1, got {cp_size}")
        self.name = name
        self.physical_pages = physical_pages
        self.cp_size = cp_size
        self.lanes = [ExtentAllocator(physical_pages) for _ in range(cp_size)]
        for lane in self.lanes:
            dummy = lane.reserve_pairs(1)
            assert dummy == [(0, 1)], dummy
        # Every logical page id, read-only: alloc copies slices of it (cheaper than
        # np.arange) and free compares page arrays against it. 8 bytes a page.
        self._ids = np.arange(self.capacity + 1, dtype=np.int64)
        self._ids.flags.writeable = False

    @property
    def capacity(self) -> int:
        """Allocatable logical pages (the dummy page excluded)."""
        return (self.physical_pages - 1) * self.cp_size

    @property
    def free_pages(self) -> int:
        return sum(lane.free_pages for lane in self.lanes)

    @property
    def used_pages(self) -> int:
        return self.capacity - self.free_pages

    def lane_free_pages(self) -> list[int]:
        return [lane.free_pages for lane in self.lanes]

    def fits(self, n: int, first_position: int = 0) -> bool:
        need = self._lane_counts(n, first_position)
        return all(lane.free_pages >= k for lane, k in zip(self.lanes, need))

    def alloc(self, n: int, first_position: int = 0) -> np.ndarray | None:
        """Logical pages (int64, in position order) for request positions
        [first_position, first_position + n).

        Returns None (nothing reserved) when any lane is short; ValueError when n < 0.
        """
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} pages")
        if n == 0:
            return np.empty(0, dtype=np.int64)
        cp = self.cp_size
        if cp == 1:  # logical page == physical page
            pairs = self.lanes[0].reserve_pairs(n)
            if pairs is None:
                return None
            ids = self._ids
            if len(pairs) == 1:
                start = pairs[0][0]
                return ids[start : start + n].copy()
            if len(pairs) > _FEW_SLICES:
                return _pairs_to_pages(pairs)
            out = np.empty(n, dtype=np.int64)
            i = 0
            for start, k in pairs:
                out[i : i + k] = ids[start : start + k]
                i += k
            return out
        need = self._lane_counts(n, first_position)
        if not all(lane.free_pages >= k for lane, k in zip(self.lanes, need)):
            return None
        out = np.empty(n, dtype=np.int64)
        ids = self._ids
        for rank, (lane, k) in enumerate(zip(self.lanes, need)):
            if k == 0:
                continue
            pairs = lane.reserve_pairs(k)
            assert pairs is not None, (self.name, rank, k, lane.free_pages)
            # Positions owned by lane `rank` are every cp-th one from the first such
            # position; physical page q of the lane is logical (q - 1) * cp + rank + 1,
            # so a physical run is a stride-cp slice of the id table.
            offset = (rank - first_position) % cp
            if len(pairs) <= _FEW_SLICES:
                slices = [ids[(q - 1) * cp + rank + 1 : q * cp + rank + 1 + cp * (m - 1) : cp] for q, m in pairs]
                out[offset::cp] = slices[0] if len(slices) == 1 else np.concatenate(slices)
            else:
                out[offset::cp] = (_pairs_to_pages(pairs) - 1) * cp + (rank + 1)
        return out

    def free(self, pages: np.ndarray) -> None:
        """Return logical pages (any order); ValueError (nothing freed) on a bad page."""
        if type(pages) is not np.ndarray or pages.dtype is not _INT64 or pages.ndim != 1:
            pages = np.asarray(pages, dtype=np.int64).ravel()
        n = len(pages)
        if n == 0:
            return
        if self.cp_size == 1:
            # Fast path: ascending consecutive pages (a reservation, or a slice of one).
            first, last = pages.item(0), pages.item(n - 1)
            if 1 <= first and last == first + n - 1 and last <= self.capacity and (
                n == 1 or pages.tobytes() == self._ids[first : last + 1].tobytes()
            ):
                pairs = [(first, n)]
            else:
                pairs = self._ascending_runs(pages, n) or self._lane_pairs(pages)[0]
            try:  # one lane: its own validation is already all or nothing
                self.lanes[0].free_pairs(pairs)
            except ValueError as exc:
                raise ValueError(f"{self.name} lane 0: {exc}") from None
            return
        lane_pairs = self._lane_pairs(pages)
        # Validate every lane before freeing any, so a bad call changes nothing.
        for rank, pairs in enumerate(lane_pairs):
            if pairs:
                try:
                    self.lanes[rank].validate_free_pairs(pairs)
                except ValueError as exc:
                    raise ValueError(f"{self.name} lane {rank}: {exc}") from None
        for rank, pairs in enumerate(lane_pairs):
            if pairs:
                self.lanes[rank].free_pairs(pairs)

    def adopt(self, pages: np.ndarray) -> None:
        """Mark exactly these logical pages used, on a fresh allocator (a restarted
        engine adopting the host copies a node segment's journal lists). ValueError
        (nothing changed) on a used allocator, a repeated page or one out of range.
        O(runs): each lane is taken whole, then everything else is given back."""
        if self.used_pages:
            raise ValueError(f"{self.name}: adopt needs a fresh allocator, {self.used_pages} pages are in use")
        pages = np.asarray(pages, dtype=np.int64)
        lane_pairs = self._lane_pairs(pages) if len(pages) else [[] for _ in self.lanes]
        for rank, lane in enumerate(self.lanes):
            edges = np.zeros(self.physical_pages + 1, dtype=np.int32)  # +1 where a run starts, -1 past its end
            for start, k in lane_pairs[rank]:
                edges[start] += 1
                edges[start + k] -= 1
            used = np.cumsum(edges[:-1]) > 0
            used[0] = True  # the dummy page is the lane's already
            free = np.flatnonzero(~used)
            lane.reserve_pairs(lane.free_pages)  # the whole lane (one run: it is fresh)
            if len(free):
                lane.free_pairs(pages_to_pairs(free))

    def fragmentation(self) -> float:
        return max(lane.fragmentation for lane in self.lanes)

    def num_free_extents(self) -> int:
        return sum(lane.num_free_extents for lane in self.lanes)

    def check_invariants(self) -> None:
        for rank, lane in enumerate(self.lanes):
            lane.check_invariants()
            if lane.page_is_free(0):
                raise AssertionError(f"{self.name} lane {rank}: the dummy page 0 is free")

    def _ascending_runs(self, pages: np.ndarray, n: int) -> list[tuple[int, int]] | None:
        """Runs of `pages` (cp_size 1) when they ascend in at most `_FEW_RUNS` runs
        inside [1, capacity], else None (the general path decides).

        Each run's end is the first entry that differs from the id table slice
        starting at the run's first page (one comparison and one argmax), and
        the last run is checked whole: a few numpy calls a run, no sort.
        """
        ids, capacity = self._ids, self.capacity
        last = pages.item(n - 1)
        pairs: list[tuple[int, int]] = []
        i = 0
        for _ in range(_FEW_RUNS):
            first, rest = pages.item(i), n - i
            if first < 1 or first + rest - 1 > capacity:
                return None  # out of range (ascending pages only grow), or not ascending
            segment = pages[i:] if i else pages
            if last == first + rest - 1:
                if rest == 1 or segment.tobytes() == ids[first : last + 1].tobytes():
                    pairs.append((first, rest))
                    return pairs
                return None
            j = int((segment != ids[first : first + rest]).argmax())  # >= 1: entry 0 is `first`
            if pages.item(i + j) < first + j:
                return None  # the next entry is not past this run: not ascending
            pairs.append((first, j))
            i += j
        return None

    def _lane_pairs(self, pages: np.ndarray) -> list[list[tuple[int, int]]]:
        """Physical (start, length) runs per lane of int64 logical `pages`; ValueError
        when a page is out of range [1, capacity] or repeated."""
        cp = self.cp_size
        n = pages.shape[0]
        ids = self._ids
        if cp == 1:
            pairs = pages_to_pairs(pages)
            last_start, last_len = pairs[-1]
            if pairs[0][0] < 1 or last_start + last_len - 1 > self.capacity:
                raise ValueError(self._range_error(pages))
            return [pairs]
        out: list[list[tuple[int, int]]] = [[] for _ in range(cp)]
        # Fast path: a slice of one reservation holds, from each lane, every cp-th
        # entry, ascending: logical pages of one owner whose physical pages form
        # one run (checked against the id table) or a few ascending runs.
        for j in range(min(cp, n)):
            lane_pages = pages[j::cp]
            first, m = lane_pages.item(0), len(lane_pages)
            if first < 1:
                break
            rank = (first - 1) % cp
            last = first + cp * (m - 1)
            if last <= self.capacity and lane_pages.item(m - 1) == last and (
                m == 1 or lane_pages.tobytes() == ids[first : last + 1 : cp].tobytes()
            ):
                out[rank].append(((first - 1) // cp + 1, m))
                continue
            if ((lane_pages - (rank + 1)) % cp).any():
                break  # several owners: the general path sorts it out
            pairs = pages_to_pairs((lane_pages - 1) // cp + 1)
            last_start, last_len = pairs[-1]
            if pairs[0][0] < 1 or last_start + last_len > self.physical_pages:
                raise ValueError(self._range_error(pages))
            out[rank].extend(pairs)
        else:
            return out
        # General path: any order, any mix of lanes.
        if (pages <= 0).any() or (pages > self.capacity).any():
            raise ValueError(self._range_error(pages))
        owners = cp_mapping.owner(pages, cp)
        physical = cp_mapping.to_physical(pages, cp)
        return [pages_to_pairs(np.sort(physical[owners == r])) for r in range(cp)]

    def _range_error(self, pages: np.ndarray) -> str:
        bad = pages[(pages <= 0) | (pages > self.capacity)]
        return f"{self.name}: pages {bad[:16].tolist()} out of range [1, {self.capacity}]"

    def _lane_counts(self, n: int, first_position: int) -> list[int]:
        """How many of positions [first_position, first_position + n) each lane owns."""
        cp = self.cp_size
        base, extra = divmod(n, cp)
        counts = [base] * cp
        for j in range(first_position, first_position + extra):
            counts[j % cp] += 1
        return counts


def _pairs_to_pages(pairs: list[tuple[int, int]]) -> np.ndarray:
    """Page ids of `(start, length)` runs, in order: one arange per run, vectorised past a few."""
    if len(pairs) == 1:
        start, length = pairs[0]
        return np.arange(start, start + length, dtype=np.int64)
    if len(pairs) <= _FEW_RUNS:
        return np.concatenate([np.arange(s, s + k, dtype=np.int64) for s, k in pairs])
    return runs_to_pages(np.array(pairs, dtype=np.int64))


#: Up to this many runs, one np.arange per run (or one slice of a page-id array,
#: `_FEW_SLICES`) beats the vectorised expansion (about five numpy calls).
_FEW_RUNS = 4
_FEW_SLICES = 16
