"""The room state machine and its drain rule, with batches as test doubles.

Asserts: an aborted room refuses chunks at once but releases its pages only
when no batch of it is in flight (after the bounded drain, the reaper's end
of the batch releases it); `release` runs exactly once, only in a final
state; a hypothesis state machine checks the invariants after every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache_cp.errors import IllegalTransition
from hicache_cp.pd.room import Room, RoomFailed, RoomState, RoomTable


@dataclass(eq=False)
class FakeBatch:
    """Stands in for `engine.Batch`: in flight until the test ends it."""

    done: bool = False


class Drainer:
    """`drain(batch, timeout)`: ends the batches it is told to, leaves the rest in flight."""

    def __init__(self) -> None:
        self.ends = True
        self.calls = 0
        self.abandoned: list[FakeBatch] = []

    def drain(self, batch: object, timeout: float) -> bool:
        self.calls += 1
        assert isinstance(batch, FakeBatch)
        if self.ends:
            batch.done = True
        return batch.done

    def abandon(self, batch: object) -> None:
        assert isinstance(batch, FakeBatch)
        self.abandoned.append(batch)


def _table(d: Drainer) -> RoomTable:
    return RoomTable(d.abandon, 30.0, drain=d.drain, drain_s=0.01)


def test_abort_waits_for_in_flight_batches_before_release() -> None:
    d = Drainer()
    table = _table(d)
    released: list[tuple[Room, bool]] = []
    room = table.open(1, 1, 4, release=lambda r: released.append((r, all(b.done for b in r.in_flight))))
    room.transition(RoomState.TRANSFERRING)
    late, landed = FakeBatch(), FakeBatch(done=True)
    room.in_flight += [late, landed]
    d.ends = False  # the batch outlives the drain bound
    assert table.abort(room, "prefill abort") is False
    assert room.state is RoomState.FAILED and room.draining and not room.released
    assert released == [] and d.abandoned == [late]  # handed to the reaper, pages still held
    with pytest.raises(RoomFailed):
        room.require_open()  # no chunk goes in meanwhile
    room.check_invariants()
    assert table.drained() == []
    with pytest.raises(ValueError, match="draining"):
        table.forget(1)
    late.done = True  # the reaper saw it end
    assert table.drained() == [room]
    assert released == [(room, True)] and room.released and not room.draining
    room.check_invariants()
    table.forget(1)


def test_abort_that_drains_in_time_releases_at_once() -> None:
    d = Drainer()
    table = _table(d)
    released: list[Room] = []
    room = table.open(2, 2, 3, release=released.append)
    room.transition(RoomState.TRANSFERRING)
    room.in_flight.append(FakeBatch())
    assert table.abort(room, "timeout") is True
    assert released == [room] and d.calls == 1 and d.abandoned == []
    assert table.abort(room, "again") is True and released == [room]  # once


def test_expired_room_refuses_chunks_without_a_poll() -> None:
    table = RoomTable(timeout_s=5)
    room = table.open(3, 3, 2)
    room.transition(RoomState.TRANSFERRING)
    room.deadline = 0.0  # long past
    with pytest.raises(RoomFailed, match="timeout after 5 s"):
        room.require_open()


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_room_table_refuses_bad_timeouts(bad: float) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        RoomTable(timeout_s=bad)


class RoomMachine(RuleBasedStateMachine):
    """Random opens, batches, landings, aborts (draining or not), successes and polls."""

    def __init__(self) -> None:
        super().__init__()
        self.d = Drainer()
        self.table = _table(self.d)
        self.releases: dict[int, int] = {}
        self.next_id = 0

    def _release(self, room: Room) -> None:
        assert room.state.final and not any(not b.done for b in room.in_flight), "released with a write in flight"
        self.releases[room.room_id] = self.releases.get(room.room_id, 0) + 1

    def _rooms(self, state: RoomState | None = None) -> list[Room]:
        return [r for r in self.table.rooms.values() if state is None or r.state is state]

    @rule(pages=st.integers(1, 8))
    def open(self, pages: int) -> None:
        self.next_id += 1
        room = self.table.open(self.next_id, self.next_id, pages, release=self._release)
        room.transition(RoomState.TRANSFERRING)

    @precondition(lambda self: self._rooms(RoomState.TRANSFERRING))
    @rule(data=st.data())
    def submit(self, data: st.DataObject) -> None:
        room = data.draw(st.sampled_from(self._rooms(RoomState.TRANSFERRING)))
        room.require_open()
        room.in_flight.append(FakeBatch())

    @precondition(lambda self: any(not b.done for r in self._rooms() for b in r.in_flight))
    @rule(data=st.data())
    def land(self, data: st.DataObject) -> None:
        batches = [b for r in self._rooms() for b in r.in_flight if not b.done]
        data.draw(st.sampled_from(batches)).done = True

    @precondition(lambda self: self._rooms())
    @rule(data=st.data(), drains=st.booleans())
    def abort(self, data: st.DataObject, drains: bool) -> None:
        room = data.draw(st.sampled_from(self._rooms()))
        self.d.ends = drains
        self.table.abort(room, "abort")
        assert room.state.final

    @precondition(lambda self: self._rooms(RoomState.TRANSFERRING))
    @rule(data=st.data())
    def succeed(self, data: st.DataObject) -> None:
        room = data.draw(st.sampled_from(self._rooms(RoomState.TRANSFERRING)))
        if any(not b.done for b in room.in_flight):
            return  # finish waits for every batch first
        room.transition(RoomState.SUCCESS)
        with pytest.raises(IllegalTransition):
            room.transition(RoomState.FAILED)

    @rule()
    def drained(self) -> None:
        for room in self.table.drained():
            assert room.released

    @invariant()
    def consistent(self) -> None:
        self.table.check_invariants()
        for room in self._rooms():
            assert self.releases.get(room.room_id, 0) == int(room.released)
            if room.state is RoomState.FAILED:
                with pytest.raises(RoomFailed):
                    room.require_open()


TestRoomMachine = RoomMachine.TestCase
TestRoomMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
