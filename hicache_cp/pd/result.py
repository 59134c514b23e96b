"""A room's outcome as the caller sees it, and the partition dump (a debugging aid).

`room_result(room)` builds the `RoomResult` that `PdSender.finish` returns:
state, failure, bytes / descriptors / pages per part actually submitted
(docs/invariants.md rule 10), transfer time and rate, the decode peer's mismatches,
and ``ready_s`` (the forward's end to every batch landed, when measured).

`dump_partition` logs, when the logger ``hicache_cp.pd.partition`` is at
DEBUG, each part's positions with their source (tier, page) and decode page:
for diffing a cache hit against a miss. It has no other effect.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from hicache_cp.layout import KVLayout
from hicache_cp.pd.plan import tier_name
from hicache_cp.pd.room import Room, RoomState

__all__ = ["RoomResult", "dump_partition", "partition_log", "room_result"]

partition_log = logging.getLogger("hicache_cp.pd.partition")


@dataclass
class RoomResult:
    room_id: int
    request_id: int
    state: RoomState
    failure: str | None
    bytes_per_part: dict[str, int]
    descriptors_per_part: dict[str, int]
    pages_per_part: dict[str, int]
    transfer_s: float
    gbps: float  # bytes / transfer_s / 1e9 (first submit to last batch done)
    mismatches: list[str] = field(default_factory=list)
    mismatch_count: int = 0
    ready_s: float | None = None  # forward's end -> every batch landed (None: not measured)

    @property
    def ok(self) -> bool:
        return self.state is RoomState.SUCCESS

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_per_part.values())

    @property
    def descriptors(self) -> int:
        return sum(self.descriptors_per_part.values())



def room_result(room: Room) -> RoomResult:
    t = 0.0
    if room.first_submit is not None and room.transfer_done is not None:
        t = room.transfer_done - room.first_submit
    ready = None
    if room.forward_end is not None and room.transfer_done is not None and room.state is RoomState.SUCCESS:
        ready = max(0.0, room.transfer_done - room.forward_end)
    nbytes = sum(room.bytes_sent.values())
    pages: dict[str, int] = {}
    for (part, _), m in room.sent.items():
        pages[part.value] = max(pages.get(part.value, 0), int(m.sum()))
    return RoomResult(
        room.room_id, room.request_id, room.state, room.failure,
        {p.value: b for p, b in room.bytes_sent.items()},
        {p.value: c for p, c in room.descriptors_sent.items()}, pages, t,
        nbytes / t / 1e9 if t > 0 else 0.0,
        list(room.mismatches), room.mismatch_count, ready)


def dump_partition(layout: KVLayout, room: Room, rank: int) -> None:
    """Each part's positions, sources and decode pages (DEBUG on ``hicache_cp.pd.partition``)."""
    if not partition_log.isEnabledFor(logging.DEBUG):
        return
    for p in layout.parts:
        rows = room.partition.get(p.part, [])
        if not rows:
            partition_log.debug("room %d request %d rank %d %s: nothing sent", room.room_id, room.request_id,
                                rank, p.part.value)
            continue
        pos, tier, pages, dst = (np.concatenate([r[i] for r in rows]) for i in range(4))
        order = np.argsort(pos, kind="stable")
        pos, first = np.unique(pos[order], return_index=True)
        src = [f"{tier_name(int(t))}:{int(g)}" for t, g in zip(tier[order][first], pages[order][first])]
        partition_log.debug("room %d request %d rank %d %s (%s): positions %s sources %s decode pages %s",
                            room.room_id, room.request_id, rank, p.part.value, room.state.name,
                            pos.tolist(), src, dst[order][first].tolist())
