"""Context-parallel shared-KV page mapping (docs/invariants.md, CP shared KV).

Logical page 0 is a dummy page that no rank owns. For p >= 1:

    owner(p)    = (p - 1) mod cp_size
    physical(p) = (p - 1) div cp_size + 1      (page 0 maps to physical 0)
    logical(physical q on rank r) = (q - 1) * cp_size + r + 1

Worked example, cp_size = 2:

    logical   0  1  2  3  4  5  6
    owner     -  0  1  0  1  0  1
    physical  0  1  1  2  2  3  3

A rank with P physical pages (page 0 included) serves logical capacity
(P - 1) * cp_size + 1. Scheduler, radix tree and request page tables stay
logical; these functions are called only where bytes are touched.

Page *positions* are request-absolute: the page at position i of a request
is owned by lane i mod cp_size (see `LanePageAllocator`), so every request
sharing a prefix agrees on which rank holds which page of it.

All functions are vectorised over numpy int64 arrays.
"""

from __future__ import annotations

import numpy as np


def owner(pages: np.ndarray, cp_size: int) -> np.ndarray:
    """Owning rank of each logical page; -1 for the dummy page 0."""
    pages = np.asarray(pages, dtype=np.int64)
    return np.where(pages == 0, -1, (pages - 1) % cp_size)


def to_physical(pages: np.ndarray, cp_size: int) -> np.ndarray:
    """Physical page id (on its owner) of each logical page; 0 stays 0."""
    pages = np.asarray(pages, dtype=np.int64)
    return np.where(pages == 0, 0, (pages - 1) // cp_size + 1)


def to_logical(physical: np.ndarray, rank: int, cp_size: int) -> np.ndarray:
    """Logical ids of physical pages held by `rank`; 0 stays 0."""
    physical = np.asarray(physical, dtype=np.int64)
    return np.where(physical == 0, 0, (physical - 1) * cp_size + rank + 1)


def logical_capacity(physical_pages: int, cp_size: int) -> int:
    """Logical page ids a CP group serves with `physical_pages` per rank (page 0 included)."""
    return (physical_pages - 1) * cp_size + 1


def owned_mask(pages: np.ndarray, rank: int, cp_size: int) -> np.ndarray:
    """Boolean mask of the logical pages `rank` owns."""
    return owner(pages, cp_size) == rank


def owned_pages(
    pages: np.ndarray, rank: int, cp_size: int, first_position: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The pages of a request chunk that `rank` owns, as (physical ids, positions).

    `pages` are the chunk's logical pages in order; `first_position` is the
    chunk's request-absolute page offset (the cumulative page count of the
    chunks before it; never a chunk-local 0). Returns the owned pages' physical
    ids and their request-absolute positions.
    """
    pages = np.asarray(pages, dtype=np.int64)
    mask = owned_mask(pages, rank, cp_size)
    positions = np.arange(first_position, first_position + len(pages), dtype=np.int64)
    return to_physical(pages[mask], cp_size), positions[mask]
