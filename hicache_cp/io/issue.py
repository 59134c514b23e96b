"""DMA descriptors issued off the caller's thread: the scheduler pays for few of them.

The copy engines move scattered pages at the link's speed, but the driver
spends host time per descriptor inside `cuMemcpyBatchAsync` (about half a
microsecond on current GPUs), and on the scheduler thread that time delays the
forward's next launches. An `IssueWorker` takes a layer's descriptors and
issues them on its own thread, in order: a job's layer of at most `whole`
descriptors (default `WHOLE`) in one driver call, a longer one in calls of
`chunk` (default `CHUNK`).

Why calls of `CHUNK`: the driver serialises a context's calls, so while the
worker is inside one, the forward's kernel launches and the scheduler's own
event calls wait for it; and the driver holds a call whose copy queue is full
until the GPU drains it. Long calls reach slightly more of the link but let a
large load keep the forward's launches out for the length of a call; calls of
`CHUNK` keep that wait short at a small cost in link rate. No bound is kept on
the descriptors issued and not yet copied: both bounds tried (on loads and on
backups) exposed more of the copy, not less. docs/design/copy-engines.md has the
measurements and the variants that lost.

Protocol of one job (the caller's side in `hicache_cp.io.dma`): a job is the
layers of one op submitted together (a load's every layer, or one layer of a
backup from the layer hook), with one `done` event per layer.

    caller:  record `order` on its current stream (compute so far), put the job
    worker:  copy stream waits on `order`; then per layer: its descriptors (taken
             from the op's table now, not by the caller), in chunks; record its
             `done` on the copy stream; `issued` counts it (or `error` is set at
             `failed_at`: that layer and every later one fail unissued)

The ticket of layer i is PENDING until `issued > i`; `make_compute_wait`
blocks the host until then (a load's layer is waited on only when the forward
needs it, long after its job was put), then makes the current stream wait on
that layer's `done`. Nothing makes a stream wait on a layer's `done` before that
layer is issued, so the worker can never wait on a stream that waits on it.
Jobs of one direction run in submission order; the caller sends a copy of a
direction to the worker whenever that direction has jobs pending, so the copies
of a stream keep the order they were submitted in.

Complexity: `put` is O(jobs) and never blocks on the driver; the worker spends
O(descriptors / chunk) driver calls a layer.

Process: the prefill server's; one worker thread per engine and direction,
started with the first job, stopped by `close()` (which waits for every job).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: Descriptors per driver call on the worker (see the module docstring).
CHUNK = 128
#: A layer of at most this many descriptors is one driver call: by default every layer
#: goes in calls of CHUNK.
WHOLE = CHUNK
_U64_BYTES = 8


class Job:
    """The layers of one op, issued in order behind one ordering event; see the
    module docstring.

    One object for the op, not one per layer: a load puts every layer of the
    model at once, so per-layer objects, locks and descriptor lookups would cost
    the caller per layer. `issued` counts the layers issued (or
    failed), under the worker's condition, bound when the job is put.
    `descriptors(i)` gives layer i's `io.plans.LayerDescriptors`; the worker calls
    it just before issuing that layer."""

    __slots__ = ("stream", "order", "dones", "descriptors", "issued", "error", "failed_at", "_cond",
                 "_orphans", "_release")  # fmt: skip

    def __init__(
        self, stream: int, order: int, dones: list[int], descriptors: Callable[[int], Any],
        release: Callable[[int], None],
    ) -> None:  # fmt: skip
        if not dones:
            raise ValueError("a job has at least one layer")
        self.stream = stream
        self.order = order
        self.dones = dones  # per layer: recorded on the copy stream after its copies
        self.descriptors: Callable[[int], Any] | None = descriptors  # dropped once every layer is issued
        self.issued = 0
        self.error: BaseException | None = None
        self.failed_at = len(dones)  # the first layer that failed (none: past the end)
        self._cond: threading.Condition | None = None  # the worker's, from `IssueWorker.put`
        self._orphans: set[int] = set()  # layers whose ticket is gone before they were issued
        self._release = release  # gives an event back to the engine's pool

    @property
    def count(self) -> int:
        return len(self.dones)

    def error_of(self, i: int) -> BaseException | None:
        """Why layer i failed (None: it did not, or is not issued yet)."""
        if i < self.failed_at or self.issued <= i:
            return None
        if i == self.failed_at:
            return self.error
        return RuntimeError(f"not issued: layer {self.failed_at} of its op failed first ({self.error})")

    def wait_issued(self, i: int) -> None:
        """Block until the worker issued layer i (or failed it)."""
        if self.issued > i:
            return
        cond = self._cond
        if cond is None:
            raise RuntimeError("a job is waited on before it was put on a worker")
        with cond:
            while self.issued <= i:
                cond.wait()

    def drop(self, i: int) -> None:
        """Layer i's ticket is gone: give its `done` back now, or once issued."""
        cond = self._cond
        if cond is None:  # never put: nothing records `done`
            self._release(self.dones[i])
            return
        with cond:
            if self.issued > i:
                self._release(self.dones[i])
            else:
                self._orphans.add(i)

    def bind(self, cond: threading.Condition) -> None:
        """Put on a worker whose condition signals `issued`."""
        self._cond = cond

    def finish(self, upto: int) -> None:
        """Layers before `upto` issued; the worker holds `_cond`. `order` goes back to
        the pool with the first layer (the stream's wait on it is enqueued; a later
        record does not change it), a layer's `done` too if its ticket is already gone."""
        if self.issued == 0:
            self._release(self.order)
        if self._orphans:
            for i in self._orphans.intersection(range(self.issued, upto)):
                self._release(self.dones[i])
        self.issued = upto
        if upto == self.count:
            self.descriptors = None

    def fail(self, i: int, error: BaseException) -> None:
        """Layer i failed: it and every later layer end unissued (the worker holds `_cond`)."""
        self.error, self.failed_at = error, i
        self.finish(self.count)


