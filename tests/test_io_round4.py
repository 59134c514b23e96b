"""The DMA issue worker's ordering contracts (issue 48, item 6).

CPU (the worker thread and `DeferredTicket` against the recording driver double
of `test_io_issue`): `wait()` on a deferred ticket whose layer the worker has
not issued yet blocks until it is issued, and only then synchronizes on that
layer's `done` event (before, it synchronized on an event nobody had recorded,
which a real driver treats as complete: the wait returned before the copy).

GPU (marked `gpu`, skipped without CUDA; the integrator runs them on the
device): with the real direct backend,
* a small layer-hook layer behind earlier layers the worker still holds, on
  the same copy stream, keeps submission order (it goes to the worker, not
  inline ahead of them): the later copy's bytes are the ones that stay;
* a deferred op whose first layer's driver call fails issues none of its later
  layers, and every ticket is FAILED;
* the worker keeps the op's ordering event until its copy stream waits on it
  (the event is not back in the pool while the worker is held before the wait).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from test_io_issue import RecordingDriver, _desc, _job

from hicache_cp.io.base import Direction, TicketState
from hicache_cp.io.engine_sync import EngineSync
from hicache_cp.io.issue import IssueWorker
from hicache_cp.layout import Part

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def test_wait_on_a_deferred_ticket_blocks_until_its_layer_is_issued() -> None:
    from hicache_cp.io.dma import DeferredTicket

    gate = threading.Event()
    drv = RecordingDriver(gate=gate)  # the worker holds before the job's first call
    drv.event_query = lambda event: False  # type: ignore[attr-defined]

    def synchronize(event: int) -> None:
        with drv.lock:
            drv.calls.append(("synchronize", None, event))

    drv.event_synchronize = synchronize  # type: ignore[attr-defined]
    worker = IssueWorker(drv, attrs=1, attr_idx=2)
    job = _job(3, 10, [20, 21], [_desc(2, 100), _desc(2, 200)], lambda e: None)
    tickets = [DeferredTicket(Direction.H2D, Part.TARGET_KV, i, 8192, EngineSync(drv, 0, 0), job, i)  # type: ignore[arg-type]
               for i in range(2)]  # fmt: skip
    worker.put(job)
    waiter = threading.Thread(target=tickets[1].wait, daemon=True)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "wait() returned before the worker issued its layer"
    gate.set()
    waiter.join(10)
    assert not waiter.is_alive()
    kinds = [(c[0], c[2]) for c in drv.calls]
    assert kinds.index(("record", 21)) < kinds.index(("synchronize", 21)), kinds
    worker.close()


# ---- GPU ------------------------------------------------------------------------------------


class _HeldDriver:
    """A worker's driver, held before its first stream wait until `gate` opens (test double
    around the real driver: every call goes to it)."""

    def __init__(self, drv, gate: threading.Event, fail_batches: int = 0) -> None:  # type: ignore[no-untyped-def]
        self._drv = drv
        self.gate = gate
        self.fail_batches = fail_batches
        self.batches = 0

    def stream_wait_event(self, stream: int, event: int) -> None:
        self.gate.wait(30)
        self._drv.stream_wait_event(stream, event)

    def memcpy_batch_ptrs(self, *args):  # type: ignore[no-untyped-def]
        self.batches += 1
        if self.batches <= self.fail_batches:
            raise RuntimeError("injected: the driver refused the batch")
        return self._drv.memcpy_batch_ptrs(*args)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._drv, name)


@pytest.fixture(scope="module")
def cuda_pools():  # type: ignore[no-untyped-def]
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    from hicache_cp.layout import KVLayout
    from hicache_cp.pools import DevicePool, HostPool

    layout = KVLayout.build(page_size=4, num_layers=2, kv_bytes_per_token=260)  # 1040 B pages, one part
    dev = DevicePool(layout, 600, device="cuda")
    host = HostPool(layout, 600 * layout.bytes_per_page, pin=True)
    host.wait_ready()
    yield layout, dev, host
    host.close()


@gpu
@needs_cuda
def test_a_small_hook_layer_behind_worker_held_layers_keeps_submission_order(cuda_pools) -> None:
    """Layer A (64 scattered pages: the worker's) writes host page h from device page 2;
    then layer B (one page: small enough to be issued in the hook) writes the same host
    page from device page 300. B came second, so B's bytes stay in h."""
    from hicache_cp.io.base import make_engine
    from hicache_cp.io.dma import DeferredTicket

    layout, dev, host = cuda_pools
    engine = make_engine("direct", dev, host, hook_worker_above=16)
    gate = threading.Event()
    engine._workers[0].drv = _HeldDriver(engine._workers[0].drv, gate)
    parts, layer = (Part.TARGET_KV,), 0
    try:
        buf, hv = dev.buffer(Part.TARGET_KV)[0], host.torch_view(Part.TARGET_KV)[0]
        buf[2:200].fill_(0xA1)
        buf[300].fill_(0xB2)
        hv.fill_(0)
        a_dev = np.arange(2, 130, 2, dtype=np.int64)  # 64 pages, none consecutive: 64 runs
        a_host = np.arange(10, 74, dtype=np.int64)
        h = int(a_host[0])
        a = engine.submit_layer(engine.plan(Direction.D2H, a_dev, a_host), parts, layer)
        assert isinstance(a[0], DeferredTicket)  # held at the worker
        b = engine.submit_layer(engine.plan(Direction.D2H, np.array([300]), np.array([h])), parts, layer)
        gate.set()
        a[0].wait()
        b[0].wait()
        assert int(hv[h, 0]) == 0xB2, "the later layer's copy ran first: the earlier one overwrote it"
        assert bool((hv[a_host[1:]] == 0xA1).all())
    finally:
        gate.set()
        engine.close()


@gpu
@needs_cuda
def test_a_deferred_op_whose_first_layer_fails_issues_no_later_layer(cuda_pools) -> None:
    from hicache_cp.io.base import make_engine

    layout, dev, host = cuda_pools
    engine = make_engine("direct", dev, host, worker_above=0)
    held = _HeldDriver(engine._workers[1].drv, threading.Event(), fail_batches=1)
    held.gate.set()
    engine._workers[1].drv = held
    jobs = [((Part.TARGET_KV,), layer) for layer in range(layout.num_target_layers)]
    try:
        buf = dev.buffer(Part.TARGET_KV)
        for b in buf:
            b.fill_(0xCD)
        d_pages, h_pages = np.array([1, 5, 9]), np.array([3, 4, 20])  # 3 runs
        tickets = engine.submit_layers(engine.plan(Direction.H2D, d_pages, h_pages), jobs)
        engine._workers[1].drain()
        assert held.batches == 1, f"{held.batches} driver calls: layers after the failed one were issued"
        assert all(t.query() is TicketState.FAILED for ts in tickets for t in ts)
        torch.cuda.synchronize()
        assert all(bool((b[d_pages] == 0xCD).all()) for b in buf)
    finally:
        engine.close()


@gpu
@needs_cuda
def test_the_worker_keeps_the_ops_ordering_event_until_its_stream_waits(cuda_pools) -> None:
    from hicache_cp.io.base import make_engine

    layout, dev, host = cuda_pools
    engine = make_engine("direct", dev, host, worker_above=0)
    gate = threading.Event()
    engine._workers[1].drv = _HeldDriver(engine._workers[1].drv, gate)
    try:
        tickets = engine.submit_layers(engine.plan(Direction.H2D, np.array([1, 5]), np.array([3, 9])),
                                       [((Part.TARGET_KV,), 0)])  # fmt: skip
        job = tickets[0][0]._job
        assert job.order not in engine._sync._free, "the ordering event went back before the worker's wait"
        gate.set()
        tickets[0][0].wait()
        engine._workers[1].drain()
        assert job.order in engine._sync._free  # given back once the stream's wait was enqueued
    finally:
        gate.set()
        engine.close()
