"""The L3 tier's two in-flight operations, as explicit state machines.

Prefetch (L3 -> reserved L2 pages, on match):

    RESERVED --get submitted--> FETCHING --every object of every rank read in
        |                          |        full, agreed--> COMMITTED (visible in L2)
        |                          v
        +--nothing submitted--> ABORTED <--call returned on every rank, agreed-- FAILING
                                   ^                                               ^
                                   +------------------------ missing key, short read,
                                             store down, deadline passed, cancel --+

    Until COMMITTED the fetched pages belong to the op, invisible to
    `match_prefix` and never evicted; COMMITTED hands them to the tree (all
    parts, all ranks at once); ABORTED releases them. A page counts only if
    it landed whole on every rank: partial fetches count nothing.

Write-back (committed L2 pages -> L3):

    QUEUED --the rank's put returned (or it had nothing to put, or it yielded:
             cancelled before it started so a backup could have its pages), agreed--> RETIRED

    While QUEUED the job *holds* its L2 pages: an L2 eviction of a held page
    takes it out of the tree but frees it only when the job retires, so a put
    never reads a page that was reused. A failed put is not a cache failure:
    the page is simply not in L3 (readers check every rank's object).

Both vote in the cache's one agreement per poll (`hicache_cp.cp.agreement`):
`ok` is no failure seen, `settled` is no call of this op running on this
rank. A call that failed in a way that may leave Mooncake moving bytes
(`L3Error.io_may_be_in_flight`) settles only `hold_s` later
(`L3Config.unsafe_hold_s`): its pages stay held (quarantined) that long, on
every rank alike, so a late transfer never lands in a reused page. Only
`transition()` changes `state`, and it checks the table.
"""

from __future__ import annotations

import enum
import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hicache_cp.cp.agreement import Vote
from hicache_cp.errors import IllegalTransition
from hicache_cp.l3.keys import L3Object
from hicache_cp.l3.store import L3Error, L3Timeout

if TYPE_CHECKING:
    from hicache_cp.match import MatchResult


class PrefetchState(enum.Enum):
    RESERVED = "reserved"
    FETCHING = "fetching"
    FAILING = "failing"
    COMMITTED = "committed"
    ABORTED = "aborted"


class WriteState(enum.Enum):
    QUEUED = "queued"
    RETIRED = "retired"


_PREFETCH_TABLE: dict[PrefetchState, frozenset[PrefetchState]] = {
    PrefetchState.RESERVED: frozenset({PrefetchState.FETCHING, PrefetchState.ABORTED}),
    PrefetchState.FETCHING: frozenset({PrefetchState.COMMITTED, PrefetchState.FAILING}),
    PrefetchState.FAILING: frozenset({PrefetchState.ABORTED}),
    PrefetchState.COMMITTED: frozenset(),
    PrefetchState.ABORTED: frozenset(),
}

_WRITE_TABLE: dict[WriteState, frozenset[WriteState]] = {
    WriteState.QUEUED: frozenset({WriteState.RETIRED}),
    WriteState.RETIRED: frozenset(),
}

_ids = itertools.count(1)


def _quarantine_until(exc: BaseException | None, hold_s: float) -> float | None:
    """When a failed call's pages may be reused (None: at once)."""
    if isinstance(exc, L3Error) and exc.io_may_be_in_flight:
        return time.monotonic() + hold_s
    return None


def _call_outcome(future: Future | None) -> tuple[bool, BaseException | None]:
    """(done, error) of a worker call; (True, None) when there was no call."""
    if future is None:
        return True, None
    if not future.done():
        return False, None
    if future.cancelled():  # never started (shutdown): nothing ran
        return True, L3Error("call", "cancelled before it started")
    return True, future.exception()


