"""A PD transfer room: one request's pages on their way to the decode peer.

States and the only transitions (`Room.transition` performs and checks them)::

    BOOTSTRAPPING --open ok--> TRANSFERRING --every byte landed, verified--> SUCCESS
         |                          |
         +-------- any failure -----+--> FAILED   (timeout, engine error, mismatch,
                                                   no destination, peer gone)

SUCCESS and FAILED are final. A FAILED room refuses every later chunk
(`Room.require_open` raises :class:`RoomFailed`): the pages it would write
may already be reused (docs/invariants.md rule 9).

Liveness: every room has a deadline (``timeout_s``, 300 s by default,
`Config.pd_timeout_s`). `RoomTable.poll()` aborts rooms past it: state
FAILED, reason ``"timeout after X s"``. A room that is concluded with no
destination and is not complete becomes FAILED with a WARNING.

Drain before reclaim: an abort first stops new chunks (FAILED at once), then
waits up to ``drain_s`` for the batches already submitted; a batch still in
flight after that goes to the engine adapter's reaper (`abandon`) and the
room stays *draining*: its pages are not released while a write that reads
them (or lands in the decode pages) may still be in flight. `RoomTable.poll()`
releases a draining room once its last batch ended (`drained()` lists them).

`release(room)` is called exactly once per room, when it is final (SUCCESS
or FAILED) and no batch of it is in flight; after it the source pages are
the caller's again.
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

__all__ = ["DEFAULT_DRAIN_S", "DEFAULT_TIMEOUT_S", "Room", "RoomFailed", "RoomState", "RoomTable"]

#: Seconds a room may stay unfinished before it is aborted (docs/invariants.md rule 9).
DEFAULT_TIMEOUT_S = 300.0
#: Seconds an abort waits inline for the room's submitted batches before it
#: leaves them to the reaper (the pages stay quarantined until they end).
DEFAULT_DRAIN_S = 10.0


def _batch_done(batch: object) -> bool:
    """An engine batch has ended (landed or failed); objects without `done` count as ended."""
    return bool(getattr(batch, "done", True))


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
    src_tier: np.ndarray | None = None  # int8 tier each position was sent from (-1: not yet)
    src_pages: np.ndarray | None = None  # int64 logical page each position was sent from
    sent: dict[tuple[Part, int], np.ndarray] = field(default_factory=dict)  # (part, layer) -> bool[num_pages]
    bytes_sent: dict[Part, int] = field(default_factory=dict)
    descriptors_sent: dict[Part, int] = field(default_factory=dict)
    pages_sent: dict[Part, int] = field(default_factory=dict)
    in_flight: list[object] = field(default_factory=list)  # engine Batch handles
    first_submit: float | None = None
    transfer_done: float | None = None
    forward_end: float | None = None  # perf_counter when the forward's last layer was complete
    released: bool = False
    draining: bool = False  # final, but a batch may still be in flight: pages not released yet
    tail_tokens: int = 0  # tokens of the last (partial) page, 0 when every page is whole
    deferred_failure: str | None = None  # a submission failed off the caller's thread
    #: part -> (positions, tiers, source pages, decode pages) per send; only while the
    #: partition dump (logger hicache_cp.pd.partition at DEBUG) is on
    partition: dict[Part, list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]] = field(default_factory=dict)
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
        if new.final:
            self.try_release()

    def try_release(self) -> bool:
        """Release the pages once final and nothing is in flight (True when released, now or before)."""
        if self.released:
            return True
        if not self.state.final:
            return False
        self.in_flight = [b for b in self.in_flight if not _batch_done(b)]
        if self.in_flight:
            self.draining = True
            return False
        self.draining = False
        self.released = True
        if self.release is not None:
            self.release(self)
        return True

    def fail(self, reason: str) -> None:
        """FAILED unless already final (a second failure keeps the first reason)."""
        if not self.state.final:
            self.transition(RoomState.FAILED, reason)

    def require_open(self) -> None:
        """Raise RoomFailed (or IllegalTransition) unless chunks may still be sent.

        A room past its deadline is refused here at once (the caller aborts it)."""
        if self.expired():
            raise RoomFailed(self.room_id, self.request_id, f"timeout after {self.timeout_s:g} s")
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
        assert self.released == (self.state.final and not self.draining), (self.released, self.draining, self.state)
        assert not self.draining or self.state.final, (self.draining, self.state)
        if self.dst_pages is not None:
            assert len(self.dst_pages) == self.num_pages, (len(self.dst_pages), self.num_pages)
        for key, m in self.sent.items():
            assert m.shape == (self.num_pages,), (key, m.shape)
        assert all(v >= 0 for v in self.bytes_sent.values()), self.bytes_sent


class RoomTable:
    """Rooms by id on one prefill rank, with deadline polling.

    `abandon` is the engine adapter's `abandon` (a reaper drains the batch);
    `drain(batch, timeout) -> bool` waits up to `timeout` for a batch to end
    (True when it did). Both are used for the batches of aborted rooms.
    """

    def __init__(self, abandon: Callable[[object], None] | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, *,
                 drain: Callable[[object, float], bool] | None = None,
                 drain_s: float = DEFAULT_DRAIN_S) -> None:
        if not timeout_s > 0 or timeout_s == float("inf"):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s}")
        if not drain_s >= 0:
            raise ValueError(f"drain_s must be >= 0, got {drain_s}")
        self.timeout_s = timeout_s
        self.drain_s = drain_s
        self._abandon = abandon
        self._drain = drain
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

    def abort(self, room: Room, reason: str) -> bool:
        """FAILED with `reason` (no later chunk), then drain: wait up to
        `drain_s` for the submitted batches, abandon what is left to the
        reaper, and release the pages only when nothing is in flight.

        Returns True when the room is released (drained), False while it is
        draining (`drained` releases it later)."""
        if room.released:
            return True
        room.fail(reason)  # refuses chunks at once; release waits for the drain
        deadline = time.monotonic() + self.drain_s
        for batch in list(room.in_flight):
            if _batch_done(batch):
                continue
            ended = self._drain is not None and self._drain(batch, max(0.0, deadline - time.monotonic()))
            if not ended and self._abandon is not None:
                self._abandon(batch)
        if room.try_release():
            return True
        logger.warning("PD room %d (request %d): %d batches still in flight after %g s; its pages stay held "
                       "until they end", room.room_id, room.request_id, len(room.in_flight), self.drain_s)
        return False

    def poll(self, now: float | None = None) -> list[Room]:
        """Abort every room past its deadline; returns the rooms aborted now."""
        now = time.monotonic() if now is None else now
        aborted = [r for r in self.rooms.values() if r.expired(now)]
        for room in aborted:
            self.abort(room, f"timeout after {room.timeout_s:g} s")
        return aborted

    def drained(self) -> list[Room]:
        """Release draining rooms whose last batch has ended; returns them."""
        return [r for r in self.rooms.values() if r.draining and r.try_release()]

    def forget(self, room_id: int) -> None:
        """Drop a final room's record (after the caller read its result)."""
        room = self.get(room_id)
        if not room.released:
            raise ValueError(f"room {room_id} is {room.state.name}{' (draining)' if room.draining else ''}; "
                             f"only released rooms can be forgotten")
        del self.rooms[room_id]

    def check_invariants(self) -> None:
        for room in self.rooms.values():
            room.check_invariants()
