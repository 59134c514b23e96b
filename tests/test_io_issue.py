"""The DMA issue worker (`hicache_cp.io.issue`) against a recording driver double (CPU).

The real worker thread runs; only the driver is a test double that records
every call. Checked: each job's calls come in protocol order (the copy stream
waits on the job's `order` event, then every descriptor exactly once in
chunks of at most CHUNK, then `done` is recorded), jobs keep their order, a
failing driver call fails that job only (its `issued` is set, the next job
still runs), `order` goes back to the pool after the wait and `done` when the
ticket is dropped (at once if issued, else after issue), `drain`/`close`
wait for every job, and a job of at most `whole` descriptors is one call.
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


@pytest.mark.parametrize("chunk", [CHUNK, 7, 1024])
def test_jobs_issue_in_protocol_order_and_cover_every_descriptor(chunk: int) -> None:
    drv = RecordingDriver()
    released: list[int] = []
    worker = IssueWorker(drv, attrs=111, attr_idx=222, chunk=chunk, whole=chunk)
    sizes = [1, chunk, chunk + 1, 3 * chunk + 5]
    jobs = [Job(7, 100 + i, 200 + i, _desc(n, 1000 * (i + 1)), released.append) for i, n in enumerate(sizes)]
    for j in jobs:
        worker.put(j)
    worker.drain()
    assert worker.pending == 0 and all(j.issued and j.error is None for j in jobs)
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
    for j in jobs:
        j.drop()  # issued: done goes back at once
    assert sorted(released) == [100, 101, 102, 103, 200, 201, 202, 203]
    worker.close()


def test_a_chunk_below_one_descriptor_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        IssueWorker(RecordingDriver(), attrs=1, attr_idx=2, chunk=0)


@pytest.mark.parametrize(("n", "calls"), [(1, 1), (WHOLE, 1), (WHOLE + 1, -(-(WHOLE + 1) // CHUNK)), (1000, 8)])
def test_a_job_up_to_whole_is_one_call_a_longer_one_goes_in_chunks(n: int, calls: int) -> None:
    """The default sizes: one call for a layer of up to WHOLE descriptors, calls of CHUNK
    beyond (the forward's launches wait behind a call; `io.issue` says why WHOLE is CHUNK)."""
    drv = RecordingDriver()
    worker = IssueWorker(drv, attrs=1, attr_idx=2)
    worker.put(Job(7, 1, 2, _desc(n, 1000), lambda e: None))
    worker.close()
    batches = [c for c in drv.calls if c[0] == "batch"]
    assert len(batches) == calls and drv.issued == n
    assert all(c[2] == (n if n <= WHOLE else min(CHUNK, n - i * CHUNK)) for i, c in enumerate(batches))


def test_a_failing_job_fails_alone() -> None:
    drv = RecordingDriver(fail_at=5000)
    released: list[int] = []
    worker = IssueWorker(drv, attrs=1, attr_idx=2)
    bad, good = Job(3, 10, 20, _desc(CHUNK + 2, 5000), released.append), Job(3, 11, 21, _desc(4, 9000), released.append)
    worker.put(bad)
    worker.put(good)
    worker.drain()
    assert bad.issued and isinstance(bad.error, RuntimeError)
    assert good.issued and good.error is None
    assert ("record", 3, 21) in drv.calls and ("record", 3, 20) not in drv.calls
    assert 10 in released and 11 in released
    worker.close()


def test_a_ticket_dropped_before_issue_gives_done_back_after_it() -> None:
    gate = threading.Event()
    drv = RecordingDriver(gate=gate)
    released: list[int] = []
    worker = IssueWorker(drv, attrs=1, attr_idx=2)
    job = Job(5, 30, 40, _desc(2, 100), released.append)
    worker.put(job)
    assert worker.pending == 1
    job.drop()  # the worker is held at the wait: not issued yet
    assert 40 not in released and not job.issued
    gate.set()
    worker.close()  # issues what is queued, then stops
    assert job.issued and ("record", 5, 40) in drv.calls
    assert sorted(released) == [30, 40]
    assert worker.pending == 0


def test_a_waiter_blocks_until_its_own_job_is_issued_not_the_whole_op() -> None:
    """A forward waits on layer 0 of a load while later layers are still queued:
    `wait_issued` returns once that job is issued, with the next one held."""
    gate, second = threading.Event(), threading.Event()
    drv = RecordingDriver()
    worker = IssueWorker(drv, attrs=1, attr_idx=2)
    first = Job(4, 10, 20, _desc(2, 100), lambda e: None)
    later = Job(4, 11, 21, _desc(2, 200), lambda e: None)
    held_at = drv.stream_wait_event

    def wait_then_hold(stream: int, event: int) -> None:  # the second job's wait blocks the worker
        held_at(stream, event)
        if event == 11:
            second.set()
            gate.wait()

    drv.stream_wait_event = wait_then_hold  # type: ignore[method-assign]
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: (first.wait_issued(), woke.append(later.issued)))
    worker.put(first, later)
    waiter.start()
    assert second.wait(5)  # the worker holds the later job
    waiter.join(5)
    assert woke == [False] and first.issued and not later.issued
    gate.set()
    later.wait_issued()
    assert later.issued and worker.pending == 0
    worker.close()


