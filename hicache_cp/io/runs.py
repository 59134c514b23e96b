"""Runs of pages and the DMA descriptors of one layer's copy (pure numpy).

The DMA backends move one run of pages consecutive on both sides per
descriptor, never across a registration chunk of the host arena. Everything
here is vectorised, allocates a few arrays of the run count and needs no
GPU, so it is tested on CPU.
"""

from __future__ import annotations

import numpy as np


def coalesce_pairs(device_pages: np.ndarray, host_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge (device, host) page pairs into runs consecutive on BOTH sides, sorted by device page.

    Finds runs that the caller's order hides, at the price of a sort
    (O(n log n); about a millisecond for 8192 pages on a slow core). The
    hot path uses `coalesce_in_order`. Returns `(device_starts, host_starts,
    lengths)`, int64 arrays of one row per run.

    >>> [a.tolist() for a in coalesce_pairs(np.array([5, 6, 7, 1]), np.array([10, 11, 3, 2]))]
    [[1, 5, 7], [2, 10, 3], [1, 2, 1]]
    """
    if len(device_pages) == 0:
        return coalesce_in_order(device_pages, host_pages)
    order = np.argsort(device_pages, kind="stable")
    return coalesce_in_order(device_pages[order], host_pages[order])


def coalesce_in_order(device_pages: np.ndarray, host_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge neighbouring (device, host) pairs that are consecutive on both sides.

    O(n), no sort: pages of one request come in position order, and the
    allocators hand out runs in that order, so the natural order shows the
    runs. Returns `(device_starts, host_starts, lengths)`, int64 arrays.

    >>> [a.tolist() for a in coalesce_in_order(np.array([5, 6, 7, 1]), np.array([10, 11, 3, 2]))]
    [[5, 7, 1], [10, 3, 2], [2, 1, 1]]
    """
    n = len(device_pages)
    if n == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    # Slices and preallocated arrays, not np.diff/np.append: an op's few runs cost
    # a handful of microseconds on the scheduler thread, not tens.
    dev, host = device_pages.astype(np.int64, copy=False), host_pages.astype(np.int64, copy=False)
    breaks = np.flatnonzero((dev[1:] != dev[:-1] + 1) | (host[1:] != host[:-1] + 1))
    starts = np.empty(len(breaks) + 1, dtype=np.int64)
    starts[0] = 0
    starts[1:] = breaks + 1
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[-1] = n
    return dev[starts], host[starts], ends - starts


def runs_of(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs of consecutive ids of a page array: (start indices, lengths)."""
    n = len(pages)
    starts = np.concatenate(([0], np.flatnonzero(np.diff(pages) != 1) + 1))
    return starts, np.diff(np.concatenate((starts, [n])))


def split_at_chunks(
    host_offsets: np.ndarray, others: np.ndarray, sizes: np.ndarray, chunk: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split DMA runs so no run crosses a multiple of `chunk` on the host side.

    The arena registers its memory in chunks (HostArena's
    register_chunk_bytes) and one cudaMemcpyAsync spanning two
    registrations fails with cudaErrorInvalidValue (seen on the H200). Runs
    that fit stay as they are; the rare crossing ones are cut. Returns
    `(host_offsets, other_addresses, sizes)`.
    """
    first, last = host_offsets // chunk, (host_offsets + sizes - 1) // chunk
    cross = np.flatnonzero(first != last)
    if len(cross) == 0:
        return host_offsets, others, sizes
    keep = np.ones(len(sizes), dtype=bool)
    keep[cross] = False
    h, o, n = [host_offsets[keep]], [others[keep]], [sizes[keep]]
    for i in cross.tolist():
        a, b, size = int(host_offsets[i]), int(others[i]), int(sizes[i])
        while size > 0:
            piece = min(size, (a // chunk + 1) * chunk - a)
            h.append(np.array([a])), o.append(np.array([b])), n.append(np.array([piece]))
            a, b, size = a + piece, b + piece, size - piece
    return np.concatenate(h), np.concatenate(o), np.concatenate(n)


def dma_plan(
    device_pages: np.ndarray,
    host_pages: np.ndarray,
    page_bytes: int,
    device_layer: int,
    host_base: int,
    host_layer_offset: int,
    chunk: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The DMAs of one layer's copy: `(device addresses, host addresses, sizes)`, uint64.

    `device_layer` is the device address of page 0 of the device layer;
    `host_base` the address of the arena and `host_layer_offset` the arena
    byte offset of page 0 of the host layer; `chunk` the arena's registration
    chunk. One descriptor per run consecutive on both sides (in the given
    order), cut where a run crosses a chunk. O(n) in the page count.
    """
    dev0, host0, lengths = coalesce_in_order(device_pages, host_pages)
    sizes = lengths * page_bytes
    host_off, dev_addr, sizes = split_at_chunks(host_layer_offset + host0 * page_bytes, device_layer + dev0 * page_bytes, sizes, chunk)
    return (
        np.ascontiguousarray(dev_addr, dtype=np.uint64),
        np.ascontiguousarray(host_off + host_base, dtype=np.uint64),
        np.ascontiguousarray(sizes, dtype=np.uint64),
    )


def run_starts(device_pages: np.ndarray, host_pages: np.ndarray, limit: int) -> list[int] | None:
    """Indices where the runs (consecutive on both sides, in the given order)
    start, when there are at most `limit` of them; None otherwise.

    Rejects a copy whose first `2 * limit + 2` device pages already hold more
    than `limit` runs with a short Python loop (scattered copies cost a few
    microseconds, not O(n)); otherwise O(n), vectorised. Page ids must lie
    in [0, 2^31) (the CUDA engines check it first).

    >>> run_starts(np.array([4, 5, 6, 9]), np.array([1, 2, 3, 0]), 2)
    [0, 3]
    >>> run_starts(np.array([4, 7, 9]), np.array([1, 2, 3]), 2) is None
    True
    """
    n = len(device_pages)
    if n <= 1:
        return [0] if n else []
    head = device_pages[: 2 * limit + 2].tolist()
    early, prev = 0, head[0]
    for page in head[1:]:
        if page - prev != 1:
            early += 1
            if early >= limit:
                return None
        prev = page
    # One key per pair (ids are below 2^31): consecutive on both sides <=> the key steps by 2^32 + 1.
    key = (device_pages << 32) | host_pages
    breaks = np.flatnonzero(np.diff(key) != (1 << 32) + 1)
    if len(breaks) >= limit:
        return None
    return [0, *(breaks + 1).tolist()]


def plan_runs(
    device_pages: np.ndarray,
    host_pages: np.ndarray,
    starts: list[int],
    page_bytes: int,
    device_layer: int,
    host_base: int,
    host_layer_offset: int,
    chunk: int,
) -> tuple[list[int], list[int], list[int]]:
    """`dma_plan` for a copy of few runs (`run_starts`), in plain Python:
    (device addresses, host addresses, sizes) as lists, cheaper than numpy
    for a handful of runs. O(runs + chunk boundaries crossed)."""
    n = len(device_pages)
    dev0 = device_pages[starts].tolist()
    host0 = host_pages[starts].tolist()
    devs: list[int] = []
    hosts: list[int] = []
    sizes: list[int] = []
    for s, e, d, h in zip(starts, [*starts[1:], n], dev0, host0):
        size = (e - s) * page_bytes
        off = host_layer_offset + h * page_bytes
        dev = device_layer + d * page_bytes
        while size:  # cut where the run crosses a registration chunk of the arena
            piece = min(size, (off // chunk + 1) * chunk - off)
            devs.append(dev)
            hosts.append(host_base + off)
            sizes.append(piece)
            off, dev, size = off + piece, dev + piece, size - piece
    return devs, hosts, sizes
