"""Runs of pages: ``(start, length)`` rows, and conversions to and from page id arrays.

A reservation of the host pool is a few runs of adjacent pages; copies and
transfers take one descriptor per run. These helpers convert between the
three shapes the code uses, all vectorised or with fast paths for what
reservations look like:

* :data:`Runs`: an ``int64`` numpy array of shape ``(k, 2)``;
* :data:`Pair` lists: ``[(start, length), ...]`` as Python ints;
* page arrays: ``int64`` page ids, one per page.
"""

from __future__ import annotations

from typing import TypeAlias

import numpy as np
import numpy.typing as npt

__all__ = ["Pair", "Runs", "empty_runs", "pages_to_pairs", "pages_to_runs", "runs_to_pages"]

#: ``int64`` array of shape ``(k, 2)``: rows of ``(start_page, length)``.
Runs: TypeAlias = npt.NDArray[np.int64]
#: One run as plain Python ints: ``(start_page, length)``.
Pair: TypeAlias = tuple[int, int]


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
    if arr.shape[0] == 1:
        start, length = arr[0].tolist()
        if length < 0:
            raise ValueError(f"negative run lengths in {arr.tolist()}")
        return np.arange(start, start + length, dtype=np.int64)
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


def pages_to_pairs(pages: npt.ArrayLike) -> list[Pair]:
    """Like :func:`pages_to_runs`, as a list of ``(start, length)`` tuples.

    Fast paths for what reservations and their slices look like: one
    ascending run is recognised with one byte comparison against ``arange``;
    ascending runs with gaps (up to :data:`_FEW_BREAKS` of them) with one
    vectorised difference, then one Python step per run. Anything else (any
    order, duplicates) goes through :func:`pages_to_runs` and its duplicate
    check. O(p) on the fast paths, O(p log p) otherwise.

    >>> pages_to_pairs(np.array([5, 6, 7]))
    [(5, 3)]
    >>> pages_to_pairs(np.array([5, 6, 9]))
    [(5, 2), (9, 1)]
    >>> pages_to_pairs([9, 3, 4])
    [(3, 2), (9, 1)]
    """
    p = np.asarray(pages, dtype=np.int64)
    if p.ndim != 1:
        p = p.ravel()
    n = p.shape[0]
    if n == 0:
        return []
    first, last = p.item(0), p.item(n - 1)
    if last - first == n - 1 and (n == 1 or p.tobytes() == np.arange(first, first + n, dtype=np.int64).tobytes()):
        return [(first, n)]
    if first < last:
        breaks = ((p[1:] - p[:-1]) != 1).nonzero()[0].tolist()
        if len(breaks) <= _FEW_BREAKS:
            pairs: list[Pair] = []
            i = 0
            for b in breaks:  # p[i..b] ascend by one; p[b + 1] must be past p[b] + 1
                if p.item(b + 1) <= p.item(b):
                    break  # not ascending, or a repeat: the sorting path decides
                pairs.append((p.item(i), b + 1 - i))
                i = b + 1
            else:
                pairs.append((p.item(i), n - i))
                return pairs
    return [(s, k) for s, k in pages_to_runs(p).tolist()]


#: Past this many gaps, :func:`pages_to_pairs` coalesces with the vectorised
#: sort (about ten numpy calls) rather than one Python step per run.
_FEW_BREAKS = 32
