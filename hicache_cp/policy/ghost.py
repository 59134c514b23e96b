"""A ghost table: approximate access counts of pages, remembered past eviction.

Pages are named by their prefix hash (`hicache_cp.keys.prefix_hashes`: a
page together with everything before it), so the same content at the same
place of a prompt has one entry whatever the tree holds, and the table
works the same whatever key the radix tree uses. It is direct-mapped:
`slots` (a power of two) entries of (hash, count, tag); a page whose slot
another page takes is forgotten (count 0 again), so old history fades and
memory is fixed at 13 bytes a slot. Every operation is a few vectorised
numpy passes over the pages given, with no Python object per page.

A tag (1..255, 0 for none) is a small label a policy attaches to an entry,
for example the class a page was admitted under, and reads back when the
page is accessed again.

Deterministic: the same calls give the same table on every CP rank.
"""

from __future__ import annotations

import numpy as np

_FIB = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: a slot is the top bits of hash * _FIB
_COUNT_MAX = np.iinfo(np.uint32).max


class GhostTable:
    """Approximate per-page access counts by prefix hash; see the module docstring."""

    def __init__(self, slots: int) -> None:
        if slots < 2 or slots & (slots - 1):
            raise ValueError(f"ghost table slots must be a power of two >= 2, got {slots}")
        self.slots = slots
        self._shift = np.uint64(65 - slots.bit_length())  # 64 - log2(slots)
        self._keys = np.zeros(slots, np.uint64)
        self._counts = np.zeros(slots, np.uint32)
        self._tags = np.zeros(slots, np.uint8)

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._counts.nbytes + self._tags.nbytes

    def _slots(self, hashes: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((np.asarray(hashes, np.uint64) * _FIB) >> self._shift).astype(np.intp)

    def counts(self, hashes: np.ndarray) -> np.ndarray:
        """Accesses remembered for each hash (0: never seen, or forgotten). Read-only."""
        idx = self._slots(hashes)
        return np.where(self._keys[idx] == hashes, self._counts[idx], 0).astype(np.int64)

    def touch(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Count one access of each hash. Returns (counts before it, tags they
        carried); a hash new to its slot starts at count 0, untagged, and
        evicts whatever the slot held. A hash listed twice counts once."""
        hashes = np.asarray(hashes, np.uint64)
        idx = self._slots(hashes)
        known = self._keys[idx] == hashes
        before = np.where(known, self._counts[idx], 0).astype(np.int64)
        tags = np.where(known, self._tags[idx], 0).astype(np.uint8)
        self._keys[idx] = hashes
        self._counts[idx] = np.minimum(before + 1, _COUNT_MAX).astype(np.uint32)
        self._tags[idx] = tags
        return before, tags

    def tag(self, hashes: np.ndarray, tag: int) -> None:
        """Set the tag of the entries these hashes hold (others are ignored)."""
        if not 0 <= tag <= 255:
            raise ValueError(f"a ghost tag is 0..255, got {tag}")
        hashes = np.asarray(hashes, np.uint64)
        idx = self._slots(hashes)
        self._tags[idx[self._keys[idx] == hashes]] = tag
