"""The DMA issue worker (`hicache_cp.io.issue`) against a recording driver double (CPU).

The real worker thread runs; only the driver is a test double that records
every call. Checked: each job's calls come in protocol order (the copy stream
waits on the job's `order` event, then per layer every descriptor exactly
once in chunks of at most CHUNK and that layer's `done`), jobs keep their
order, a failing driver call fails that layer and the job's later layers
only (the next job still runs), `order` goes back to the pool after the wait
and a layer's `done` when its ticket is dropped (at once if issued, else
after issue), a waiter on a layer wakes when that layer is issued,
`drain`/`close` wait for every job, and a layer of at most `whole`
descriptors is one call.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hicache_cp.io.issue import CHUNK, WHOLE, IssueWorker, Job
from hicache_cp.io.plans import LayerDescriptors


class RecordingDriver:
    def __init__(self, fail_at: int | None = None, gate: threading.Event | None = None) -> None:
        self.calls: list[tuple] = []
        self.fail_at = fail_at  # fail the batch call whose first descriptor has this dst
        self.gate = gate
        self.lock = threading.Lock()
        self.issued = 0  # descriptors issued

    def stream_wait_event(self, stream: int, event: int) -> None:
        if self.gate is not None:
            self.gate.wait()
        with self.lock:
            self.calls.append(("wait", stream, event))

    def memcpy_batch_ptrs(self, dsts: int, srcs: int, sizes: int, count: int, attrs: int, idx: int, stream: int) -> None:
        d = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint64 * count).from_address(dsts))
        s = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint64 * count).from_address(srcs))
        n = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint64 * count).from_address(sizes))
        if self.fail_at is not None and int(d[0]) == self.fail_at:
            raise RuntimeError("injected batch failure")
        with self.lock:
            self.issued += count
            self.calls.append(("batch", stream, count, d.tolist(), s.tolist(), n.tolist(), attrs, idx))

    def memcpy_async(self, dst: int, src: int, size: int, stream: int) -> None:
        with self.lock:
            self.issued += 1
            self.calls.append(("batch", stream, 1, [dst], [src], [size], None, None))

    def event_record(self, event: int, stream: int) -> None:
        with self.lock:
            self.calls.append(("record", stream, event))


def _desc(n: int, base: int) -> LayerDescriptors:
    dst = np.arange(base, base + n, dtype=np.uint64)
    src = np.arange(base + 10**6, base + 10**6 + n, dtype=np.uint64)
    sizes = np.full(n, 4096, dtype=np.uint64)
    return LayerDescriptors.of(dst, src, sizes)


def _job(stream: int, order: int, dones: list[int], descs: list[LayerDescriptors], release, **kw) -> Job:  # type: ignore[no-untyped-def]
    return Job(stream, order, dones, descs.__getitem__, release, **kw)


@pytest.mark.parametrize("chunk", [CHUNK, 7, 1024])
def test_jobs_issue_in_protocol_order_and_cover_every_descriptor(chunk: int) -> None:
    drv = RecordingDriver()
    released: list[int] = []
    worker = IssueWorker(drv, attrs=111, attr_idx=222, chunk=chunk, whole=chunk)
    sizes = [1, chunk, chunk + 1, 3 * chunk + 5]
    jobs = [_job(7, 100 + i, [200 + i], [_desc(n, 1000 * (i + 1))], released.append) for i, n in enumerate(sizes)]
    for j in jobs:
        worker.put(j)
    worker.drain()
    assert worker.pending == 0 and all(j.issued == 1 and j.error is None for j in jobs)
    calls = [c for c in drv.calls if c[0] in ("wait", "batch", "record")]
    for i, n in enumerate(sizes):
        start = calls.index(("wait", 7, 100 + i))
        end = calls.index(("record", 7, 200 + i))
        batches = calls[start + 1 : end]
        assert all(c[0] == "batch" and c[1] == 7 and c[2] <= chunk for c in batches)
        assert len(batches) == -(-n // chunk)  # as few driver calls as the chunk allows
        dsts = [d for c in batches for d in c[3]]
        srcs = [s for c in batches for s in c[4]]
        assert dsts == list(range(1000 * (i + 1), 1000 * (i + 1) + n))  # every descriptor once, in order
        assert srcs == [d + 10**6 for d in dsts]
        assert all(c[6] in (111, None) for c in batches)
        if i:
            assert start > calls.index(("record", 7, 200 + i - 1)), "jobs keep their order"
    assert sorted(released) == [100, 101, 102, 103]  # every order event back; done events still held
    assert all(j.descriptors is None for j in jobs)  # the op's table is let go once issued
    for j in jobs:
        j.drop(0)  # issued: done goes back at once
    assert sorted(released) == [100, 101, 102, 103, 200, 201, 202, 203]
    worker.close()


def test_a_chunk_below_one_descriptor_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        IssueWorker(RecordingDriver(), attrs=1, attr_idx=2, chunk=0)


@pytest.mark.parametrize(("n", "calls"), [(1, 1), (WHOLE, 1), (WHOLE + 1, -(-(WHOLE + 1) // CHUNK)), (1000, 8)])
def test_a_layer_up_to_whole_is_one_call_a_longer_one_goes_in_chunks(n: int, calls: int) -> None:
    """The default sizes: one call for a layer of up to WHOLE descriptors, calls of CHUNK
    beyond (the forward's launches wait behind a call; `io.issue` says why WHOLE is CHUNK)."""
    drv = RecordingDriver()
    worker = IssueWorker(drv, attrs=1, attr_idx=2)
    worker.put(_job(7, 1, [2], [_desc(n, 1000)], lambda e: None))
    worker.close()
    batches = [c for c in drv.calls if c[0] == "batch"]
    assert len(batches) == calls and drv.issued == n
    assert all(c[2] == (n if n <= WHOLE else min(CHUNK, n - i * CHUNK)) for i, c in enumerate(batches))


def test_the_layers_of_one_op_share_one_ordering_wait() -> None:
    """An op's layers submitted together are one job: `order` is waited on once, then
    every layer's descriptors and its own `done` in order; `order` goes back once."""
    drv = RecordingDriver()
    released: list[int] = []
    worker = IssueWorker(drv, attrs=1, attr_idx=2)
    job = _job(9, 50, [60, 61, 62, 63], [_desc(3, 1000), *(_desc(2, 2000 + 100 * i) for i in range(3))], released.append)
    worker.put(job)
    worker.close()
    kinds = [(c[0], c[2]) for c in drv.calls]
    assert kinds == [("wait", 50), ("batch", 3), ("record", 60), ("batch", 2), ("record", 61),
                     ("batch", 2), ("record", 62), ("batch", 2), ("record", 63)]  # fmt: skip
    assert released == [50] and job.issued == 4 and all(job.error_of(i) is None for i in range(4))


@pytest.mark.parametrize("failing", [0, 2])
def test_a_failed_layer_fails_it_and_every_later_layer_unissued_the_next_job_runs(
    failing: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing after a failed layer is issued (the first layer's failure may leave the
    stream not waiting for compute); earlier layers stand. The failure is one WARNING,
    not one per layer, and the next op runs."""
    drv = RecordingDriver(fail_at=5000 + 10 * failing)
    released: list[int] = []
    worker = IssueWorker(drv, attrs=1, attr_idx=2)
    job = _job(3, 10, [20, 21, 22, 23], [_desc(4, 5000 + 10 * i) for i in range(4)], released.append)
    other = _job(3, 11, [29], [_desc(4, 7000)], released.append)
    with caplog.at_level("DEBUG", logger="hicache_cp.io.issue"):
        worker.put(job, other)
        worker.close()
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert job.issued == 4 and job.failed_at == failing
    assert [job.error_of(i) is None for i in range(4)] == [i < failing for i in range(4)]
    assert isinstance(job.error_of(failing), RuntimeError) and "injected" in str(job.error_of(failing))
    assert all(f"layer {failing} of its op failed" in str(job.error_of(i)) for i in range(failing + 1, 4))
    issued = {c[3][0] for c in drv.calls if c[0] == "batch"}
    assert issued == {5000 + 10 * i for i in range(failing)} | {7000}
    assert [c[2] for c in drv.calls if c[0] == "record"] == [20 + i for i in range(failing)] + [29]
    assert released == [10, 11]  # both order events back
    for i in range(4):
        job.drop(i)  # failed or not, every layer is finished: done goes back at once
    assert sorted(released) == [10, 11, 20, 21, 22, 23]


def test_a_ticket_dropped_before_issue_gives_done_back_after_it() -> None:
    gate = threading.Event()
    drv = RecordingDriver(gate=gate)
    released: list[int] = []
    worker = IssueWorker(drv, attrs=1, attr_idx=2)
    job = _job(5, 30, [40, 41], [_desc(2, 100), _desc(2, 200)], released.append)
    worker.put(job)
    assert worker.pending == 1
    job.drop(1)  # the worker is held at the wait: not issued yet
    assert 41 not in released and job.issued == 0
    gate.set()
    worker.close()  # issues what is queued, then stops
    assert job.issued == 2 and ("record", 5, 41) in drv.calls
    assert sorted(released) == [30, 41]  # layer 0's ticket still lives: its done is held
    job.drop(0)
    assert sorted(released) == [30, 40, 41]
    assert worker.pending == 0


def test_a_waiter_blocks_until_its_own_layer_is_issued_not_the_whole_op() -> None:
    """A forward waits on layer 0 of a load while later layers are still queued:
    `wait_issued(0)` returns once that layer is issued, with the next one held."""
    gate, second = threading.Event(), threading.Event()
    drv = RecordingDriver()
    worker = IssueWorker(drv, attrs=1, attr_idx=2)
    job = _job(4, 10, [20, 21], [_desc(2, 100), _desc(2, 200)], lambda e: None)
    batch = drv.memcpy_batch_ptrs

    def hold_the_second_layer(dsts: int, *args: int) -> None:
        if int(np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint64 * 1).from_address(dsts))[0]) == 200:
            second.set()
            gate.wait()
        batch(dsts, *args)

    drv.memcpy_batch_ptrs = hold_the_second_layer  # type: ignore[method-assign]
    woke: list[int] = []
    waiter = threading.Thread(target=lambda: (job.wait_issued(0), woke.append(job.issued)), daemon=True)
    worker.put(job)
    waiter.start()
    try:
        assert second.wait(5)  # the worker holds the second layer
        waiter.join(5)
        assert woke == [1] and job.issued == 1
    finally:
        gate.set()
    job.wait_issued(1)
    assert job.issued == 2
    worker.drain()
    assert worker.pending == 0
    worker.close()


def test_a_job_never_put_gives_done_back_when_dropped_and_refuses_a_wait() -> None:
    released: list[int] = []
    job = _job(1, 2, [3, 4], [_desc(1, 10), _desc(1, 20)], released.append)
    with pytest.raises(RuntimeError, match="before it was put"):
        job.wait_issued(0)
    job.drop(1)
    assert released == [4]


def test_a_job_has_at_least_one_layer() -> None:
    with pytest.raises(ValueError, match="at least one layer"):
        _job(1, 2, [], [], lambda e: None)


def test_a_deferred_ticket_follows_its_own_layer_of_the_job() -> None:
    """`io.dma.DeferredTicket`, the cache's view of one layer of a job (CPU, driver
    double): PENDING until its layer is issued, then its own `done` event's state;
    a layer failed at issue, and every later one, is FAILED and `wait` raises
    CopyFailed naming the layer; a dropped ticket gives its own `done` back."""
    import gc

    from hicache_cp.io.base import CopyFailed, Direction, TicketState
    from hicache_cp.io.engine_sync import EngineSync
    from hicache_cp.io.dma import DeferredTicket
    from hicache_cp.layout import Part

    gate = threading.Event()
    drv = RecordingDriver(fail_at=5020, gate=gate)
    landed: set[int] = {20}  # the done events the "GPU" has passed
    drv.event_query = lambda event: event in landed  # type: ignore[attr-defined]
    drv.event_synchronize = lambda event: landed.add(event)  # type: ignore[attr-defined]
    sync = EngineSync(drv, 0, 0)  # type: ignore[arg-type]
    released: list[int] = []
    worker = IssueWorker(drv, attrs=1, attr_idx=2)
    job = _job(3, 10, [20, 21, 22, 23], [_desc(2, 5000 + 10 * i) for i in range(4)], released.append)
    tickets = [DeferredTicket(Direction.H2D, Part.TARGET_KV, layer, 8192, sync, job, i)  # type: ignore[arg-type]
               for i, layer in enumerate((0, 1, 2, 3))]  # fmt: skip
    worker.put(job)
    assert [t.query() for t in tickets] == [TicketState.PENDING] * 4  # the worker is held at the wait
    gate.set()
    worker.drain()
    assert [t.query() for t in tickets] == [TicketState.DONE, TicketState.PENDING, TicketState.FAILED, TicketState.FAILED]
    tickets[1].wait()  # synchronizes on layer 1's own event
    assert landed == {20, 21} and tickets[1].query() is TicketState.DONE
    for t in tickets[2:]:
        with pytest.raises(CopyFailed, match=f"layer {t.layer} failed"):
            t.wait()
    assert "injected" in str(tickets[2].error) and "layer 2 of its op failed" in str(tickets[3].error)
    del tickets[1]
    gc.collect()
    assert released == [10, 21]  # order, then the dropped layer's own done
    worker.close()