class IssueWorker:
    """Issues jobs of one copy stream on its own thread, in order (see the module docstring).

    `drv` is the process's `cudadrv.Driver` (tests pass a double with the same
    four methods); `attrs`/`attr_idx` are the addresses of the batch's
    attribute arrays.
    """

    def __init__(
        self, drv: Any, attrs: int, attr_idx: int, context: Any = None, name: str = "hicache-dma", chunk: int = CHUNK,
        whole: int = WHOLE,
    ) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1 descriptor, got {chunk}")
        self.drv = drv
        self.chunk = chunk
        self.whole = whole
        self._attrs, self._attr_idx = attrs, attr_idx
        self._context = context  # made current on the worker thread (None: leave it)
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._pending = 0  # jobs put and not yet finished
        self._progress = threading.Condition()  # a job issued; `_pending` and every job's `issued` under it
        self._thread: threading.Thread | None = None
        self._name = name

    @property
    def pending(self) -> int:
        """Jobs put and not finished yet (the caller defers while it is > 0)."""
        return self._pending

    def put(self, *jobs: Job) -> None:
        """Queue `jobs`, in order; O(len(jobs)), never blocks on the driver."""
        with self._progress:
            self._pending += len(jobs)
        for job in jobs:
            job.bind(self._progress)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        for job in jobs:
            self._queue.put(job)

    def drain(self) -> None:
        """Block until every job put so far is issued (or failed)."""
        with self._progress:
            while self._pending:
                self._progress.wait()

    def close(self) -> None:
        """Issue what is queued, then stop the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        if self._context is not None:
            self._context()
        while True:
            job = self._queue.get()
            if job is None:
                return
            n = job.count
            for i in range(n):
                try:
                    self._issue(job, i)
                except BaseException as exc:  # noqa: BLE001 - reported through the layers' tickets
                    logger.warning("DMA issue of layer %d of %d (stream %#x) failed: %s", i, n, job.stream, exc)
                    with self._progress:  # later layers may not follow it: the op fails from here on
                        job.fail(i, exc)
                    break
                with self._progress:
                    job.finish(i + 1)
                    if i + 1 < n:
                        self._progress.notify_all()
            with self._progress:
                self._pending -= 1
                self._progress.notify_all()

    def _issue(self, job: Job, i: int) -> None:
        drv, stream = self.drv, job.stream
        if i == 0:
            drv.stream_wait_event(stream, job.order)
        desc = job.descriptors(i)  # type: ignore[misc]
        n = desc.count
        chunk = n if n <= self.whole else self.chunk
        for lo in range(0, n, chunk):
            k = min(chunk, n - lo)
            if k == 1:
                drv.memcpy_async(int(desc.dst[lo]), int(desc.src[lo]), int(desc.sizes[lo]), stream)
            else:
                off = lo * _U64_BYTES
                drv.memcpy_batch_ptrs(
                    desc.dst_ptr + off, desc.src_ptr + off, desc.sizes_ptr + off, k, self._attrs, self._attr_idx, stream
                )
        drv.event_record(job.dones[i], stream)
