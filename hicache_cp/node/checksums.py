"""Checksums of the node segment's pages, computed on the CPU from the host copy.

One 64-bit checksum per (page, unit), a unit being one layer of one part
(`NodeGeometry.unit_index`). The function is the project's page hash
(`hicache_cp.keys.page_hashes`) over the unit's bytes read as 64-bit words:
a random odd multiplier per word position, summed mod 2**64, then mixed
(splitmix64). Two different units collide with probability about 2**-64;
any change confined to one word always changes the sum (the multipliers are
odd, so invertible). Throughput: numpy, about 1-2 GB/s a core (one multiply
and one add a word); it runs over the pages a rank wrote, once, after they
landed, and over an adopted page once, before its first use.

Where the GPU checksums of the verified-restores work are connected, they
replace these (the journal stores whatever the rank records).
"""

from __future__ import annotations

import numpy as np

from hicache_cp.keys import page_hashes
from hicache_cp.layout import KVLayout


def unit_sums(layout: KVLayout, views: dict, physical: np.ndarray) -> np.ndarray:
    """Checksums [len(physical), units] of the physical pages `physical` of one copy.

    `views`: part -> numpy uint8 [slots, physical_pages, page_bytes] of that
    copy (`HostPool.part_view`). Page bytes are multiples of 8 (the config
    checks it). O(bytes of those pages), no Python loop over pages."""
    physical = np.asarray(physical, np.int64)
    out = np.empty((len(physical), sum(p.num_slots for p in layout.parts)), np.uint64)
    col = 0
    for p in layout.parts:
        words = p.page_bytes // 8
        block = views[p.part][:, physical]  # [slots, n, page_bytes] (a copy)
        sums = page_hashes(block.view(np.int64).reshape(-1), words)  # one hash per (slot, page)
        out[:, col : col + p.num_slots] = sums.reshape(p.num_slots, len(physical)).T
        col += p.num_slots
    return out
