"""DMA-only io backends: the GPU's copy engines move every byte (`direct`; `staging`).

`direct`, the default on CUDA, turns one layer's copy into one descriptor per
run of pages consecutive on both sides (`runs.dma_plan`) and hands them to the
driver in `cuMemcpyBatchAsync` calls (numpy arrays through ctypes, no Python
object per page). The copy engines take no SMs from the forward. The driver
spends host time per descriptor, so a copy costs O(runs) on whichever thread
issues it: cheap for the few runs the contiguous-preferring allocators make,
a fraction of a millisecond a layer for a thousand scattered pages.

A layer of more than `WORKER_ABOVE` descriptors is issued by a worker thread
(`io.issue`, which states its driver-call sizes), so the caller pays for one
event record, not for the descriptors; a load's layers go to the worker as one
job, and the layer hook hands it every backup layer (`HOOK_WORKER_ABOVE`).
Descriptors are issued sorted by device page (a stable sort, skipped when the
pages already ascend).

`staging` gathers scattered device pages into a bounded device buffer with
torch and moves each run of consecutive host pages with one DMA. It is a
benchmark variant, not a product setting (see `StagingCopyEngine`).

docs/design/copy-engines.md records the measurements behind these choices.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from hicache_cp.io.base import CopyFailed, CopyPlan, CopyTicket, Direction, TicketState, register_backend
from hicache_cp.io.cuda import CudaCopyEngine, CudaTicket, PartInfo, SharedTicket, with_shared
from hicache_cp.io.engine_sync import EngineSync
from hicache_cp.io.cudadrv import DmaIssuer
from hicache_cp.io.issue import CHUNK, WHOLE, IssueWorker, Job
from hicache_cp.io.plans import LayerDescriptors
from hicache_cp.layout import Part
from hicache_cp.io.runs import runs_of, split_at_chunks
from hicache_cp.pools import DevicePool, HostPool

logger = logging.getLogger(__name__)

#: Descriptors of one layer above which the direct backend issues them on its worker thread
#: (`io.issue`) instead of the caller's: below it the driver work inline is smaller than the
#: hand-off to the worker.
WORKER_ABOVE = 16
#: The layer hook's own threshold (`hook_worker_above`): 0, every backup layer goes to the
#: worker, so the hook pays one event record whatever the layer's runs.
HOOK_WORKER_ABOVE = 0
#: Descriptors in all of a backup's run of layers from the layer hook (`submit_layers`) at
#: most which the caller issues itself as one driver call, when the table holds the run's
#: layers as consecutive rows and the D2H worker is idle (`hook_span_inline`): a handful of
#: driver calls for the whole run, no hand-off to the worker thread. 0, the default until
#: it is measured beside a forward on a GPU (docs/design/copy-engines.md): every run goes
#: to the worker.
HOOK_SPAN_INLINE = 0
#: Default device staging buffer of the staging backend, per direction.
DEFAULT_STAGING_BYTES = 64 << 20


class DeferredTicket(CopyTicket):
    """Ticket of layer `index` of a job issued by an `IssueWorker`: PENDING until the
    worker has issued that layer, then its `done` event's state (see `hicache_cp.io.issue`)."""

    def __init__(
        self, direction: Direction, part: Part, layer: int, nbytes: int, sync: EngineSync, job: Job, index: int
    ) -> None:
        super().__init__(direction, part, layer, nbytes)
        self._sync = sync
        self._job = job
        self._index = index
        self._waiting: int | None = None  # the stream last made to wait on this layer (as `CudaTicket`'s)
        self._done = False
        self._error: BaseException | None = None
        self._sequence = sync.sequence(direction)  # `EngineSync`: a later landed copy stands for this one

    def query(self) -> TicketState:
        if self._error is None and not self._done:
            job, i = self._job, self._index
            if job.issued <= i:
                return TicketState.PENDING
            self._error = job.error_of(i)
            if self._error is None:
                try:
                    self._done = self._sync.query(self.direction, self._sequence, job.dones[i])
                except Exception as exc:  # noqa: BLE001 - an async CUDA fault surfaces here
                    self._error = exc
        if self._error is not None:
            return TicketState.FAILED
        return TicketState.DONE if self._done else TicketState.PENDING

    def wait(self) -> None:
        job, i = self._job, self._index
        job.wait_issued(i)
        self._error = self._error or job.error_of(i)
        if self._error is None and not self._done:
            try:
                self._sync.synchronize(self.direction, self._sequence, job.dones[i])
                self._done = True
            except Exception as exc:  # noqa: BLE001
                self._error = exc
        if self._error is not None:
            raise CopyFailed(f"{self.describe()} failed: {self._error}") from self._error

    def make_compute_wait(self) -> None:
        """Blocks the host until the worker issued this layer (loads are issued long
        before the forward needs them), then the current stream waits on it, once per
        stream (as `CudaTicket`)."""
        job, i = self._job, self._index
        job.wait_issued(i)
        error = self._error or job.error_of(i)
        if error is not None:
            raise CopyFailed(f"{self.describe()} failed: {error}") from error
        if self._done:
            return
        self._waiting = self._sync.make_current_wait(job.dones[i], self._waiting)

    @property
    def error(self) -> BaseException | None:
        return self._error or self._job.error_of(self._index)

    def __del__(self) -> None:
        self._job.drop(self._index)


