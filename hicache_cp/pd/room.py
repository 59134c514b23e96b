"""A PD transfer room: one request's pages on their way to the decode peer.

States and the only transitions (`Room.transition` performs and checks them)::

    BOOTSTRAPPING --open ok--> TRANSFERRING --every byte landed, verified--> SUCCESS
         |                          |
         +-------- any failure -----+--> FAILED   (timeout, engine error, mismatch,
                                                   no destination, peer gone)

SUCCESS and FAILED are final. A FAILED room refuses every later chunk
(`Room.require_open` raises :class:`RoomFailed`): the pages it would write
may already be reused (DOMAIN.md rule 9).

Liveness: every room has a deadline (``timeout_s``, 300 s by default).
`RoomTable.poll()` aborts rooms past it: state FAILED, reason
``"timeout after X s"``, in-flight batches handed to the engine adapter's
reaper (`abandon`), and the caller's pages released through the room's
`release` callback. A room that is concluded with no destination and is not
complete becomes FAILED with a WARNING.

`release(room)` is called exactly once per room, when it reaches a final
state (SUCCESS or FAILED); after it the source pages are the caller's again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import numpy as np

from hicache_cp.errors import HiCacheError, IllegalTransition
from hicache_cp.layout import Part

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_TIMEOUT_S", "Room", "RoomFailed", "RoomState", "RoomTable"]

#: Seconds a room may stay unfinished before it is aborted (DOMAIN.md rule 9).
DEFAULT_TIMEOUT_S = 300.0


class RoomState(Enum):
    BOOTSTRAPPING = "bootstrapping"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        return self in (RoomState.SUCCESS, RoomState.FAILED)


_ALLOWED: dict[RoomState, frozenset[RoomState]] = {
    RoomState.BOOTSTRAPPING: frozenset({RoomState.TRANSFERRING, RoomState.FAILED}),
    RoomState.TRANSFERRING: frozenset({RoomState.SUCCESS, RoomState.FAILED}),
    RoomState.SUCCESS: frozenset(),
    RoomState.FAILED: frozenset(),
}


@dataclass
class RoomFailed(HiCacheError):
    """An operation on a room that has failed (or was aborted)."""

    room_id: int
    request_id: int
    reason: str

    def __str__(self) -> str:
        return f"PD room {self.room_id} (request {self.request_id}) failed: {self.reason}"


@dataclass(eq=False)
class Room:
    """The record of one room on the prefill side (one per rank)."""

    room_id: int
    request_id: int
    num_pages: int
    deadline: float  # time.monotonic() seconds
    timeout_s: float
    release: Callable[[Room], None] | None = None
    state: RoomState = RoomState.BOOTSTRAPPING
    failure: str | None = None
    dst_pages: np.ndarray | None = None  # decode page for each request position
    peer: str | None = None  # decode engine session
    next_position: int = 0  # one past the last position this side sent
    chunk_start: int | None = None  # chunk_first_position of the latest chunk sent
    hashes: np.ndarray | None = None  # uint64 prefix hash per position sent
    sent: dict[tuple[Part, int], np.ndarray] = field(default_factory=dict)  # (part, layer) -> bool[num_pages]
    bytes_sent: dict[Part, int] = field(default_factory=dict)
    descriptors_sent: dict[Part, int] = field(default_factory=dict)
    pages_sent: dict[Part, int] = field(default_factory=dict)
    in_flight: list[object] = field(default_factory=list)  # engine Batch handles
    first_submit: float | None = None
    transfer_done: float | None = None
    released: bool = False
    mismatches: list[str] = field(default_factory=list)  # from the decode peer's verification
    mismatch_count: int = 0

    @property
    def positions(self) -> np.ndarray:
        """Request-absolute positions this side has sent (any part, any layer)."""
        if not self.sent:
            return np.empty(0, dtype=np.int64)
        mask = np.zeros(self.num_pages, dtype=bool)
        for m in self.sent.values():
            mask |= m
        return np.flatnonzero(mask)

    def transition(self, new: RoomState, reason: str | None = None) -> None:
        """The one place a room changes state. FAILED needs a reason.

        Reaching a final state calls `release` (once)."""
        if new not in _ALLOWED[self.state]:
            raise IllegalTransition(f"room {self.room_id}: {self.state.name} -> {new.name} is not allowed"
                                    + (f" (failure: {self.failure})" if self.failure else ""))
        if new is RoomState.FAILED:
            if not reason:
                raise ValueError(f"room {self.room_id}: FAILED needs a reason")
            self.failure = reason
            logger.warning("PD room %d (request %d) failed: %s", self.room_id, self.request_id, reason)
        else:
            logger.debug("PD room %d: %s -> %s", self.room_id, self.state.name, new.name)
        self.state = new
        if new.final and not self.released:
            self.released = True
            if self.release is not None:
                self.release(self)

    def fail(self, reason: str) -> None:
        """FAILED unless already final (a second failure keeps the first reason)."""
        if not self.state.final:
            self.transition(RoomState.FAILED, reason)

    def require_open(self) -> None:
        """Raise RoomFailed (or IllegalTransition) unless chunks may still be sent."""
        if self.state is RoomState.FAILED:
            raise RoomFailed(self.room_id, self.request_id, self.failure or "failed")
        if self.state is not RoomState.TRANSFERRING:
            raise IllegalTransition(f"room {self.room_id} is {self.state.name}; chunks need TRANSFERRING")

    def expired(self, now: float | None = None) -> bool:
        return not self.state.final and (time.monotonic() if now is None else now) > self.deadline

    def conclude_without_destination(self, detail: str = "") -> None:
        """The destination is gone: FAILED (WARNING) unless already complete."""
        if self.state is not RoomState.SUCCESS:
            self.fail("no destination and transfer not complete" + (f": {detail}" if detail else ""))

    def check_invariants(self) -> None:
        assert (self.state is RoomState.FAILED) == (self.failure is not None), (self.state, self.failure)
        assert self.released == self.state.final, (self.released, self.state)
        if self.dst_pages is not None:
            assert len(self.dst_pages) == self.num_pages, (len(self.dst_pages), self.num_pages)
        for key, m in self.sent.items():
            assert m.shape == (self.num_pages,), (key, m.shape)
        assert all(v >= 0 for v in self.bytes_sent.values()), self.bytes_sent


class RoomTable:
    """Rooms by id on one prefill rank, with deadline polling.

    `abandon` is the engine adapter's `abandon`, used for in-flight batches
    of rooms that are aborted.
    """

    def __init__(self, abandon: Callable[[object], None] | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._abandon = abandon
        self.rooms: dict[int, Room] = {}

    def open(self, room_id: int, request_id: int, num_pages: int, *,
             release: Callable[[Room], None] | None = None, timeout_s: float | None = None) -> Room:
        if room_id in self.rooms and not self.rooms[room_id].state.final:
            raise ValueError(f"room {room_id} is already open ({self.rooms[room_id].state.name})")
        if num_pages <= 0:
            raise ValueError(f"room {room_id}: a request needs at least one page, got {num_pages}")
        t = self.timeout_s if timeout_s is None else timeout_s
        room = Room(room_id, request_id, num_pages, time.monotonic() + t, t, release)
        self.rooms[room_id] = room
        return room

    def get(self, room_id: int) -> Room:
        try:
            return self.rooms[room_id]
        except KeyError:
            raise ValueError(f"unknown PD room {room_id}") from None

    def abort(self, room: Room, reason: str) -> None:
        """FAILED with `reason`; abandon in-flight batches; release the pages."""
        if room.state.final:
            return
        for batch in room.in_flight:
            if self._abandon is not None:
                self._abandon(batch)
        room.in_flight.clear()
        room.fail(reason)

    def poll(self, now: float | None = None) -> list[Room]:
        """Abort every room past its deadline; returns the rooms aborted now."""
        now = time.monotonic() if now is None else now
        aborted = [r for r in self.rooms.values() if r.expired(now)]
        for room in aborted:
            self.abort(room, f"timeout after {room.timeout_s:g} s")
        return aborted

    def forget(self, room_id: int) -> None:
        """Drop a final room's record (after the caller read its result)."""
        room = self.get(room_id)
        if not room.state.final:
            raise ValueError(f"room {room_id} is {room.state.name}; only final rooms can be forgotten")
        del self.rooms[room_id]

    def check_invariants(self) -> None:
        for room in self.rooms.values():
            room.check_invariants()
