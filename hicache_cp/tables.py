"""`GrowingTables`: a pair of read-only numpy tables, computed once and grown by doubling.

Hashes whose per-position constants depend only on the position (`keys`' powers
of the chain multiplier, `checksum`'s word multipliers) ask for the first n
entries; the tables are rebuilt at twice the size when n outgrows them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

#: Smallest table built.
MIN_SIZE = 1024


class GrowingTables:
    """The first n entries of two tables `build(size)` makes (read-only uint64 arrays
    of `size` entries each).

    Thread-safe without a lock on the read path: the pair is one tuple replaced
    whole under a lock, never two arrays filled one after the other (a reader on
    another thread could otherwise pair a grown first table with an old, shorter
    second one). Building costs O(size); a call costs O(1) once the tables are big
    enough."""

    def __init__(
        self, build: Callable[[int], tuple[np.ndarray, np.ndarray]],
        initial: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """`initial`: tables built already (the first `build` is then only for more)."""
        self._build = build
        self._tables: tuple[np.ndarray, np.ndarray] = initial or (np.empty(0, np.uint64), np.empty(0, np.uint64))
        self._lock = threading.Lock()

    def first(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        tables = self._tables  # one read: both arrays of the same build
        if len(tables[0]) < n:
            with self._lock:
                tables = self._tables
                if len(tables[0]) < n:
                    size = max(n, 2 * len(tables[0]), MIN_SIZE)
                    first, second = self._build(size)
                    first.flags.writeable = False
                    second.flags.writeable = False
                    tables = self._tables = (first, second)
        return tables[0][:n], tables[1][:n]