@register_backend("direct")
class DirectCopyEngine(CudaCopyEngine):
    """One DMA per run of pages consecutive on both sides; see the module docstring.

    Options, each one the benchmarks still measure against the default
    (`hicache_harness.bench.io_variants`): a planned layer of more than
    `worker_above` descriptors is issued by a worker thread (`io.issue`; None:
    always on the caller's thread); the worker issues a layer of at most `whole`
    descriptors (`load_whole` for loads, when given) in one driver call, a longer
    one in calls of `chunk`; `hook_worker_above` is the layer hook's threshold
    (`submit_layer`), `hook_span_inline` its bound for a run of layers issued by
    the caller in one driver call (`submit_layers`). Planned ops (`plan` +
    `submit_layer`, the cache's path) sort by device page once and reuse one
    descriptor table for every layer: the parts of a layer in one call. Without
    the driver's batch call (`Driver.has_batch`) every run is its own
    cuMemcpyAsync and nothing goes to the worker.
    """

    name = "direct"

    def __init__(
        self, device_pool: DevicePool, host_pool: HostPool, *, worker_above: int | None = WORKER_ABOVE,
        chunk: int = CHUNK, whole: int = WHOLE, load_whole: int | None = None, hook_worker_above: int = HOOK_WORKER_ABOVE,
        hook_span_inline: int = HOOK_SPAN_INLINE,
    ) -> None:
        super().__init__(device_pool, host_pool)
        if worker_above is not None and worker_above < 0:
            raise ValueError(f"worker_above must be >= 0 or None, got {worker_above}")
        if hook_worker_above < 0:
            raise ValueError(f"hook_worker_above must be >= 0, got {hook_worker_above}")
        if hook_span_inline < 0:
            raise ValueError(f"hook_span_inline must be >= 0, got {hook_span_inline}")
        self.hook_span_inline = hook_span_inline
        self._issuer = DmaIssuer(self._drv)
        self.worker_above = worker_above if self._issuer.batch else None
        self.hook_worker_above = hook_worker_above
        context = self._sync.context
        self.chunks = {Direction.D2H: chunk, Direction.H2D: chunk}
        self.wholes = {Direction.D2H: whole, Direction.H2D: whole if load_whole is None else load_whole}
        self._workers = tuple(
            IssueWorker(self._drv, self._issuer.attrs_ptr, self._issuer.attr_idx_ptr,
                        lambda: self._drv.set_context(context), name=f"hicache-dma-{d.value}",
                        chunk=self.chunks[d], whole=self.wholes[d])
            for d in (Direction.D2H, Direction.H2D)
        )
        #: Layer submissions handed to the issue workers (benchmarks read it).
        self.counts = {"deferred": 0}

    def _layer(self, plan: CopyPlan, parts: tuple[Part, ...], layer: int) -> list[CopyTicket | None]:
        """The layer hook's path (a backup's layer). A layer of at most `hook_worker_above`
        descriptors (runs x parts; default none) is issued here while the D2H worker is
        idle: the hook pays for its driver calls and the descriptors. Others go to the
        `IssueWorker`: the hook pays for one driver call, recording the compute-ordering
        event the worker's copy stream waits on."""
        if not plan.num_pages or self.worker_above is None:
            return super()._layer(plan, parts, layer)
        if len(plan.prepared.runs) * len(parts) <= self.hook_worker_above and not self._worker(plan).pending:
            return super()._layer(plan, parts, layer)
        return self._defer(plan, [(parts, layer)])[0]

    def _layers(self, plan: CopyPlan, jobs: list[tuple[tuple[Part, ...], int]]) -> list[list[CopyTicket | None]]:
        """Several layers of one op (a load's every layer; a backup's run of layers from
        the layer hook, or every layer). A backup's run of at most `hook_span_inline`
        descriptors in all whose table rows are consecutive is issued here as one driver
        call (`_issue_span`) while the D2H worker is idle; otherwise it goes to the worker
        as one job beyond `hook_worker_above` descriptors (no one waits for its first layer). A
        load's, behind one ordering event: the worker takes every layer when one layer
        is large or the worker is busy (a call per layer would wait for the worker's
        call in flight each time), and every layer but the first when the op is large
        only in all: the first is issued here at once (the forward needs it first; the
        worker would start it a thread hand-off later), the rest as one job: an event
        and a ticket per part a layer here instead of two driver calls (a
        DeepSeek-V3.2 load, 62 layers of 1-3 runs, cost 1.1-1.5 ms inline). Small
        ops are issued here whole."""
        if not (plan.num_pages and self.worker_above is not None and jobs):
            return super()._layers(plan, jobs)
        per_layer = len(plan.prepared.runs) * max(len(parts) for parts, _ in jobs)
        if plan.direction is Direction.D2H:
            idle = not self._worker(plan).pending
            if idle and per_layer * len(jobs) <= self.hook_span_inline:
                span = plan.prepared.span(jobs)
                if span is not None:
                    return self._issue_span(plan, jobs, span)
            if per_layer * len(jobs) <= self.hook_worker_above and idle:
                return super()._layers(plan, jobs)
            return self._defer(plan, jobs)
        if self._worker(plan).pending or per_layer > self.worker_above:
            return self._defer(plan, jobs)
        if len(jobs) > 1 and per_layer * len(jobs) > self.worker_above:
            first = super()._layers(plan, jobs[:1])
            error = first[0][0].error if first[0][0] is not None else None
            if error is not None:  # as inline: nothing after a failed layer is issued
                return first + self._failed(plan, jobs[1:], error)
            return first + self._defer(plan, jobs[1:])
        return super()._layers(plan, jobs)

    def _issue_span(
        self, plan: CopyPlan, jobs: list[tuple[tuple[Part, ...], int]], span: LayerDescriptors
    ) -> list[list[CopyTicket | None]]:
        """A backup's run of layers here, as one: the copy stream follows the caller's, one
        driver call for every layer's descriptors (`span`), one event; every layer's
        tickets complete with it. A failure fails them all (nothing was enqueued)."""
        sync, info, n = self._sync, self._info, plan.num_pages
        previous = sync.enter()
        try:
            if self._keep:
                self._prune()
            event = sync.event()
            try:
                stream = self._follow_compute(0)
                self._issuer.issue_table_row(span, stream)
                self._drv.event_record(event, stream)
            except Exception as exc:  # noqa: BLE001 - the submit boundary: FAILED tickets
                sync.give_back(event)
                logger.warning("d2h layers %d-%d (%d pages): submission failed: %s", jobs[0][1], jobs[-1][1], n, exc,
                               exc_info=True)  # fmt: skip
                return self._failed(plan, jobs, exc)
        finally:
            sync.leave(previous)
        last_parts, last = jobs[-1]
        primary = CudaTicket(Direction.D2H, last_parts[0], last, n * info[last_parts[0]].page_bytes, sync, event)
        return [[SharedTicket(primary, part, n * info[part].page_bytes, layer) for part in parts] for parts, layer in jobs]

    def _worker(self, plan: CopyPlan) -> IssueWorker:
        return self._workers[0 if plan.direction is Direction.D2H else 1]

    def _defer(self, plan: CopyPlan, jobs: list[tuple[tuple[Part, ...], int]]) -> list[list[CopyTicket | None]]:
        """Hand `jobs` (layers of `plan`) to the direction's worker as one `Job`: one
        `order` event recorded on the current stream, one `done` event per layer; the
        worker takes each layer's descriptors from the plan's table."""
        n, sync, direction, info = plan.num_pages, self._sync, plan.direction, self._info
        handle = self._handle[0 if direction is Direction.D2H else 1]
        table, layers = plan.prepared, tuple(jobs)
        previous = sync.enter()
        try:
            order = sync.event()
            try:
                self._drv.event_record(order, sync.current_stream())
            except Exception as exc:  # noqa: BLE001 - the submit boundary
                sync.give_back(order)
                return self._failed(plan, jobs, exc)
            dones = [sync.event() for _ in layers]
        finally:
            sync.leave(previous)
        job = Job(handle, order, dones, lambda i: table.get(*layers[i]), sync.give_back)
        out = [
            with_shared(DeferredTicket(direction, parts[0], layer, n * info[parts[0]].page_bytes, sync, job, i), parts, n, info)
            for i, (parts, layer) in enumerate(layers)
        ]
        self._worker(plan).put(job)
        self.counts["deferred"] += len(layers)
        return out

    def _failed(
        self, plan: CopyPlan, jobs: list[tuple[tuple[Part, ...], int]], error: BaseException
    ) -> list[list[CopyTicket | None]]:
        """FAILED tickets for `jobs`, none of them issued."""
        n = plan.num_pages
        return [[CudaTicket(plan.direction, p, layer, n * self._info[p].page_bytes, None, error=error) for p in parts]
                for parts, layer in jobs]  # fmt: skip

    def close(self) -> None:
        for worker in self._workers:
            worker.close()
        super().close()

    def _prepare_backend(self, plan: CopyPlan) -> None:
        """Sort by device page, then tabulate every layer's descriptors (`io.plans`)."""
        plan.device_pages, plan.host_pages = _by_device(plan.device_pages, plan.host_pages)
        plan.prepared = self.descriptor_table(plan)

    def _enqueue_layer(self, plan, parts, infos, layer, stream, keep) -> None:  # type: ignore[no-untyped-def]
        self._issuer.issue_table_row(plan.prepared.get(parts, layer), stream)

    @property
    def batch(self) -> bool:
        return self._issuer.batch

    def _enqueue(self, d2h, info, slot, device_pages, host_pages, stream, keep) -> None:  # type: ignore[no-untyped-def]
        device_pages, host_pages = _by_device(device_pages, host_pages)
        self._dma(d2h, info, slot, device_pages, host_pages, stream)