def test_a_job_never_put_gives_done_back_when_dropped_and_refuses_a_wait() -> None:
    released: list[int] = []
    job = Job(1, 2, 3, _desc(1, 10), released.append)
    with pytest.raises(RuntimeError, match="before it was put"):
        job.wait_issued()
    job.drop()
    assert released == [3]


def test_the_layers_of_one_op_share_one_ordering_wait() -> None:
    """An op's layers submitted together: the leader's `order` is waited on once,
    then every layer's descriptors and `done` in order; only the leader gives an
    ordering event back."""
    drv = RecordingDriver()
    released: list[int] = []
    worker = IssueWorker(drv, attrs=1, attr_idx=2)
    leader = Job(9, 50, 60, _desc(3, 1000), released.append)
    followers = [Job(9, None, 61 + i, _desc(2, 2000 + 100 * i), released.append, leader) for i in range(3)]
    worker.put(leader, *followers)
    worker.close()
    kinds = [(c[0], c[2]) for c in drv.calls]
    assert kinds == [("wait", 50), ("batch", 3), ("record", 60), ("batch", 2), ("record", 61),
                     ("batch", 2), ("record", 62), ("batch", 2), ("record", 63)]  # fmt: skip
    assert released == [50] and all(j.issued and j.error is None for j in [leader, *followers])


def test_the_followers_of_a_failed_leader_fail_unissued(caplog: pytest.LogCaptureFixture) -> None:
    """A leader that failed may not have made the stream wait for compute: its
    followers are not issued (they fail, naming it); the next op runs. The
    failure is one WARNING, not one per layer."""
    drv = RecordingDriver(fail_at=5000)
    worker = IssueWorker(drv, attrs=1, attr_idx=2)
    leader = Job(3, 10, 20, _desc(4, 5000), lambda e: None)
    followers = [Job(3, None, 21 + i, _desc(4, 6000 + 10 * i), lambda e: None, leader) for i in range(3)]
    other = Job(3, 11, 29, _desc(4, 7000), lambda e: None)
    with caplog.at_level("DEBUG", logger="hicache_cp.io.issue"):
        worker.put(leader, *followers, other)
        worker.close()
    assert [r.levelname for r in caplog.records if r.levelname != "DEBUG"] == ["WARNING"]
    assert isinstance(leader.error, RuntimeError) and all("first layer failed" in str(f.error) for f in followers)
    assert not any(c[0] == "batch" and 6000 <= c[3][0] < 7000 for c in drv.calls)
    assert other.error is None and ("record", 3, 29) in drv.calls


def test_a_job_carries_its_order_or_names_a_leader() -> None:
    leader = Job(1, 2, 3, _desc(1, 10), lambda e: None)
    with pytest.raises(ValueError, match="not both"):
        Job(1, 2, 4, _desc(1, 20), lambda e: None, leader)
    with pytest.raises(ValueError, match="not both"):
        Job(1, None, 4, _desc(1, 20), lambda e: None)


def test_a_job_whose_worker_records_its_order_records_it_on_the_callers_stream_first() -> None:
    """The layer hook's job (`hook_order` "worker"): the worker records `order` on the
    caller's stream, then its copy stream waits on it, then the copy; a job the caller
    ordered makes no record of `order`. A follower cannot ask the worker to record."""
    drv = RecordingDriver()
    released: list[int] = []
    worker = IssueWorker(drv, attrs=1, attr_idx=2)
    worker.put(Job(9, 50, 60, _desc(3, 1000), released.append, record_on=77), Job(9, 51, 61, _desc(1, 2000), released.append))
    worker.close()
    assert [(c[0], c[1], c[2]) for c in drv.calls] == [
        ("record", 77, 50), ("wait", 9, 50), ("batch", 9, 3), ("record", 9, 60),
        ("wait", 9, 51), ("batch", 9, 1), ("record", 9, 61),
    ]  # fmt: skip
    assert released == [50, 51]
    leader = Job(9, 52, 62, _desc(1, 10), released.append)
    with pytest.raises(ValueError, match="only a job that carries its ordering event"):
        Job(9, None, 63, _desc(1, 10), released.append, leader, record_on=77)
