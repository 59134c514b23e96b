"""CUDA io backends: per-layer D2H/H2D copies on two copy streams.

Process: the prefill server's, on the thread that drives the forward pass.
The contract is `hicache_cp.io.base`'s; this module adds how it holds on CUDA
(the shared machinery; `hicache_cp.io.dma` holds the product backend `direct`,
and the benchmark variants `staging`, `hicache_cp.io.sm` the SM-kernel ones
`kernel` and `hybrid`):

* Streams. One D2H stream (backups) and one H2D stream (loads) per engine,
  so the two directions overlap each other and the compute stream.
* Ordering against compute. Every copy first makes its copy stream wait on
  the caller's current (compute) stream as it was at submission: a backup
  submitted right after compute wrote the layer sees the new bytes, and a
  load never writes device pages that compute enqueued earlier may still
  read. An event record + stream wait: no host block.
* Completion. Each copy records a CUDA event on its copy stream after the
  copy; the ticket's `query()` is an event query (none below a copy of the
  direction already seen landed: `io.engine_sync`), `make_compute_wait()`
  makes the current stream wait on it, `wait()` synchronises it.
* Host cost. The submit path makes a constant number of driver calls
  through `hicache_cp.io.cudadrv` (ctypes, no per-page Python objects),
  takes events from a pool, looks nothing up by enum, and allocates no
  per-page memory; a DMA backend adds driver work per descriptor (one per
  run of pages), an SM-kernel backend one launch whatever the page count
  (`hicache-cp bench-io` measures both, `submit_us`).
* Lifetime. Every tensor a copy uses beyond the pools (the staging
  backend's index arrays) stays referenced until its copy completed.
* Failure. A CUDA error while enqueueing gives a FAILED ticket carrying the
  error (logged at WARNING), never an exception out of `query()`. Bad input
  (page ids out of range, mismatched counts) raises ValueError at submission.
* No host syncs on the submit path (no `.item()`, `.tolist()` of device
  tensors, no synchronize); page lists are CPU numpy int64 arrays.

Backends:

    direct   (io.dma) the product and the default on CUDA (`io.base.default_backend`):
             one DMA per run of pages consecutive on both sides, a layer's runs in
             cudaMemcpyBatchAsync calls, large layers issued by a worker thread.
    staging  (io.dma) device-side gather into a bounded staging buffer, then
             one DMA per run of consecutive host pages. Benchmark variant.
    kernel   (io.sm) NVRTC gather/scatter kernel (`kernels`): the SMs (or their bulk
             copy units, mode "tma") read/write pinned host pages through
             their mapped device address, page ids inside the launch
             parameters; the grid is capped to `sm_fraction` of the SMs.
             Benchmark variant.
    hybrid   (io.sm) the kernel backend with `dma_runs=HYBRID_DMA_RUNS`: a copy
             of few runs goes to the DMA engines. Benchmark variant.

Only `direct` (and `cpu`, `io.cpu`) are built in; the benchmark variants join the
registry when `hicache_harness.bench.io_variants` registers them.

Host memory must be pinned (HostPool(pin=True)) and mapped at the same
address on the device (UVA, every 64-bit Linux CUDA host); the engine checks
both at construction.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hicache_cp.io.base import CopyEngine, CopyFailed, CopyPlan, CopyTicket, Direction, TicketState
from hicache_cp.io.checked import CheckedSubmissions
from hicache_cp.io.cudadrv import DmaIssuer, Driver, driver
from hicache_cp.io.engine_sync import EngineSync
from hicache_cp.io.plans import DescriptorTable, PartGeometry, Runs, TableShape
from hicache_cp.io.runs import coalesce_pairs, dma_plan, plan_runs, run_starts, split_at_chunks  # noqa: F401 - re-exported
from hicache_cp.layout import KVLayout, Part
from hicache_cp.pools import DevicePool, HostPool
from hostmem.arena import HostArena

logger = logging.getLogger(__name__)

#: Page ids travel as int32 (kernel parameters): pools stay below this.
MAX_PAGES = 1 << 31
_D2H, _H2D = Direction.D2H, Direction.H2D
#: Ops per direction whose tickets the event pool holds from the start (`reserved_events`).
RESERVED_OPS = 4


def reserved_events(layout: KVLayout) -> int:
    """Events for `RESERVED_OPS` ops of every layer of both models each way, two a layer
    (a deferred layer's ordering and done events; the parts of a layer share them)."""
    layers = layout.num_target_layers + layout.num_draft_layers
    return 2 * len(Direction) * RESERVED_OPS * layers


class CudaTicket(CopyTicket):
    """Ticket of one CUDA copy: an event recorded on the copy stream after the
    copy, or a failure. An empty copy is DONE at once."""

    def __init__(
        self,
        direction: Direction,
        part: Part,
        layer: int,
        nbytes: int,
        sync: EngineSync | None,
        event: int = 0,
        error: BaseException | None = None,
    ) -> None:
        super().__init__(direction, part, layer, nbytes)
        self._sync = sync
        self._event = event
        self._error = error
        self._done = sync is None and error is None
        self._waiting: int | None = None  # the stream last made to wait on this copy (the parts of a layer share it)
        self._sequence = sync.sequence(direction) if sync is not None and error is None else 0

    def query(self) -> TicketState:
        """Event query (none once a later copy of the direction was seen landed); O(1),
        never blocks, never raises for a failed copy."""
        if self._error is not None:
            return TicketState.FAILED
        if self._done:
            return TicketState.DONE
        try:
            self._done = self._sync.query(self.direction, self._sequence, self._event)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - an async CUDA fault surfaces here
            self._fail(exc)
            return TicketState.FAILED
        return TicketState.DONE if self._done else TicketState.PENDING

    def wait(self) -> None:
        """Host-blocking (no driver call once a later copy of the direction was seen
        landed); raises CopyFailed if the copy failed."""
        if self._error is None and not self._done:
            try:
                self._sync.synchronize(self.direction, self._sequence, self._event)  # type: ignore[union-attr]
                self._done = True
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
        if self._error is not None:
            raise CopyFailed(f"{self.describe()} failed: {self._error}") from self._error

    def make_compute_wait(self) -> None:
        """The current stream waits on the copy's event; no host block. Once per stream:
        the other parts of the layer (`SharedTicket`) ask again, and a stream that
        already waits keeps waiting.

        Raises CopyFailed for a copy already known to have failed (compute
        must not read a layer that never landed).
        """
        if self._error is not None:
            raise CopyFailed(f"{self.describe()} failed: {self._error}") from self._error
        if self._done:
            return
        assert self._sync is not None
        self._waiting = self._sync.make_current_wait(self._event, self._waiting)

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        logger.warning("%s failed: %s", self.describe(), exc)

    def __del__(self) -> None:
        if self._sync is not None and self._event:
            self._sync.give_back(self._event)


class SharedTicket(CopyTicket):
    """Ticket of one part of a layer copied together with others (one driver call, one
    event): the other parts of its layer, or the other layers of a run submitted as one
    (`layer`, default the primary's). Completion is the primary ticket's."""

    def __init__(self, primary: CudaTicket, part: Part, nbytes: int, layer: int | None = None) -> None:
        self.direction = primary.direction
        self.part = part
        self.layer = primary.layer if layer is None else layer
        self.nbytes = nbytes
        self.submitted_at = primary.submitted_at
        self._primary = primary

    def query(self) -> TicketState:
        return self._primary.query()

    def wait(self) -> None:
        self._primary.wait()

    def make_compute_wait(self) -> None:
        self._primary.make_compute_wait()

    @property
    def error(self) -> BaseException | None:
        return self._primary.error


def with_shared(primary: CopyTicket, parts: tuple[Part, ...], n: int, info: dict[Part, PartInfo]) -> list[CopyTicket | None]:
    """The tickets of a layer of `parts` copied together, `n` pages each: `primary` (the
    first part's) and a `SharedTicket` of it for every other part."""
    if len(parts) == 1:
        return [primary]
    return [primary, *[SharedTicket(primary, part, n * info[part].page_bytes) for part in parts[1:]]]


@dataclass(slots=True)
class PartInfo:
    """Addresses and sizes of one part, looked up once per submission."""

    part: Part
    page_bytes: int
    slots: dict[int, int]  # logical layer -> compact slot
    device_layers: list[int]  # device address of page 0 of each slot's layer
    host_base: int  # device (= host, UVA) address of the arena
    host_layer_bytes: int  # bytes of one layer in the arena
    arena: HostArena
    ready: bool  # the arena is fully pinned (then never waited on again)

    def host_layer(self, slot: int) -> int:
        """Arena byte offset of page 0 of a slot's layer."""
        return slot * self.host_layer_bytes

    def geometry(self) -> PartGeometry:
        """What a DMA descriptor table needs to know of this part (`io.plans`)."""
        return PartGeometry(
            self.part, self.page_bytes, self.slots, tuple(self.device_layers), self.host_base,
            self.host_layer_bytes, self.arena.register_chunk_bytes,
        )


class CudaCopyEngine(CheckedSubmissions, CopyEngine):
    """Shared machinery of the CUDA backends; subclasses implement `_enqueue`. The
    public `submit_layer(s)` (`CheckedSubmissions`) add the restore checks to `_layer(s)`."""

    name = "cuda-abstract"

    def __init__(self, device_pool: DevicePool, host_pool: HostPool) -> None:
        super().__init__(device_pool, host_pool)
        if not device_pool.is_cuda:
            raise ValueError(f"the {self.name} io backend needs a CUDA device pool; use 'cpu' for host-memory pools")
        if not host_pool.pinned:
            raise ValueError(f"the {self.name} io backend needs a pinned host pool (HostPool(pin=True))")
        for side, pages in (("device", device_pool.physical_pages), ("host", host_pool.physical_pages)):
            if pages >= MAX_PAGES:
                raise ValueError(f"{side} pool of {pages} pages: the CUDA engines take page ids below 2^31")
        self.device = device_pool.device
        self.device_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(self.device_index):
            self._streams = {d: torch.cuda.Stream(self.device_index) for d in Direction}
        self._handle = (int(self._streams[_D2H].cuda_stream), int(self._streams[_H2D].cuda_stream))
        self._drv = driver()
        self._sync = EngineSync(self._drv, self.device_index, self._drv.primary_context(self.device_index))
        previous = self._sync.enter()
        try:
            self._order = (self._drv.event_create(), self._drv.event_create())  # compute -> copy stream, reused
            self._sync.reserve(reserved_events(self.layout))
        finally:
            self._sync.leave(previous)
        self._keep: collections.deque[tuple[CudaTicket, list[Any]]] = collections.deque()
        self._issuer = DmaIssuer(self._drv)
        self._device_limit = device_pool.physical_pages
        self._host_limit = host_pool.physical_pages
        self._table_shape: TableShape | None = None
        self._info: dict[Part, PartInfo] = {}
        for p in self.layout.parts:
            arena = host_pool.arenas[p.part]
            dptr = arena.device_ptr(0)  # waits for the first chunk only
            if dptr != arena.ptr:
                raise ValueError(
                    f"{p.part.value}: pinned host memory maps to device address 0x{dptr:x}, not its host "
                    f"address 0x{arena.ptr:x}; the CUDA io backends need unified addressing"
                )
            self._info[p.part] = PartInfo(
                p.part, p.page_bytes, {layer: p.slot(layer) for layer in p.layer_ids},
                [device_pool.layer_ptr(p.part, slot) for slot in range(p.num_slots)],
                dptr, host_pool.physical_pages * p.page_bytes, arena, False,
            )

    def stream(self, direction: Direction) -> torch.cuda.Stream:
        """The copy stream of one direction (benchmarks time on it)."""
        return self._streams[direction]

    # -- submission ---------------------------------------------------------------

    def _submit(
        self, direction: Direction, part: Part, layer: int, device_pages: np.ndarray, host_pages: np.ndarray
    ) -> CudaTicket:
        info = self._info[part]
        n = len(device_pages)
        if n == 0:
            return CudaTicket(direction, part, layer, 0, None)
        # One pass per side: negative ids are huge as unsigned.
        if int(device_pages.view(np.uint64).max()) >= self._device_limit:
            self._range_error("device", device_pages, self._device_limit, part, layer)
        if int(host_pages.view(np.uint64).max()) >= self._host_limit:
            self._range_error("host", host_pages, self._host_limit, part, layer)
        slot = info.slots[layer]
        if not info.ready:
            self._wait_host_ready(info, slot, host_pages)
        previous = self._sync.enter()
        try:
            ticket = self._start(direction, info, layer, slot, device_pages, host_pages)
        finally:
            self._sync.leave(previous)
        logger.debug("%s %s layer %d: %d pages submitted (%s)", direction, part, layer, n, self.name)
        return ticket

    def _start(
        self, direction: Direction, info: PartInfo, layer: int, slot: int, device_pages: np.ndarray, host_pages: np.ndarray
    ) -> CudaTicket:
        """Enqueue the copy on the calling thread; the engine's context is current."""
        if self._keep:
            self._prune()
        keep: list[Any] = []
        d2h = direction is _D2H
        event, exc = self._ordered(direction, lambda stream: self._enqueue(d2h, info, slot, device_pages, host_pages, stream, keep))
        if exc is not None:
            logger.warning(
                "%s %s layer %d (%d pages): submission failed: %s",
                direction.value, info.part.value, layer, len(device_pages), exc, exc_info=True,
            )
            return CudaTicket(direction, info.part, layer, len(device_pages) * info.page_bytes, None, error=exc)
        ticket = CudaTicket(direction, info.part, layer, len(device_pages) * info.page_bytes, self._sync, event)
        if keep:
            self._keep.append((ticket, keep))
        return ticket

    def _ordered(self, direction: Direction, enqueue: Callable[[int], None]) -> tuple[Any, Exception | None]:
        """`enqueue(stream)` behind the compute so far (`_follow_compute`), then its event:
        (event, None), or (None, the error) at the submit boundary (FAILED tickets).
        The engine's context must be current."""
        event = self._sync.event()
        try:
            stream = self._follow_compute(0 if direction is _D2H else 1)
            enqueue(stream)
            self._drv.event_record(event, stream)
        except Exception as exc:  # noqa: BLE001 - the caller turns it into FAILED tickets
            self._sync.give_back(event)
            return None, exc
        return event, None

    def _follow_compute(self, i: int) -> int:
        """Copy stream `i` (0: D2H, 1: H2D), made to wait for the work on the caller's
        current stream so far (its order event, recorded there). Raises DriverError."""
        stream, order = self._handle[i], self._order[i]
        self._drv.event_record(order, self._sync.current_stream())
        self._drv.stream_wait_event(stream, order)
        return stream

    def _enqueue(
        self,
        d2h: bool,
        info: PartInfo,
        slot: int,
        device_pages: np.ndarray,
        host_pages: np.ndarray,
        stream: int,
        keep: list[Any],
    ) -> None:
        """Enqueue the copy on `stream` (a CUstream handle); append to `keep`
        every object that must outlive the copy. Raises on CUDA errors."""
        raise NotImplementedError

    # -- planned submission (the cache's hot path) -------------------------------------

    def _prepare(self, plan: CopyPlan) -> None:
        """Range-check the pages and wait for the pinning they need, once per op."""
        n = plan.num_pages
        if n:
            for side, pages, limit in (("device", plan.device_pages, self._device_limit), ("host", plan.host_pages, self._host_limit)):
                if int(pages.view(np.uint64).max()) >= limit:
                    lo, hi = int(pages.min()), int(pages.max())
                    raise ValueError(f"{plan.direction.value} plan: {side} page ids span [{lo}, {hi}] outside the pool's [0, {limit})")
            for info in self._info.values():
                if not info.ready:
                    self._wait_host_ready(info, max(info.slots.values()), plan.host_pages)
            self._prepare_backend(plan)

    def _prepare_backend(self, plan: CopyPlan) -> None:
        """Backend hook: precompute `plan.prepared` (default: nothing)."""

    def descriptor_table(self, plan: CopyPlan) -> DescriptorTable:
        """Every layer's DMAs of a planned op, for each model's parts (`io.plans`).

        O(layers x runs x parts) once; the caller's page order is kept."""
        if self._table_shape is None:  # the layout's (layer, parts) pairs and geometry: once per engine
            layers = [
                (layer, tuple(p.part for p in parts if p.has_layer(layer)))
                for model in {p.part.model for p in self.layout.parts}
                for parts in [self.layout.parts_of(model)]
                for layer in range(self.layout.num_layers(model))
            ]
            self._table_shape = TableShape([info.geometry() for info in self._info.values()], layers)
        return DescriptorTable(plan.direction is _D2H, self._table_shape, Runs.of(plan.device_pages, plan.host_pages))

    def _layer(self, plan: CopyPlan, parts: tuple[Part, ...], layer: int) -> list[CopyTicket | None]:
        """Copy `layer` of every part in `parts` with one set of stream-ordering
        calls and one completion event (their tickets complete together); no
        per-page work here (the plan did it). Failures: FAILED tickets. The layer
        hook's path, so written out rather than through `_ordered`."""
        n = plan.num_pages
        if not n:
            return [None] * len(parts)
        direction, sync, info = plan.direction, self._sync, self._info
        keep: list[Any] = []
        event = 0
        previous = sync.enter()
        try:
            event = sync.event()  # in the engine's context: an empty pool creates one
            if self._keep:
                self._prune()
            stream = self._follow_compute(0 if direction is _D2H else 1)
            self._enqueue_layer(plan, parts, [info[part] for part in parts], layer, stream, keep)
            self._drv.event_record(event, stream)
        except Exception as exc:  # noqa: BLE001 - the submit boundary: FAILED tickets
            if event:
                sync.give_back(event)
            logger.warning(
                "%s %s layer %d (%d pages): submission failed: %s",
                direction.value, [p.value for p in parts], layer, n, exc, exc_info=True,
            )
            return [CudaTicket(direction, part, layer, n * info[part].page_bytes, None, error=exc) for part in parts]
        finally:
            sync.leave(previous)
        primary = CudaTicket(direction, parts[0], layer, n * info[parts[0]].page_bytes, sync, event)
        if keep:
            self._keep.append((primary, keep))
        return with_shared(primary, parts, n, info)

    def _layers(self, plan: CopyPlan, jobs: list[tuple[tuple[Part, ...], int]]) -> list[list[CopyTicket | None]]:
        """All of `jobs` behind one compute-ordering wait (they are submitted at one
        moment), then per layer its copies and its event. A failure fails that
        layer's tickets and every later one's (nothing after it was enqueued)."""
        n = plan.num_pages
        if not n:
            return [[None] * len(parts) for parts, _ in jobs]
        direction = plan.direction
        i = 0 if direction is _D2H else 1
        stream = self._handle[i]
        sync = self._sync
        out: list[list[CopyTicket | None]] = []
        previous = sync.enter()
        try:
            if self._keep:
                self._prune()
            error: BaseException | None = None
            try:
                self._follow_compute(i)
            except Exception as exc:  # noqa: BLE001 - the submit boundary
                error = exc
            for parts, layer in jobs:
                infos = [self._info[part] for part in parts]
                if error is None:
                    event = sync.event()
                    keep: list[Any] = []
                    try:
                        self._enqueue_layer(plan, parts, infos, layer, stream, keep)
                        self._drv.event_record(event, stream)
                    except Exception as exc:  # noqa: BLE001
                        sync.give_back(event)
                        error = exc
                        logger.warning("%s layer %d (%d pages): submission failed: %s", direction.value, layer, n, exc, exc_info=True)
                if error is not None:
                    out.append([CudaTicket(direction, info.part, layer, n * info.page_bytes, None, error=error) for info in infos])
                    continue
                primary = CudaTicket(direction, parts[0], layer, n * infos[0].page_bytes, sync, event)
                if keep:
                    self._keep.append((primary, keep))
                out.append(with_shared(primary, parts, n, self._info))
        finally:
            sync.leave(previous)
        return out

    def _enqueue_layer(
        self, plan: CopyPlan, parts: tuple[Part, ...], infos: list[PartInfo], layer: int, stream: int, keep: list[Any]
    ) -> None:
        """Enqueue `layer` of every part of a planned op on `stream`. Default: the
        backend's `_enqueue` per part; DMA backends issue the table's descriptors."""
        d2h = plan.direction is _D2H
        for info in infos:
            self._enqueue(d2h, info, info.slots[layer], plan.device_pages, plan.host_pages, stream, keep)

    # -- helpers for backends -------------------------------------------------------

    def device_layer_ptr(self, part: Part, slot: int) -> int:
        """Device address of page 0 of one layer of the device pool."""
        return self._info[part].device_layers[slot]

    def host_layer_ptr(self, part: Part, slot: int) -> int:
        """Device (= host, UVA) address of page 0 of one layer of the host pool."""
        info = self._info[part]
        return info.host_base + info.host_layer(slot)

    def _dma(self, d2h: bool, info: PartInfo, slot: int, device_pages: np.ndarray, host_pages: np.ndarray, stream: int) -> None:
        """One DMA per run consecutive on both sides (cut at registration chunks)."""
        device, host, sizes = dma_plan(
            device_pages, host_pages, info.page_bytes, info.device_layers[slot], info.host_base,
            info.host_layer(slot), info.arena.register_chunk_bytes,
        )
        self._issuer.issue(d2h, device, host, sizes, stream)

    @staticmethod
    def _range_error(side: str, pages: np.ndarray, limit: int, part: Part, layer: int) -> None:
        # A wild page id would make a kernel or DMA write outside the pool: refuse it up front.
        lo, hi = int(pages.min()), int(pages.max())
        raise ValueError(f"{part.value} layer {layer}: {side} page ids span [{lo}, {hi}] outside the pool's [0, {limit})")

    def _wait_host_ready(self, info: PartInfo, slot: int, host_pages: np.ndarray) -> None:
        """Block until the arena is pinned up to the last host page touched.

        Only at start-up, while the arena is still being registered in the
        background; a GPU access to unregistered memory would fault.
        """
        arena = info.arena
        if arena.ready_bytes >= arena.nbytes:
            info.ready = True
            return
        end = info.host_layer(slot) + (int(host_pages.max()) + 1) * info.page_bytes
        if arena.ready_bytes < end:
            logger.warning("%s: host arena not pinned up to byte %d yet; waiting", info.part.value, end)
            arena.wait_ready(end)

    def _prune(self) -> None:
        q = self._keep
        while q and q[0][0].query() is not TicketState.PENDING:
            q.popleft()

    def close(self) -> None:
        """Wait for every outstanding copy, then drop what they kept alive."""
        for direction in Direction:
            self._streams[direction].synchronize()
        self._close_checks()
        self._keep.clear()
        self._sync.close()