@dataclass(eq=False)
class PrefetchOp:
    """Fetch of the L3 continuation of one match into reserved L2 pages.

    Positions [first_position, end) are fetched (whole object groups);
    [first_position, start) may already be cached (a group's head): those
    pages are surplus when they land, as are pages whose prefix the tree no
    longer has by then (nothing is locked for the op: an unlucky eviction
    costs the fetch, never a stuck tree path).
    """

    tokens: np.ndarray  # the request's tokens up to `end` (whole pages, int64)
    first_position: int
    start: int
    host_pages: np.ndarray  # logical L2 pages for [first_position, end)
    objects: list[L3Object]  # this rank's objects (may be empty on a CP rank)
    deadline: float  # time.monotonic() after which the op fails
    id: int = field(default_factory=lambda: next(_ids))
    state: PrefetchState = PrefetchState.RESERVED
    future: Future | None = None
    error: BaseException | None = None
    cancelled: bool = False
    hold_s: float = 0.0  # how long pages stay held after a failure that may leave I/O in flight
    quarantined_until: float | None = None
    match: MatchResult | None = None  # the request waiting for it, if any
    nbytes: int = 0

    @property
    def end(self) -> int:
        return self.first_position + len(self.host_pages)

    @property
    def num_pages(self) -> int:
        return len(self.host_pages)

    @property
    def active(self) -> bool:
        return self.state in (PrefetchState.RESERVED, PrefetchState.FETCHING, PrefetchState.FAILING)

    def transition(self, new: PrefetchState) -> None:
        if new not in _PREFETCH_TABLE[self.state]:
            raise IllegalTransition(f"prefetch {self.id}: {self.state.value} -> {new.value} is not allowed")
        self.state = new

    def local_vote(self, now: float | None = None) -> Vote:
        """This rank's view; records a failure, a passed deadline or a cancel. Non-blocking."""
        done, exc = _call_outcome(self.future)
        if done and exc is not None and self.error is None:
            self.error = exc
            self.quarantined_until = _quarantine_until(exc, self.hold_s)
        elif done and exc is None and self.future is not None and self.error is None:
            self.nbytes = int(self.future.result())
        now = time.monotonic() if now is None else now
        if not done and self.error is None and not self.cancelled and now > self.deadline:
            self.error = L3Timeout("get", "prefetch deadline passed", details={"op": self.id})
        if self.error is not None or self.cancelled or self.state is PrefetchState.FAILING:
            return Vote(ok=False, settled=done and (self.quarantined_until is None or now >= self.quarantined_until))
        return Vote(ok=True, settled=done)

    @property
    def quarantined(self) -> bool:
        return self.quarantined_until is not None


@dataclass(eq=False)
class WriteJob:
    """A put of committed L2 pages to L3. `held` are the logical L2 pages it
    holds on every rank (all ranks' pages of its groups); `objects` and
    `physical` this rank's objects and their physical pages."""

    held: np.ndarray
    objects: list[L3Object]
    physical: list[np.ndarray]
    id: int = field(default_factory=lambda: next(_ids))
    state: WriteState = WriteState.QUEUED
    future: Future | None = None
    error: BaseException | None = None
    hold_s: float = 0.0
    quarantined_until: float | None = None
    #: Cancelled before its put started, so that a backup could have its evicted
    #: pages (`Tier3.yield_queued_puts`): no failure, the pages just never reach L3.
    yielded: bool = False

    @property
    def active(self) -> bool:
        return self.state is WriteState.QUEUED

    @property
    def quarantined(self) -> bool:
        return self.quarantined_until is not None

    def transition(self, new: WriteState) -> None:
        if new not in _WRITE_TABLE[self.state]:
            raise IllegalTransition(f"write job {self.id}: {self.state.value} -> {new.value} is not allowed")
        self.state = new

    def local_vote(self) -> Vote:
        done, exc = _call_outcome(self.future)
        if done and exc is not None and self.error is None and not self.yielded:
            self.error = exc
            self.quarantined_until = _quarantine_until(exc, self.hold_s)
        released = self.quarantined_until is None or time.monotonic() >= self.quarantined_until
        return Vote(ok=True, settled=done and released)
