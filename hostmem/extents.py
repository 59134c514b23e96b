"""Free-extent page allocator for the host (L2) pool.

The host pool is hundreds of GB cut into pages (220 GiB is about 75 thousand
DeepSeek-V3.2 logical pages of 3.1 MB, or 5.6 million 41 KiB per-layer
pages). Copies and transfers coalesce into one descriptor per run of adjacent
pages, so the allocator prefers to hand out contiguous runs, and it must do so
in microseconds on a fragmented pool (docs/invariants.md rule 6): a linear scan over a
page bitmap costs milliseconds.

Design
------
Free space is a set of maximal extents ``[start, start + length)``. Every
structure below describes that same set (``check_invariants`` proves it), and
each is chosen so that the operation it serves is one or two calls into
CPython's C code rather than Python-level tree walking:

* ``_by_start`` (``dict`` start -> length) and ``_by_end`` (``dict`` end ->
  start): a freed run finds the free extents that touch it with two O(1)
  lookups, so it merges with its neighbours and extents stay maximal.
* ``_lengths``: a plain sorted ``list`` of the *distinct* free lengths, and
  ``_starts_of`` (``dict`` length -> sorted ``list`` of starts). Best fit,
  "the smallest extent of at least n pages, lowest start on ties", is one
  ``bisect`` on ``_lengths`` and the head of one bucket. Distinct lengths sum
  to at most the free pages, so ``_lengths`` holds at most ``sqrt(2 * free)``
  entries (under 3,400 for 5.6 million free pages): inserting into it is a
  short ``memmove``, which is why it needs no tree.
* ``_free_map``: a ``bytearray`` with one byte per page, 1 when free. A free
  is checked for double frees and never-reserved pages with one
  ``bytearray.find`` over the run (``memchr``), instead of a range query.
  One byte a page: 5.6 MB for 5.6 million pages.

``e`` below is the number of free extents, ``k`` the number of runs a call
takes or returns, ``m`` the number of free extents of one length (a bucket).
Reserving costs O(k (log e + m)), freeing O(k (1 + m)) plus the byte-map
updates, which are ``memset``/``memchr`` over the pages touched; nothing runs
a Python loop per page. ``free_pages`` is a counter, O(1). Buckets are short
in practice (equal lengths are rare beyond a handful of small sizes), and a
bucket list's insert and delete are ``memmove`` calls.

The ``*_pairs`` methods take and return plain ``(start, length)`` tuples for
callers that build their own page arrays (``LanePageAllocator``); the numpy
methods return :data:`Runs`: an ``int64`` array of shape ``(k, 2)`` holding
``(start, length)`` rows sorted by start. :mod:`hostmem.runs`
(re-exported here: :func:`runs_to_pages`, :func:`pages_to_runs`,
:func:`pages_to_pairs`) converts, vectorised.

Tunables: none. Everything is exact: best fit over exact extents needs no
size classes, load factor or bucket size.

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
allocator unchanged. Every decision is a function of the call sequence alone
(no hashing order, no randomness), so replicas fed the same calls agree.
"""

from __future__ import annotations

import operator
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import numpy.typing as npt

from hostmem.runs import Pair, Runs, _as_runs, empty_runs, pages_to_pairs, pages_to_runs, runs_to_pages  # re-exported

__all__ = [
    "ExtentAllocator",
    "ExtentStats",
    "Pair",
    "Runs",
    "empty_runs",
    "pages_to_pairs",
    "pages_to_runs",
    "runs_to_pages",
]

