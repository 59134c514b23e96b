"""Which pages of a copy each rank writes, when the node keeps one copy for all of them.

With a replicated pool (`Sharing.REPLICATED`) every rank holds the same KV
in its own GPU memory, and any one of them can back a page up. `write_share`
cuts an op's pages into `world` contiguous slices and gives each rank one:
each rank's link then carries 1/world of the D2H, and a rank's slice is one
run of device pages and one run of host pages, as the whole op was (copies
coalesce as before). Which slice is whose rotates with the op's first
request position, so ops shorter than `world` pages spread over the ranks
too. Loads are not shared: every rank reads every page it needs into its
own GPU.

The slices depend only on replicated facts (the op's first position and
length, the rank and the world), so every rank computes the same map with
no collective. Example: 10 pages at first position 3 over 4 ranks: slice
bounds 0, 2, 5, 7, 10; slice j goes to rank (j + 3) mod 4, so rank 0 writes
pages [2, 5) of the op, rank 1 [5, 7), rank 2 [7, 10) and rank 3 [0, 2).
"""

from __future__ import annotations


def write_share(first_position: int, num_pages: int, rank: int, world: int) -> tuple[int, int]:
    """`[lo, hi)`: the op's pages (indices into its page arrays) that `rank` writes. O(1).

    Over all ranks the slices are disjoint and cover `[0, num_pages)`; each is
    `num_pages // world` or one more page long."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    j = (rank - first_position) % world
    return j * num_pages // world, (j + 1) * num_pages // world
