"""DMA descriptors issued off the caller's thread: the scheduler pays for few of them.

The copy engines move scattered pages at the link's speed, but the driver
spends about half a microsecond of host time per descriptor inside
`cuMemcpyBatchAsync` (H200: 0.44-0.54 us, tools/dma_probe.py), and about a
microsecond issued inline from the scheduler thread between launches (a layer
of 1024 scattered pages: 0.8-1.0 ms). On the scheduler thread that time
delays the forward's next launches. An `IssueWorker` takes such a layer's
descriptors and issues them on its own thread, in order, in driver calls of
at most `chunk` descriptors (default `CHUNK`).

The chunk is a trade measured on the H200 (bench-io's exposure rows per
variant, bench/results/io-h200-chunks-9ad6efb.json; 24 layers of scattered
41,984 B pages beside a compute-bound forward). The copy engines pay per call,
so longer calls reach more of the link (calls of 64 / 128 / 256 / 1024: 0.93 /
0.96 / 0.97 / 0.98 at 1024 pages). But the driver serialises a context's
calls: while the worker is inside a call, the forward's kernel launches and
the caller's own event calls wait for it (half a microsecond a descriptor).
With calls of 1024 a forward loading 8192 pages a layer lost 0.75 of the copy
time (launches behind 450 us calls) and the caller's median submit was
400-440 us; with calls of 128 the same forward lost 0.069, at 1024 pages
0.050 / 0.094 (load / backup), and both directions at once reached 0.92 of
the bidirectional peak (calls of 64: 0.89, and 0.115 of a 1024-page backup
exposed; calls of 256: 0.59 of an 8192-page load). So `CHUNK` is 128.

Protocol of one job (the caller's side in `hicache_cp.io.dma`):

    caller:  record `order` on its current stream (compute so far), put the job
    worker:  copy stream waits on `order`; the chunks; record `done` on the copy
             stream; then `issued` is set (or `error`, and `issued` is set too)

A ticket of a job is PENDING until `issued`; `make_compute_wait` blocks the
host until then (a load's layer is waited on only when the forward needs it,
long after its job was put), then makes the current stream wait on `done`.
Jobs of one direction run in submission order; the caller sends a copy of a
direction to the worker whenever that direction has jobs pending, so the
copies of a stream keep the order they were submitted in.

Process: the prefill server's; one worker thread per engine and direction,
started with the first job, stopped by `close()` (which waits for every job).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

#: Descriptors per driver call on the worker (about half a microsecond each; see above).
CHUNK = 128
#: Descriptors the worker keeps issued and not yet copied, at most (None: no bound).
WINDOW: int | None = None  # 8 * CHUNK fixed 8192-page loads but was unstable at 1024 (io-h200-window-6ec355a.json)
_U64_BYTES = 8
_POLL_S = 20e-6  # between queries of the oldest call's event while the window is full


class Job:
    """One layer's descriptors waiting to be issued; see the module docstring."""

    __slots__ = ("stream", "order", "done", "desc", "issued", "error", "_lock", "_orphan", "_release")

    def __init__(self, stream: int, order: int, done: int, desc: Any, release: Any) -> None:
        self.stream = stream
        self.order = order
        self.done = done
        self.desc = desc  # io.plans.LayerDescriptors: kept alive until issued
        self.issued = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._orphan = False
        self._release = release  # gives an event back to the engine's pool

    def drop(self) -> None:
        """The job's ticket is gone: give `done` back now, or once issued."""
        with self._lock:
            if self.issued.is_set():
                self._release(self.done)
            else:
                self._orphan = True

    def finish(self, error: BaseException | None) -> None:
        """Issued (or failed): `order` goes back to the pool (the stream's wait on it is
        enqueued; a later record does not change it), `done` too if the ticket is gone."""
        self._release(self.order)
        with self._lock:
            self.error = error
            self.desc = None
            self.issued.set()
            if self._orphan:
                self._release(self.done)


