"""What the tickets of one CUDA engine share (`EngineSync`): the driver, the context,
an event pool, and per direction how far its copies are known to have landed.

Process: the prefill server's; the event pool is thread-safe (the issue workers
give events back), the sequence numbers are the submitting thread's.
"""

from __future__ import annotations

import collections

import torch

from hicache_cp.io.base import Direction
from hicache_cp.io.cudadrv import Driver


class EngineSync:
    """What the tickets of one engine share: the driver, the context, the
    device, an event pool, and per direction how far its copies are known to
    have landed.

    Copies of a direction complete in submission order (one copy stream), so
    an event seen complete stands for every copy submitted before it: each
    ticket takes a sequence number of its direction at submission (`sequence`),
    and once any ticket's event is seen complete (`query`, `synchronize`), the queries
    and waits of every earlier ticket answer without a driver call. A poll of an op then
    costs O(log in flight) driver queries (`hicache_cp.ops._CopyOp.reap`), not one
    per layer."""

    def __init__(self, drv: Driver, device_index: int, context: int) -> None:
        self.drv = drv
        self.device_index = device_index
        self.context = context
        self._free: collections.deque[int] = collections.deque()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._raw_stream = raw
        # With one visible device the engine's context is the thread's current one
        # (torch made it so); with several, every entry point makes sure.
        self.guard = torch.cuda.device_count() > 1
        self._sequence = {d: 0 for d in Direction}
        self._landed = {d: 0 for d in Direction}

    def sequence(self, direction: Direction) -> int:
        """The next sequence number of `direction` (one per ticket that owns an event)."""
        self._sequence[direction] += 1
        return self._sequence[direction]

    def query(self, direction: Direction, sequence: int, event: int) -> bool:
        """Whether the copy numbered `sequence`, whose `event` follows it, landed: from
        the landed sequence, else one event query. Raises what the driver raises."""
        if sequence <= self._landed[direction]:
            return True
        if not self.drv.event_query(event):
            return False
        self._landed[direction] = sequence  # and every earlier copy of the direction
        return True

    def synchronize(self, direction: Direction, sequence: int, event: int) -> None:
        """Block until the copy numbered `sequence` landed (no driver call when it is known
        to have). Raises what the driver raises."""
        if sequence <= self._landed[direction]:
            return
        self.drv.event_synchronize(event)
        self._landed[direction] = max(self._landed[direction], sequence)

    def reserve(self, n: int) -> None:
        """Create events until the pool holds `n` (at start-up: a `cuEventCreate` on the
        hot path takes the context's driver lock, which an issue worker may hold)."""
        while len(self._free) < n:
            self._free.append(self.drv.event_create())

    def event(self) -> int:
        """A disable-timing event from the pool (created when the pool is empty)."""
        try:
            return self._free.pop()
        except IndexError:
            return self.drv.event_create()

    def give_back(self, event: int) -> None:
        """Return an event nobody will wait on through it any more (thread-safe)."""
        self._free.append(event)

    def enter(self) -> int:
        """Make the engine's context current on this thread; returns what to restore (0: nothing)."""
        if not self.guard:
            return 0
        current = self.drv.current_context()
        if current == self.context:
            return 0
        self.drv.set_context(self.context)
        return current or -1

    def leave(self, previous: int) -> None:
        if previous:
            self.drv.set_context(previous if previous > 0 else 0)

    def make_current_wait(self, event: int, waiting: int | None) -> int:
        """The caller's current stream waits on `event`, unless it is `waiting` (the stream
        that already waits on it: stream order keeps it waiting). Returns that stream."""
        previous = self.enter()
        try:
            stream = self.current_stream()
            if stream != waiting:
                self.drv.stream_wait_event(stream, event)
            return stream
        finally:
            self.leave(previous)

    def current_stream(self) -> int:
        """The caller's current stream on the engine's device (a CUstream handle)."""
        if self._raw_stream is not None:
            return int(self._raw_stream(self.device_index))
        return int(torch.cuda.current_stream(self.device_index).cuda_stream)

    def close(self) -> None:
        while self._free:
            try:
                self.drv.event_destroy(self._free.pop())
            except Exception:  # noqa: BLE001 - teardown
                pass
