"""Free-extent page allocator for the host (L2) pool.

The host pool is hundreds of GB cut into pages of tens of KB (220 GiB of
41 KiB pages is about 5.6 million pages). Copies and transfers coalesce into
one descriptor per run of adjacent pages, so the allocator prefers to hand out
contiguous runs, and it must do so in microseconds on a fragmented pool
(DOMAIN.md rule 6): a linear scan over a page bitmap costs milliseconds.

Design
------
Free space is a set of maximal extents ``[start, start + length)``, kept in
two sorted indices that always describe the same set:

* ``_by_start``: a ``SortedDict`` ``start -> length``. Answers "which free
  extents touch this run?" in O(log e) for :meth:`ExtentAllocator.free`, so a
  freed run merges with its neighbours and extents stay maximal.
* ``_by_len``: a ``SortedList`` of ``(length, start)``. Answers "smallest
  extent of at least n pages, lowest start on ties" (best fit) with one
  bisection, and "largest extent" from its end.

``e`` below is the number of free extents; ``k`` the number of runs a call
takes or returns. Reserving costs O(k log e), freeing O(k log e); nothing is
proportional to the number of pages, except the explicit page expansion in
:func:`runs_to_pages`. ``free_pages`` is a counter, O(1).

Reservations come back as :data:`Runs`: a numpy ``int64`` array of shape
``(k, 2)`` holding ``(start, length)`` rows sorted by start, never Python
lists of page ids. :func:`runs_to_pages` and :func:`pages_to_runs` convert
between runs and page arrays, vectorised.

Tunables: none. Best fit over exact extents needs no load factor or bucket
size; sortedcontainers' own load factor (1000) is left at its default.

Worked example (10 pages; free extents written as ``[start, end)``)::

    a = ExtentAllocator(10)      # free: [0, 10)
    x = a.reserve(3)             # x = [[0, 3]]          free: [3, 10)
    y = a.reserve(3)             # y = [[3, 3]]          free: [6, 10)
    a.free(x)                    #                       free: [0, 3) [6, 10)
    a.reserve(5)                 # no run of 5 is free: largest first
                                 # -> [[0, 1], [6, 4]]   free: [1, 3)

Errors: a shortfall of free pages is an expected outcome and returns
``None``; malformed requests and invalid frees (double free, pages never
reserved, out of range) raise ``ValueError`` naming the pages, and leave the
allocator unchanged.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
from sortedcontainers import SortedDict, SortedList

__all__ = [
    "ExtentAllocator",
    "ExtentStats",
    "Runs",
    "empty_runs",
    "pages_to_runs",
    "runs_to_pages",
]

#: ``int64`` array of shape ``(k, 2)``: rows of ``(start_page, length)``.
Runs: TypeAlias = npt.NDArray[np.int64]


def empty_runs() -> Runs:
    """Return a ``(0, 2)`` int64 runs array. O(1)."""
    return np.empty((0, 2), dtype=np.int64)


def _as_runs(runs: npt.ArrayLike) -> Runs:
    """Coerce ``runs`` to an int64 ``(k, 2)`` array or raise ``ValueError``."""
    arr = np.asarray(runs, dtype=np.int64)
    if arr.size == 0:
        return empty_runs()
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"runs must have shape (k, 2) of (start, length), got shape {arr.shape}")
    return arr


def runs_to_pages(runs: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """Expand runs into the page ids they cover, in row order.

    Vectorised (no Python loop per page or per run); O(total pages) time and
    memory.

    >>> runs_to_pages(np.array([[4, 3], [10, 2]])).tolist()
    [4, 5, 6, 10, 11]
    """
    arr = _as_runs(runs)
    if arr.shape[0] == 0:
        return np.empty(0, dtype=np.int64)
    starts, lengths = arr[:, 0], arr[:, 1]
    if np.any(lengths < 0):
        raise ValueError(f"negative run lengths in {arr[lengths < 0].tolist()}")
    # Page j of the output belongs to run r; its id is starts[r] + (j - first[r])
    # where first[r] is the exclusive prefix sum of lengths.
    first = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - first, lengths)


def pages_to_runs(pages: npt.ArrayLike) -> Runs:
    """Coalesce page ids (any order) into maximal runs sorted by start.

    Adjacent pages merge into one run. Vectorised; O(p log p) for the sort.
    Raises ``ValueError`` on duplicate pages (a page list with repeats is a
    bug in the caller, not something to silently merge).

    >>> pages_to_runs([7, 3, 4, 5, 9]).tolist()
    [[3, 3], [7, 1], [9, 1]]
    """
    p = np.sort(np.asarray(pages, dtype=np.int64).ravel())
    if p.size == 0:
        return empty_runs()
    steps = np.diff(p)
    if np.any(steps == 0):
        dups = np.unique(p[1:][steps == 0])
        raise ValueError(f"duplicate pages {dups[:16].tolist()}")
    run_first = np.concatenate(([0], np.flatnonzero(steps != 1) + 1))
    run_end = np.concatenate((run_first[1:], [p.size]))
    return np.stack((p[run_first], run_end - run_first), axis=1)


@dataclass(frozen=True, slots=True)
class ExtentStats:
    """A snapshot of an :class:`ExtentAllocator`'s occupancy."""

    num_pages: int
    free_pages: int
    used_pages: int
    num_free_extents: int
    largest_free_run: int
    #: ``1 - largest_free_run / free_pages``; 0 when nothing is free.
    fragmentation: float


