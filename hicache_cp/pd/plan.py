"""Planning a PD send: which bytes go where, as coalesced descriptors. Pure: changes nothing.

`PageHomes` lists, per request-absolute page position, the tier (0 = L1,
1 = L2), the logical page id in that tier's pool and the page's prefix hash
(for verification). `plan_transfer` keeps the positions this rank owns
(``position % cp_size == rank``: those pages live on its lane by
construction), checks the exact contract (docs/invariants.md rule 8) and builds one
run per stretch where source and destination pages are both consecutive
(and the tier is the same), for every (part, layer) asked for.

Contract checks (each raises, nothing is truncated): positions inside the
room; request-absolute chunks (a chunk starts at or after this rank's
previous chunk's end, or repeats its start for more layers; a chunk-local 0
raises); every page owned by this rank; physical pages inside their pool;
no (part, layer, position) sent twice.

Cost: O(n log n) numpy over the n positions, plus one list of runs per
(part, layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from hicache_cp.cp import mapping as cp_mapping
from hicache_cp.errors import ConsistencyError
from hicache_cp.layout import KVLayout, Part, PartLayout
from hicache_cp.pd.registration import RegistrationDescriptor
from hicache_cp.pd.room import Room

__all__ = ["L1", "L2", "PageHomes", "TransferPlan", "plan_transfer", "tier_name"]

L1 = 0
L2 = 1


def tier_name(tier: int) -> str:
    return "L1" if tier == L1 else "L2"


@dataclass
class PageHomes:
    """Where each page of a request (or chunk) lives. All arrays have one entry per position."""

    positions: np.ndarray  # int64, request-absolute page positions
    tier: np.ndarray  # 0 = L1, 1 = L2
    pages: np.ndarray  # int64, logical page id in that tier's pool
    prefix_hashes: np.ndarray  # uint64, for the decode peer's verification

    def __post_init__(self) -> None:
        self.positions = np.asarray(self.positions, dtype=np.int64)
        self.tier = np.asarray(self.tier, dtype=np.int8)
        self.pages = np.asarray(self.pages, dtype=np.int64)
        self.prefix_hashes = np.asarray(self.prefix_hashes, dtype=np.uint64)
        n = {len(self.positions), len(self.tier), len(self.pages), len(self.prefix_hashes)}
        if len(n) != 1:
            raise ValueError(f"PageHomes: {len(self.positions)} positions, {len(self.tier)} tiers, "
                             f"{len(self.pages)} pages, {len(self.prefix_hashes)} hashes; counts must match")
        if len(self.tier) and not np.isin(self.tier, (L1, L2)).all():
            raise ValueError(f"PageHomes: tiers must be 0 (L1) or 1 (L2), got {np.unique(self.tier).tolist()}")
        if len(np.unique(self.positions)) != len(self.positions):
            raise ValueError("PageHomes: duplicate positions")

    def __len__(self) -> int:
        return len(self.positions)

    def concat(self, other: PageHomes) -> PageHomes:
        return PageHomes(np.concatenate([self.positions, other.positions]), np.concatenate([self.tier, other.tier]),
                         np.concatenate([self.pages, other.pages]),
                         np.concatenate([self.prefix_hashes, other.prefix_hashes]))


@dataclass
class TransferPlan:
    """The descriptors one send submits (coalesced runs), and its per-part counts."""

    srcs: list[int]
    dsts: list[int]
    lens: list[int]
    positions: np.ndarray  # owned positions, sorted
    hashes: np.ndarray
    keys: list[tuple[Part, int]]  # (part, layer) covered
    tiers: np.ndarray = field(default_factory=lambda: np.empty(0, np.int8))  # per owned position
    pages: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # logical source page per position
    dst_pages: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # decode page per position
    bytes_per_part: dict[Part, int] = field(default_factory=dict)
    descriptors_per_part: dict[Part, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(self.lens)


def plan_transfer(
    layout: KVLayout,
    sources: dict[int, RegistrationDescriptor],
    pool_pages: dict[int, int],
    dest: RegistrationDescriptor,
    room: Room,
    homes: PageHomes,
    parts: Iterable[tuple[Part, int]] | None,
    *,
    rank: int,
    cp_size: int,
    chunk_first_position: int | None,
) -> TransferPlan:
    """Coalesced descriptors for this rank's share of `homes` over (part, layer)
    pairs (default: all); see the module docstring for the checks."""
    assert room.dst_pages is not None
    room_id = room.room_id
    keys = [(p.part, layer) for p in layout.parts for layer in p.layer_ids] if parts is None else list(parts)
    own = homes.positions % cp_size == rank
    order = np.argsort(homes.positions[own], kind="stable")
    pos = homes.positions[own][order]
    tier = homes.tier[own][order]
    pages = homes.pages[own][order]
    hashes = homes.prefix_hashes[own][order]
    n = len(pos)
    if n and (pos[0] < 0 or pos[-1] >= room.num_pages):
        raise ValueError(f"room {room_id}: positions [{pos[0]}, {pos[-1]}] outside the request's "
                         f"{room.num_pages} pages; a room takes exactly its pages, nothing is truncated")
    if chunk_first_position is not None and n and pos[0] < chunk_first_position:
        raise ValueError(f"room {room_id}: position {pos[0]} precedes the chunk start "
                         f"{chunk_first_position}; positions are request-absolute")
    if chunk_first_position is not None and chunk_first_position < room.next_position \
            and chunk_first_position != room.chunk_start:
        raise ValueError(f"room {room_id}: chunk starts at page {chunk_first_position} but this rank already "
                         f"sent up to page {room.next_position - 1}; pass the cumulative page offset")
    if n:
        owners = cp_mapping.owner(pages, cp_size)
        if (owners != rank).any():
            bad = np.flatnonzero(owners != rank)
            raise ConsistencyError("page not owned by the rank of its position's lane", rank=rank,
                                   pages=pages[bad], details={"positions": pos[bad], "room": room_id})
    phys = cp_mapping.to_physical(pages, cp_size)
    for t in (L1, L2):
        sel = tier == t
        if not sel.any():
            continue
        if t not in sources:
            raise ValueError(f"room {room_id}: {int(sel.sum())} pages in {tier_name(t)}, "
                             f"which this sender was not given")
        bad = sel & ((phys < 1) | (phys >= pool_pages[t]))
        if bad.any():
            raise ValueError(f"room {room_id}: physical pages {phys[bad][:8].tolist()} outside the "
                             f"{tier_name(t)} pool [1, {pool_pages[t]})")
    for key in keys:
        sent = room.sent.get(key)
        if sent is not None and n and sent[pos].any():
            again = pos[sent[pos]]
            raise ValueError(f"room {room_id}: {key[0].value} layer {key[1]} positions {again[:8].tolist()} "
                             f"already sent (overlapping chunk?)")
    dst = room.dst_pages[pos]
    # Runs: break where the tier changes or source or destination pages are not consecutive.
    brk = np.ones(n, dtype=bool)
    if n > 1:
        brk[1:] = (tier[1:] != tier[:-1]) | (phys[1:] != phys[:-1] + 1) | (dst[1:] != dst[:-1] + 1)
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, n))
    run_tier, run_src, run_dst = tier[starts], phys[starts], dst[starts]
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    plan = TransferPlan(srcs, dsts, lens, pos, hashes, keys, tier, pages, dst)
    for part, layer in keys:
        pl: PartLayout = layout.part(part)
        slot = pl.slot(layer)
        d = dest.part(part)
        base = np.zeros(len(starts), dtype=np.int64)
        for t, desc in sources.items():
            base[run_tier == t] = desc.part(part).bases[slot]
        srcs += (base + run_src * pl.page_bytes).tolist()
        dsts += (d.bases[slot] + run_dst * d.page_stride).tolist()
        lens += (lengths * pl.page_bytes).tolist()
        plan.bytes_per_part[part] = plan.bytes_per_part.get(part, 0) + n * pl.page_bytes
        plan.descriptors_per_part[part] = plan.descriptors_per_part.get(part, 0) + len(starts)
    assert len(srcs) == len(dsts) == len(lens), (len(srcs), len(dsts), len(lens))
    return plan
