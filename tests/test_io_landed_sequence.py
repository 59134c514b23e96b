"""A poll asks the driver O(log in flight) times, not once per layer, and waiting for an op's
tickets newest first synchronises once (CPU, a driver double).

Copies of one direction complete in submission order, so a CUDA engine's
tickets share, per direction, how far its copies are known to have landed
(`hicache_cp.io.cuda.EngineSync`): a ticket below one seen landed answers
without a driver call, and `_CopyOp.reap` looks for the newest landed ticket
by bisection first. Checked with the engine's real ticket classes (`CudaTicket`
for copies issued on the caller's thread, `DeferredTicket` for the issue
worker's) over a driver double that counts event queries: the layers that
landed are exactly those whose events completed, the queries stay within
the bisection's bound, and one direction's progress never answers for the other.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from hicache_cp.config import Config
from hicache_cp.io.base import Direction, TicketState
from hicache_cp.io.cuda import CudaTicket
from hicache_cp.io.engine_sync import EngineSync
from hicache_cp.io.dma import DeferredTicket
from hicache_cp.io.issue import Job
from hicache_cp.layout import Part
from hicache_cp.ops import BackupOp, LoadOp

PAGES = np.array([3, 4], np.int64)


class CountingDriver:
    """Event queries answered from `complete`, counted."""

    def __init__(self) -> None:
        self.complete: set[int] = set()
        self.queries = 0

    def event_query(self, event: int) -> bool:
        self.queries += 1
        return event in self.complete


def _sync(drv: CountingDriver) -> EngineSync:
    return EngineSync(drv, 0, 0)  # type: ignore[arg-type]


def _op(direction: Direction) -> BackupOp | LoadOp:
    layout = Config(model="tiny").layout()
    kind = BackupOp if direction is Direction.D2H else LoadOp
    return kind(layout, PAGES, PAGES, 0)


def _cuda_tickets(sync: EngineSync, direction: Direction, layers: int, nbytes: int) -> list[CudaTicket]:
    return [CudaTicket(direction, Part.TARGET_KV, layer, nbytes, sync, event=1000 + layer) for layer in range(layers)]


def _deferred_tickets(sync: EngineSync, direction: Direction, layers: int, nbytes: int) -> list[DeferredTicket]:
    job = Job(stream=7, order=1, dones=[1000 + i for i in range(layers)], descriptors=lambda i: None,
              release=lambda e: None)  # fmt: skip
    job.bind(threading.Condition())
    job.finish(layers)  # every layer issued: completion is the events'
    return [DeferredTicket(direction, Part.TARGET_KV, i, nbytes, sync, job, i) for i in range(layers)]


@pytest.mark.parametrize("make", [_cuda_tickets, _deferred_tickets], ids=["inline", "deferred"])
@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
@pytest.mark.parametrize("landed", [1, 40, 63, 64])
def test_a_poll_lands_exactly_the_completed_layers_in_log_queries(make, direction: Direction, landed: int) -> None:
    drv = CountingDriver()
    sync = _sync(drv)
    op = _op(direction)
    page_bytes = op.layout.part(Part.TARGET_KV).page_bytes
    tickets = make(sync, direction, 64, len(PAGES) * page_bytes)
    op.inflight.extend(tickets)  # one ticket a layer, as many as the test wants (reap reads only flight)
    drv.complete = {1000 + i for i in range(landed)}
    op.reap()
    assert op.landed[Part.TARGET_KV] == set(range(landed)), "landed layers must be exactly the completed copies"
    assert len(op.inflight) == 64 - landed
    bound = 2 + math.ceil(math.log2(64))  # the first ticket, the bisection, the scan's first pending one
    assert drv.queries <= bound, f"{drv.queries} driver queries for one poll of 64 layers (bound {bound})"


def test_nothing_landed_costs_one_query() -> None:
    drv = CountingDriver()
    op = _op(Direction.D2H)
    op.inflight.extend(_cuda_tickets(_sync(drv), Direction.D2H, 64, len(PAGES) * op.layout.part(Part.TARGET_KV).page_bytes))
    op.reap()
    assert drv.queries == 1 and not op.landed[Part.TARGET_KV]


def test_one_direction_never_answers_for_the_other() -> None:
    """Loads and backups run on different streams: a backup seen landed says nothing of a load."""
    drv = CountingDriver()
    sync = _sync(drv)
    backup = CudaTicket(Direction.D2H, Part.TARGET_KV, 0, 1, sync, event=1)
    load = CudaTicket(Direction.H2D, Part.TARGET_KV, 0, 1, sync, event=2)
    later_backup = CudaTicket(Direction.D2H, Part.TARGET_KV, 1, 1, sync, event=3)
    drv.complete = {3}
    assert later_backup.query() is TicketState.DONE
    assert backup.query() is TicketState.DONE  # submitted before a landed backup
    assert load.query() is TicketState.PENDING  # its own event has not completed
    drv.complete.add(2)
    assert load.query() is TicketState.DONE


def test_a_failed_submission_is_never_answered_as_landed() -> None:
    """A ticket whose submission failed stays FAILED, whatever landed after it."""
    drv = CountingDriver()
    sync = _sync(drv)
    failed = CudaTicket(Direction.D2H, Part.TARGET_KV, 0, 1, None, error=RuntimeError("enqueue failed"))
    later = CudaTicket(Direction.D2H, Part.TARGET_KV, 1, 1, sync, event=5)
    drv.complete = {5}
    assert later.query() is TicketState.DONE
    assert failed.query() is TicketState.FAILED


@pytest.mark.parametrize("make", [_cuda_tickets, _deferred_tickets], ids=["inline", "deferred"])
def test_waiting_newest_first_synchronizes_once(make) -> None:
    """A step's end waits for an op's tickets newest first (the vLLM worker's verdicts):
    one host synchronisation, the earlier tickets answered from the landed sequence."""
    drv = CountingDriver()
    synced: list[int] = []

    def synchronize(event: int) -> None:
        synced.append(event)
        drv.complete.update(range(1000, event + 1))  # the copy stream ran up to this event

    drv.event_synchronize = synchronize  # type: ignore[attr-defined]
    tickets = make(_sync(drv), Direction.H2D, 16, 1)
    for t in reversed(tickets):
        t.wait()
    assert synced == [1015] and drv.queries == 0
    assert all(t.query() is TicketState.DONE for t in tickets)