def _fmt(start: int, length: int) -> str:
    return f"[{start}, {start + length})"


class ExtentAllocator:
    """Page allocator over page ids ``[0, num_pages)`` keeping free extents.

    Not thread-safe: callers serialise access (one scheduler thread owns it).
    See the module docstring for the design and a worked example.
    """

    __slots__ = ("_num_pages", "_by_start", "_by_len", "_free_pages")

    def __init__(self, num_pages: int) -> None:
        """Create an allocator with every page free. O(1).

        Raises ``ValueError`` when ``num_pages`` is negative.
        """
        num_pages = operator.index(num_pages)
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_pages = num_pages
        self._by_start: SortedDict = SortedDict()
        self._by_len: SortedList = SortedList()
        self._free_pages = 0
        if num_pages:
            self._insert(0, num_pages)
            self._free_pages = num_pages

    # -- index maintenance: the only places that touch both indices --------

    def _insert(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_len.add((length, start))

    def _remove(self, start: int, length: int) -> None:
        del self._by_start[start]
        self._by_len.remove((length, start))

    # -- queries ------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        """Total pages managed. O(1)."""
        return self._num_pages

    @property
    def free_pages(self) -> int:
        """Pages currently free. O(1) (a counter)."""
        return self._free_pages

    @property
    def used_pages(self) -> int:
        """Pages currently reserved. O(1)."""
        return self._num_pages - self._free_pages

    @property
    def num_free_extents(self) -> int:
        """Number of maximal free extents. O(1)."""
        return len(self._by_start)

    @property
    def largest_free_run(self) -> int:
        """Length of the longest free extent, 0 when full. O(log e)."""
        return self._by_len[-1][0] if self._by_len else 0

    @property
    def fragmentation(self) -> float:
        """``1 - largest_free_run / free_pages``; 0 when no page is free. O(log e).

        0 means all free space is one extent; values near 1 mean the free
        space is scattered over many small extents.
        """
        if self._free_pages == 0:
            return 0.0
        return 1.0 - self.largest_free_run / self._free_pages

    def stats(self) -> ExtentStats:
        """Snapshot of occupancy and fragmentation. O(log e)."""
        return ExtentStats(
            num_pages=self._num_pages,
            free_pages=self._free_pages,
            used_pages=self.used_pages,
            num_free_extents=self.num_free_extents,
            largest_free_run=self.largest_free_run,
            fragmentation=self.fragmentation,
        )

    def free_runs(self) -> Runs:
        """All free extents as runs sorted by start. O(e); allocates."""
        if not self._by_start:
            return empty_runs()
        return np.array(list(self._by_start.items()), dtype=np.int64)

    # -- reserve ------------------------------------------------------------

    def reserve(self, n_pages: int, prefer_contiguous: bool = True) -> Runs | None:
        """Reserve ``n_pages`` pages and return them as runs sorted by start.

        With ``prefer_contiguous`` (the default): when some free extent holds
        ``n_pages``, take the front of the smallest such extent (best fit,
        lowest start on ties) and return a single run. Otherwise take the
        largest extents whole until the remainder fits in one extent, then
        best-fit the remainder; this returns the fewest runs possible.

        Without it: take pages from the lowest addresses up (first fit).

        Returns ``None``, changing nothing, when fewer than ``n_pages`` pages
        are free. Raises ``ValueError`` when ``n_pages <= 0``.

        Runtime complexity: O(k log e) for k returned runs and e free extents.

        >>> a = ExtentAllocator(8)
        >>> a.reserve(3).tolist()
        [[0, 3]]
        >>> a.reserve(6) is None
        True
        """
        n = operator.index(n_pages)
        if n <= 0:
            raise ValueError(f"reserve: n_pages must be positive, got {n}")
        if n > self._free_pages:
            return None
        taken = self._take_best_fit(n) if prefer_contiguous else self._take_first_fit(n)
        self._free_pages -= n
        taken.sort()
        return np.array(taken, dtype=np.int64)

    def _take_best_fit(self, n: int) -> list[tuple[int, int]]:
        """Remove ``n`` free pages, fewest runs first, best fit for the rest."""
        by_len = self._by_len
        taken: list[tuple[int, int]] = []
        remaining = n
        while True:
            i = by_len.bisect_left((remaining, -1))
            if i < len(by_len):
                length, start = by_len.pop(i)
                del self._by_start[start]
                if length > remaining:
                    self._insert(start + remaining, length - remaining)
                taken.append((start, remaining))
                return taken
            # No extent holds the remainder: the largest one is taken whole.
            length, start = by_len.pop()
            del self._by_start[start]
            taken.append((start, length))
            remaining -= length

    def _take_first_fit(self, n: int) -> list[tuple[int, int]]:
        """Remove ``n`` free pages from the lowest addresses up."""
        taken: list[tuple[int, int]] = []
        remaining = n
        while remaining:
            start, length = self._by_start.peekitem(0)
            self._remove(start, length)
            take = min(length, remaining)
            if length > take:
                self._insert(start + take, length - take)
            taken.append((start, take))
            remaining -= take
        return taken

    # -- free ---------------------------------------------------------------

    def free(self, runs: npt.ArrayLike) -> None:
        """Return ``runs`` (``(start, length)`` rows, any order) to the free set.

        Each run merges with adjacent free extents, so extents stay maximal.
        All runs are validated before anything changes: non-positive lengths,
        pages outside ``[0, num_pages)``, runs overlapping each other, and runs
        overlapping free space (a double free, or pages never reserved) raise
        ``ValueError`` naming the pages and leave the allocator unchanged.

        Runtime complexity: O(k log e) for k runs (plus O(k log k) to sort).

        >>> a = ExtentAllocator(8)
        >>> r = a.reserve(8)
        >>> a.free([[4, 4], [0, 4]]); a.free_runs().tolist()
        [[0, 8]]
        """
        arr = _as_runs(runs)
        if arr.shape[0] == 0:
            return
        pairs: list[list[int]] = arr.tolist()  # one conversion; the rest is O(log e) per run
        if len(pairs) > 1:
            pairs.sort()
        self._validate_free(pairs)
        by_start = self._by_start
        freed = 0
        for start, length in pairs:
            new_start, new_len = start, length
            i = by_start.bisect_right(start)
            if i > 0:
                prev_start, prev_len = by_start.peekitem(i - 1)
                if prev_start + prev_len == start:
                    self._remove(prev_start, prev_len)
                    new_start, new_len = prev_start, new_len + prev_len
            next_len = by_start.get(start + length)
            if next_len is not None:
                self._remove(start + length, next_len)
                new_len += next_len
            self._insert(new_start, new_len)
            freed += length
        self._free_pages += freed

    def validate_free(self, runs: npt.ArrayLike) -> None:
        """Raise ``ValueError`` unless ``free(runs)`` would succeed; changes nothing.

        Lets a caller that frees over several allocators validate all of them
        before touching any. Runtime complexity: O(k log e).
        """
        pairs: list[list[int]] = _as_runs(runs).tolist()
        pairs.sort()
        self._validate_free(pairs)

    def _validate_free(self, pairs: list[list[int]]) -> None:
        """Raise ``ValueError`` unless every run of ``pairs`` (sorted) may be freed."""
        by_start = self._by_start
        prev: list[int] | None = None
        for start, length in pairs:
            if length <= 0:
                raise ValueError(f"free: non-positive length in run (start={start}, length={length})")
            if start < 0 or start + length > self._num_pages:
                raise ValueError(
                    f"free: pages {_fmt(start, length)} fall outside pages [0, {self._num_pages})"
                )
            if prev is not None and prev[0] + prev[1] > start:
                raise ValueError(
                    f"free: runs overlap each other: pages {_fmt(*prev)} and {_fmt(start, length)}"
                )
            prev = [start, length]
            i = by_start.bisect_right(start)
            hit: tuple[int, int] | None = None
            if i > 0:
                prev_start, prev_len = by_start.peekitem(i - 1)
                if prev_start + prev_len > start:
                    hit = (prev_start, prev_len)
            if hit is None and i < len(by_start):
                next_start, next_len = by_start.peekitem(i)
                if next_start < start + length:
                    hit = (next_start, next_len)
            if hit is not None:
                raise ValueError(
                    f"free: pages {_fmt(start, length)} overlap free extent {_fmt(*hit)} "
                    "(double free, or pages never reserved)"
                )

    # -- invariants ---------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless every internal invariant holds.

        Checks: both indices hold the same extents; every extent is non-empty
        and inside ``[0, num_pages)``; extents neither overlap nor touch (they
        are maximal); the free counter equals the sum of extent lengths.
        Runtime complexity: O(e). Intended for tests and debug mode.
        """
        by_start = list(self._by_start.items())
        by_len = sorted((start, length) for length, start in self._by_len)
        _require(by_start == by_len, f"indices disagree: {by_start[:8]} vs {by_len[:8]}")
        _require(len(self._by_len) == len(by_start), "index sizes differ")
        total = 0
        prev_end = -1
        for start, length in by_start:
            _require(length > 0, f"empty extent at {start}")
            _require(
                0 <= start and start + length <= self._num_pages,
                f"extent {_fmt(start, length)} out of range",
            )
            _require(start > prev_end, f"extent {_fmt(start, length)} overlaps or touches the previous one")
            prev_end = start + length
            total += length
        _require(total == self._free_pages, f"free counter {self._free_pages} != extent total {total}")

    def __repr__(self) -> str:
        return (
            f"ExtentAllocator(num_pages={self._num_pages}, free_pages={self._free_pages}, "
            f"free_extents={self.num_free_extents})"
        )


def _require(cond: bool, message: str) -> None:
    """Raise ``AssertionError(message)`` when ``cond`` is false (survives ``-O``)."""
    if not cond:
        raise AssertionError(message)