_FREE = 1
_FREE_BYTE = b"\x01"
_USED_BYTE = b"\x00"


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

    __slots__ = ("_num_pages", "_by_start", "_by_end", "_lengths", "_starts_of", "_free_map", "_map_view", "_free_pages")

    def __init__(self, num_pages: int) -> None:
        """Create an allocator with every page free. O(num_pages) for the byte map.

        Raises ``ValueError`` when ``num_pages`` is negative.
        """
        num_pages = operator.index(num_pages)
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_pages = num_pages
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._lengths: list[int] = []
        self._starts_of: dict[int, list[int]] = {}
        self._free_map = bytearray(_FREE_BYTE * num_pages)
        # Writes go through a memoryview: its slice assignment costs about half
        # of bytearray's (a fixed cost per call, not per page).
        self._map_view = memoryview(self._free_map)
        self._free_pages = 0
        if num_pages:
            self._insert(0, num_pages)
            self._free_pages = num_pages

    # -- index maintenance (reserve_pairs and free_pairs inline the same steps) --

    def _insert(self, start: int, length: int) -> None:
        """Add free extent ``[start, start + length)`` to every index (not the byte map)."""
        self._by_start[start] = length
        self._by_end[start + length] = start
        bucket = self._starts_of.get(length)
        if bucket is None:
            self._starts_of[length] = [start]
            insort(self._lengths, length)
        elif start > bucket[-1]:
            bucket.append(start)
        else:
            insort(bucket, start)

    def _remove(self, start: int, length: int) -> None:
        """Drop free extent ``[start, start + length)`` from every index (not the byte map)."""
        del self._by_start[start]
        del self._by_end[start + length]
        self._unbucket(start, length)

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
        """Length of the longest free extent, 0 when full. O(1)."""
        return self._lengths[-1] if self._lengths else 0

    @property
    def fragmentation(self) -> float:
        """``1 - largest_free_run / free_pages``; 0 when no page is free. O(1).

        0 means all free space is one extent; values near 1 mean the free
        space is scattered over many small extents.
        """
        if self._free_pages == 0:
            return 0.0
        return 1.0 - self.largest_free_run / self._free_pages

    def page_is_free(self, page: int) -> bool:
        """Whether ``page`` is free. O(1). Raises ``IndexError`` outside ``[0, num_pages)``."""
        if not 0 <= page < self._num_pages:
            raise IndexError(f"page {page} outside pages [0, {self._num_pages})")
        return self._free_map[page] == _FREE

    def stats(self) -> ExtentStats:
        """Snapshot of occupancy and fragmentation. O(1)."""
        return ExtentStats(
            num_pages=self._num_pages,
            free_pages=self._free_pages,
            used_pages=self.used_pages,
            num_free_extents=self.num_free_extents,
            largest_free_run=self.largest_free_run,
            fragmentation=self.fragmentation,
        )

    def free_runs(self) -> Runs:
        """All free extents as runs sorted by start. O(e log e); allocates."""
        if not self._by_start:
            return empty_runs()
        return np.array(sorted(self._by_start.items()), dtype=np.int64)

    # -- reserve ------------------------------------------------------------

    def reserve(self, n_pages: int, prefer_contiguous: bool = True) -> Runs | None:
        """Reserve ``n_pages`` pages and return them as runs sorted by start.

        With ``prefer_contiguous`` (the default): when some free extent holds
        ``n_pages``, take the front of the smallest such extent (best fit,
        lowest start on ties) and return a single run. Otherwise take the
        largest extents whole (highest start on ties) until the remainder fits
        in one extent, then best-fit the remainder; this returns the fewest
        runs possible.

        Without it: take pages from the lowest addresses up (first fit).

        Returns ``None``, changing nothing, when fewer than ``n_pages`` pages
        are free. Raises ``ValueError`` when ``n_pages <= 0``.

        Runtime complexity: O(k (log e + m)) for k returned runs, e free
        extents and buckets of m equal lengths; plus a ``memset`` of the
        pages taken. See :meth:`reserve_pairs` for the same without numpy.

        >>> a = ExtentAllocator(8)
        >>> a.reserve(3).tolist()
        [[0, 3]]
        >>> a.reserve(6) is None
        True
        """
        taken = self.reserve_pairs(n_pages, prefer_contiguous)
        if taken is None:
            return None
        return np.array(taken, dtype=np.int64)

    def reserve_pairs(self, n_pages: int, prefer_contiguous: bool = True) -> list[Pair] | None:
        """:meth:`reserve`, returning a list of ``(start, length)`` tuples sorted by start.

        Same choice of pages, errors and complexity; no numpy object is made,
        which saves about a microsecond a call for callers that build their
        own page arrays.
        """
        n = n_pages if type(n_pages) is int else operator.index(n_pages)
        if n <= 0:
            raise ValueError(f"reserve: n_pages must be positive, got {n}")
        if n > self._free_pages:
            return None
        if not prefer_contiguous:
            taken = self._take_first_fit(n)
            self._free_pages -= n
            for start, length in taken:
                self._map_view[start : start + length] = _USED_BYTE * length
            return taken
        lengths = self._lengths
        self._free_pages -= n
        if n <= lengths[-1]:  # one run: most calls. _take_front, inlined.
            i = bisect_left(lengths, n)
            length = lengths[i]
            starts_of = self._starts_of
            bucket = starts_of[length]
            start = bucket[0]
            if len(bucket) == 1:
                del starts_of[length]
                del lengths[i]
            else:
                del bucket[0]
            del self._by_start[start]
            if length == n:
                del self._by_end[start + n]
            else:
                rest, rest_start = length - n, start + n
                self._by_start[rest_start] = rest
                self._by_end[start + length] = rest_start
                bucket = starts_of.get(rest)
                if bucket is None:
                    starts_of[rest] = [rest_start]
                    insort(lengths, rest)
                elif rest_start > bucket[-1]:
                    bucket.append(rest_start)
                else:
                    insort(bucket, rest_start)
            self._map_view[start : start + n] = _USED_BYTE * n
            return [(start, n)]
        # No extent holds n: take the largest extents whole (highest start on
        # ties) until the remainder fits one, then best-fit the remainder.
        # These are _remove's steps, inlined, knowing the extent is the last.
        starts_of, by_start, by_end, map_view = self._starts_of, self._by_start, self._by_end, self._map_view
        taken: list[Pair] = []
        remaining = n
        while remaining > lengths[-1]:
            length = lengths[-1]
            bucket = starts_of[length]
            start = bucket.pop()
            if not bucket:
                del starts_of[length]
                lengths.pop()
            del by_start[start]
            del by_end[start + length]
            map_view[start : start + length] = _USED_BYTE * length
            taken.append((start, length))
            remaining -= length
        taken.append((self._take_front(bisect_left(lengths, remaining), remaining), remaining))
        taken.sort()
        return taken

    def _take_front(self, i: int, n: int) -> int:
        """Take the first ``n`` pages of the lowest-start extent of length
        ``_lengths[i]`` (>= n) and return their start. The steps of _remove and
        _insert, inlined: this runs on every contiguous reserve. O(log e + m)."""
        lengths = self._lengths
        length = lengths[i]
        starts_of = self._starts_of
        bucket = starts_of[length]
        start = bucket[0]
        if len(bucket) == 1:
            del starts_of[length]
            del lengths[i]
        else:
            del bucket[0]
        del self._by_start[start]
        end = start + length
        if length == n:
            del self._by_end[end]
        else:
            rest, rest_start = length - n, start + n
            self._by_start[rest_start] = rest
            self._by_end[end] = rest_start
            bucket = starts_of.get(rest)
            if bucket is None:
                starts_of[rest] = [rest_start]
                insort(lengths, rest)
            elif rest_start > bucket[-1]:
                bucket.append(rest_start)
            else:
                insort(bucket, rest_start)
        self._map_view[start : start + n] = _USED_BYTE * n
        return start

    def _take_first_fit(self, n: int) -> list[Pair]:
        """Remove ``n`` free pages from the lowest addresses up."""
        taken: list[Pair] = []
        remaining = n
        position = 0
        free_map = self._free_map
        while remaining:
            start = free_map.find(_FREE, position)  # extents are maximal: a free page after a used one starts one
            length = self._by_start[start]
            self._remove(start, length)
            take = min(length, remaining)
            if length > take:
                self._insert(start + take, length - take)
            taken.append((start, take))
            remaining -= take
            position = start + length
        return taken

    # -- free ---------------------------------------------------------------

    def free(self, runs: npt.ArrayLike) -> None:
        """Return ``runs`` (``(start, length)`` rows, any order) to the free set.

        Each run merges with adjacent free extents, so extents stay maximal.
        All runs are validated before anything changes: non-positive lengths,
        pages outside ``[0, num_pages)``, runs overlapping each other, and runs
        overlapping free space (a double free, or pages never reserved) raise
        ``ValueError`` naming the pages and leave the allocator unchanged.

        Runtime complexity: O(k (1 + m)) for k runs (plus O(k log k) to sort)
        and a ``memchr`` and ``memset`` over the pages freed.

        >>> a = ExtentAllocator(8)
        >>> r = a.reserve(8)
        >>> a.free([[4, 4], [0, 4]]); a.free_runs().tolist()
        [[0, 8]]
        """
        arr = _as_runs(runs)
        if arr.shape[0]:
            self.free_pairs(arr.tolist())

    def free_pairs(self, pairs: Sequence[Pair] | Sequence[list[int]]) -> None:
        """:meth:`free` for ``(start, length)`` pairs of Python ints, in any order.

        Same validation, atomicity and complexity, without numpy conversions.
        """
        if len(pairs) == 1:  # most calls: _checked for one run, inlined
            start, length = pairs[0]
            if length <= 0 or start < 0 or start + length > self._num_pages or (
                self._free_map.find(_FREE, start, start + length) >= 0
            ):
                self._raise_bad_run(pairs, start, length)
            ordered = pairs
        else:
            ordered = self._checked(pairs)
        by_start, by_end, starts_of, lengths = self._by_start, self._by_end, self._starts_of, self._lengths
        map_view = self._map_view
        freed = 0
        for start, length in ordered:
            end = start + length
            map_view[start:end] = _FREE_BYTE * length
            freed += length
            # Merge with the free extents that end where this run starts and start
            # where it ends (each taken out of every index, _unbucket inlined),
            # then insert the union.
            prev_start = by_end.pop(start, None)
            if prev_start is not None:
                prev_len = by_start.pop(prev_start)
                bucket = starts_of[prev_len]
                if len(bucket) == 1:
                    del starts_of[prev_len]
                    del lengths[bisect_left(lengths, prev_len)]
                else:
                    del bucket[bisect_left(bucket, prev_start)]
                start = prev_start
            next_len = by_start.pop(end, None)
            if next_len is not None:
                del by_end[end + next_len]
                bucket = starts_of[next_len]
                if len(bucket) == 1:
                    del starts_of[next_len]
                    del lengths[bisect_left(lengths, next_len)]
                else:
                    del bucket[bisect_left(bucket, end)]
                end += next_len
            length = end - start
            by_start[start] = length
            by_end[end] = start
            bucket = starts_of.get(length)
            if bucket is None:
                starts_of[length] = [start]
                insort(lengths, length)
            elif start > bucket[-1]:
                bucket.append(start)
            else:
                insort(bucket, start)
        self._free_pages += freed

    def _unbucket(self, start: int, length: int) -> None:
        """Drop extent ``(start, length)`` from its length bucket (and its length
        from ``_lengths`` when the bucket empties). O(log e + m)."""
        bucket = self._starts_of[length]
        if len(bucket) == 1:
            del self._starts_of[length]
            del self._lengths[bisect_left(self._lengths, length)]
        else:
            del bucket[bisect_left(bucket, start)]

    def validate_free(self, runs: npt.ArrayLike) -> None:
        """Raise ``ValueError`` unless ``free(runs)`` would succeed; changes nothing.

        Lets a caller that frees over several allocators validate all of them
        before touching any. Runtime complexity: O(k log k) and a ``memchr``
        over the pages named.
        """
        self._checked(_as_runs(runs).tolist())

    def validate_free_pairs(self, pairs: Sequence[Pair] | Sequence[list[int]]) -> None:
        """:meth:`validate_free` for ``(start, length)`` pairs of Python ints."""
        self._checked(pairs)

    def _checked(self, pairs: Sequence[Pair] | Sequence[list[int]]) -> Sequence[Pair] | Sequence[list[int]]:
        """``pairs`` in ascending order of start; ``ValueError`` unless every run may be freed.

        O(k) for ascending pairs (O(k log k) to sort others) and one ``memchr``
        per run: a run that holds a free page overlaps a free extent (a double
        free, or pages never reserved).
        """
        free_map = self._free_map
        num_pages = self._num_pages
        prev_end = 0
        for start, length in pairs:
            end = start + length
            if length <= 0 or start < prev_end or end > num_pages or free_map.find(_FREE, start, end) >= 0:
                if start < prev_end and length > 0:  # maybe only out of order: sort, check again
                    ordered = sorted(pairs)
                    if ordered != list(pairs):
                        return self._checked(ordered)
                self._raise_bad_run(pairs, start, length)
            prev_end = end
        return pairs

    def _raise_bad_run(self, pairs: Sequence[Pair] | Sequence[list[int]], start: int, length: int) -> NoReturn:
        """Raise the ``ValueError`` that says what is wrong with run ``(start, length)`` of sorted ``pairs``."""
        if length <= 0:
            raise ValueError(f"free: non-positive length in run (start={start}, length={length})")
        if start < 0 or start + length > self._num_pages:
            raise ValueError(f"free: pages {_fmt(start, length)} fall outside pages [0, {self._num_pages})")
        hit = self._free_map.find(_FREE, start, start + length)
        if hit >= 0:
            raise ValueError(
                f"free: pages {_fmt(start, length)} overlap free extent {_fmt(*self._extent_at(hit))} "
                "(double free, or pages never reserved)"
            )
        others = [(int(s), int(k)) for s, k in pairs]
        others.remove((start, length))
        other = next((s, k) for s, k in others if s < start + length and start < s + k)
        raise ValueError(f"free: runs overlap each other: pages {_fmt(*other)} and {_fmt(start, length)}")

    def _extent_at(self, page: int) -> Pair:
        """The free extent holding free ``page`` (error messages only). O(extent length)."""
        free_map = self._free_map
        start = free_map.rfind(b"\x00", 0, page) + 1
        return start, self._by_start[start]

    # -- invariants ---------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless every internal invariant holds.

        Checks: every index holds the same extents (by start, by end, the
        length buckets and the distinct-length list, the byte map); every
        extent is non-empty and inside ``[0, num_pages)``; extents neither
        overlap nor touch (they are maximal); buckets and the length list are
        sorted without repeats; the free counter equals the sum of extent
        lengths. Runtime complexity: O(e log e + num_pages). For tests and
        debug mode.
        """
        by_start = sorted(self._by_start.items())
        by_end = sorted((start, end - start) for end, start in self._by_end.items())
        _require(by_start == by_end, f"start and end indices disagree: {by_start[:8]} vs {by_end[:8]}")
        bucketed = sorted((start, length) for length, starts in self._starts_of.items() for start in starts)
        _require(by_start == bucketed, f"length buckets disagree: {by_start[:8]} vs {bucketed[:8]}")
        for length, starts in self._starts_of.items():
            _require(bool(starts), f"empty bucket for length {length}")
            _require(starts == sorted(set(starts)), f"bucket {length} not sorted or repeats: {starts[:8]}")
        _require(
            self._lengths == sorted(self._starts_of),
            f"length list {self._lengths[:8]} != bucket keys {sorted(self._starts_of)[:8]}",
        )
        total = 0
        prev_end = -1
        expected = bytearray(self._num_pages)
        for start, length in by_start:
            _require(length > 0, f"empty extent at {start}")
            _require(
                0 <= start and start + length <= self._num_pages,
                f"extent {_fmt(start, length)} out of range",
            )
            _require(start > prev_end, f"extent {_fmt(start, length)} overlaps or touches the previous one")
            prev_end = start + length
            total += length
            expected[start : start + length] = _FREE_BYTE * length
        _require(total == self._free_pages, f"free counter {self._free_pages} != extent total {total}")
        _require(len(self._free_map) == self._num_pages, "byte map has the wrong size")
        if expected != self._free_map:
            diff = np.flatnonzero(np.frombuffer(expected, np.uint8) != np.frombuffer(self._free_map, np.uint8))
            raise AssertionError(f"byte map disagrees with the extents at pages {diff[:16].tolist()}")

    def __repr__(self) -> str:
        return (
            f"ExtentAllocator(num_pages={self._num_pages}, free_pages={self._free_pages}, "
            f"free_extents={self.num_free_extents})"
        )


def _require(cond: bool, message: str) -> None:
    """Raise ``AssertionError(message)`` when ``cond`` is false (survives ``-O``)."""
    if not cond:
        raise AssertionError(message)