def _by_device(device_pages: np.ndarray, host_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pairs sorted by device page (stable), or as given when already ascending
    (the common case: one comparison, no sort)."""
    if len(device_pages) < 2 or (device_pages[1:] > device_pages[:-1]).all():
        return device_pages, host_pages
    by_device = np.argsort(device_pages, kind="stable")
    return device_pages[by_device], host_pages[by_device]


class StagingCopyEngine(CudaCopyEngine):
    """Device gather/scatter through a bounded device staging buffer + DMA per host run.

    A benchmark variant, not a product setting: not in the built-in registry
    (`hicache_harness.bench.io_variants` registers it).

    Backup: pairs sorted by host page; `index_select` of the device pages into
    staging (HBM speed), then one DMA per run of consecutive host pages.
    Load: the DMAs fill staging, then `index_copy_` scatters into the device
    pages. Work larger than the staging buffer goes in chunks; the chunks
    reuse the buffer safely because everything runs in order on the one copy
    stream. Memory: `staging_bytes` of device memory per direction.
    """

    name = "staging"

    def __init__(
        self, device_pool: DevicePool, host_pool: HostPool, *, staging_bytes: int = DEFAULT_STAGING_BYTES, batch: bool = True
    ) -> None:
        super().__init__(device_pool, host_pool)
        self._issuer = DmaIssuer(self._drv, batch)
        self.staging_bytes = staging_bytes
        self._staging = [torch.empty(staging_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]

    def _enqueue(self, d2h, info, slot, device_pages, host_pages, stream, keep) -> None:  # type: ignore[no-untyped-def]
        page_bytes = info.page_bytes
        cap = self.staging_bytes // page_bytes
        if cap < 1:
            raise ValueError(f"staging buffer of {self.staging_bytes} B holds no {page_bytes} B page")
        order = np.argsort(host_pages, kind="stable")
        host_sorted, dev_sorted = host_pages[order], device_pages[order]
        layer = self.device_pool.layer(info.part, slot)  # [physical_pages, page_bytes]
        staging = self._staging[0 if d2h else 1]
        host_base = info.host_layer(slot)  # arena byte offset
        copy_stream = self._streams[Direction.D2H if d2h else Direction.H2D]
        with torch.cuda.device(self.device_index), torch.cuda.stream(copy_stream):
            for lo in range(0, len(host_sorted), cap):
                hs, ds = host_sorted[lo : lo + cap], dev_sorted[lo : lo + cap]
                k = len(hs)
                stage = staging[: k * page_bytes].view(k, page_bytes)
                idx = self._index_to_device(ds, keep)
                starts, lengths = runs_of(hs)
                host_off = host_base + hs[starts] * page_bytes
                stage_addr = stage.data_ptr() + starts * page_bytes
                if d2h:
                    torch.index_select(layer, 0, idx, out=stage)
                    self._host_dma(d2h, info, host_off, stage_addr, lengths * page_bytes, stream)
                else:
                    self._host_dma(d2h, info, host_off, stage_addr, lengths * page_bytes, stream)
                    layer.index_copy_(0, idx, stage)

    def _index_to_device(self, pages: np.ndarray, keep: list[Any]) -> torch.Tensor:
        """Copy an int64 page array to the device on the current (copy) stream; both
        tensors go into `keep`. Allocates; no host sync."""
        pinned = torch.empty(len(pages), dtype=torch.int64, pin_memory=True)
        pinned.numpy()[:] = pages
        dev = pinned.to(self.device, non_blocking=True)
        keep += [pinned, dev]
        return dev

    def _host_dma(
        self, d2h: bool, info: PartInfo, host_offsets: np.ndarray, others: np.ndarray, sizes: np.ndarray, stream: int
    ) -> None:
        """DMAs between arena byte offsets `host_offsets` and device addresses `others`."""
        host_offsets, others, sizes = split_at_chunks(host_offsets, others, sizes, info.arena.register_chunk_bytes)
        self._issuer.issue(
            d2h,
            np.ascontiguousarray(others, dtype=np.uint64),
            np.ascontiguousarray(host_offsets + info.host_base, dtype=np.uint64),
            np.ascontiguousarray(sizes, dtype=np.uint64),
            stream,
        )