class IssueWorker:
    """Issues jobs of one copy stream on its own thread, in order (see the module docstring).

    `drv` is the process's `cudadrv.Driver` (tests pass a double with the same
    four methods); `attrs`/`attr_idx` are the addresses of the batch's
    attribute arrays.
    """

    def __init__(
        self, drv: Any, attrs: int, attr_idx: int, context: Any = None, name: str = "hicache-dma", chunk: int = CHUNK,
        window: int | None = WINDOW,
    ) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1 descriptor, got {chunk}")
        if window is not None and window < chunk:
            raise ValueError(f"window must be >= chunk ({chunk}) descriptors or None, got {window}")
        self.drv = drv
        self.chunk = chunk
        self.window = window
        # (event recorded after a call, its descriptors), oldest first; the events are the worker's own
        self._in_flight: collections.deque[tuple[int, int]] = collections.deque()
        self._in_flight_count = 0
        self._spare: list[int] = []
        self._attrs, self._attr_idx = attrs, attr_idx
        self._context = context  # made current on the worker thread (None: leave it)
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._pending = 0  # jobs put and not yet finished
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._name = name

    @property
    def pending(self) -> int:
        """Jobs put and not finished yet (the caller defers while it is > 0)."""
        return self._pending

    def put(self, job: Job) -> None:
        """Queue `job`; O(1), never blocks on the driver."""
        with self._lock:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put(job)

    def drain(self) -> None:
        """Block until every job put so far is issued (or failed)."""
        with self._idle:
            while self._pending:
                self._idle.wait()

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
                self._release_window()
                return
            error: BaseException | None = None
            try:
                self._issue(job)
            except BaseException as exc:  # noqa: BLE001 - reported through the job's tickets
                error = exc
                logger.warning("DMA issue of %d descriptors failed: %s", job.desc.count if job.desc else -1, exc)
            job.finish(error)
            with self._idle:
                self._pending -= 1
                if not self._pending:
                    self._idle.notify_all()

    def _issue(self, job: Job) -> None:
        drv, desc, stream = self.drv, job.desc, job.stream
        drv.stream_wait_event(stream, job.order)
        n, chunk = desc.count, self.chunk
        for lo in range(0, n, chunk):
            k = min(chunk, n - lo)
            self._make_room(k)
            if k == 1:
                drv.memcpy_async(int(desc.dst[lo]), int(desc.src[lo]), int(desc.sizes[lo]), stream)
            else:
                off = lo * _U64_BYTES
                drv.memcpy_batch_ptrs(
                    desc.dst_ptr + off, desc.src_ptr + off, desc.sizes_ptr + off, k, self._attrs, self._attr_idx, stream
                )
            self._mark(k, stream)
        drv.event_record(job.done, stream)

    def _make_room(self, k: int) -> None:
        """Block this thread until `k` more descriptors fit the window. Without a bound,
        a forward's loads issued up front (8192 scattered pages x 24 layers on the
        H200) left 0.84-0.99 of the copy exposed; the window of 8 x CHUNK brought it to
        0.056 (io-h200-window-6ec355a.json). Why is not measured: a full copy queue
        blocking the driver call, and with it the forward's launches, is a guess."""
        window = self.window
        while window is not None and self._in_flight and self._in_flight_count + k > window:
            event, count = self._in_flight[0]
            # Polled: with cuEventSynchronize here a 1024-page load was 0.52 exposed
            # (H200, 6ec355a); whether polling avoids that is not measured yet.
            # The copies only wait for work enqueued before them, so this ends.
            while not self.drv.event_query(event):
                time.sleep(_POLL_S)
            self._in_flight.popleft()
            self._in_flight_count -= count
            self._spare.append(event)

    def _mark(self, k: int, stream: int) -> None:
        if self.window is None:
            return
        event = self._spare.pop() if self._spare else self.drv.event_create()
        self.drv.event_record(event, stream)
        self._in_flight.append((event, k))
        self._in_flight_count += k

    def _release_window(self) -> None:
        """Close: the window's events are destroyed once their copies are done."""
        while self._in_flight:
            event, _ = self._in_flight.popleft()
            self.drv.event_synchronize(event)  # closing: nothing else runs beside it
            self._spare.append(event)
        for event in self._spare:
            self.drv.event_destroy(event)
        self._spare.clear()
        self._in_flight_count = 0
