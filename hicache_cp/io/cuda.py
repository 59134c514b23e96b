"""CUDA io backends: per-layer D2H/H2D copies on two copy streams.

Process: the prefill server's, on the thread that drives the forward pass.
The contract is `hicache_cp.io.base`'s; this module adds how it holds on CUDA:

* Streams. One D2H stream (backups) and one H2D stream (loads) per engine,
  so the two directions overlap each other and the compute stream.
* Ordering against compute. Every submission first makes its copy stream
  wait on the caller's current (compute) stream: a backup submitted right
  after compute wrote the layer sees the new bytes, and a load never writes
  device pages that compute enqueued earlier may still read. This is an
  event record + stream wait: no host block.
* Completion. Each submission records a `torch.cuda.Event` on its copy stream
  after the copy; the ticket's `query()` is `event.query()`,
  `make_compute_wait()` makes the current stream wait on the event, `wait()`
  synchronises the event.
* Lifetime. Every tensor a copy uses (pinned index staging, device index
  arrays) stays referenced by the engine until the copy's event completed
  (`_InFlight`, pruned on each submission), whatever the caller does with
  the ticket.
* Failure. A CUDA error while enqueueing gives a FAILED ticket carrying the
  error (logged at WARNING), never an exception out of `query()`. Bad input
  (page ids out of range, mismatched counts) raises ValueError at submission.
* No host syncs on the submit path (no `.item()`, `.tolist()` of device
  tensors, no synchronize); page lists are CPU numpy int64 arrays.

Backends (registered with `register_backend`):

    kernel   NVRTC gather/scatter kernel; the SMs read/write pinned host pages
             through their mapped device address. Any page pattern runs at
             near-link speed; the grid is capped to `sm_fraction` of the SMs.
    direct   one DMA (cudaMemcpyAsync) per run of pages consecutive on both
             sides; cudaMemcpyBatchAsync issues all runs in one call where
             the runtime has it. Fast when pages coalesce, slow when scattered.
    staging  device-side gather (index_select) into a bounded device staging
             buffer, then one DMA per run of consecutive *host* pages (and the
             reverse for loads: DMA into staging, then index_copy_). Device
             pages may be scattered freely; host pages from the contiguous-
             preferring extent allocator usually form a few runs.

Host memory must be pinned (HostPool(pin=True)) and mapped at the same
address on the device (UVA, every 64-bit Linux CUDA host); the engine checks
both at construction.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hicache_cp.io.base import CopyEngine, CopyFailed, CopyTicket, Direction, TicketState, register_backend
from hicache_cp.io import kernels
from hicache_cp.layout import Part
from hicache_cp.pools import DevicePool, HostPool

logger = logging.getLogger(__name__)

#: Default share of the SMs the copy kernel may occupy (compute keeps the rest).
DEFAULT_SM_FRACTION = 0.25
#: Default device staging buffer of the staging backend, per direction.
DEFAULT_STAGING_BYTES = 64 << 20


def coalesce_pairs(device_pages: np.ndarray, host_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge (device, host) page pairs into runs consecutive on BOTH sides.

    Pairs are ordered by device page first (copy order within one layer does
    not matter, and sorting finds runs the caller's order hides). Returns
    `(device_starts, host_starts, lengths)`, int64 arrays of one row per run.
    Vectorised; O(n log n) for the sort.

    >>> [a.tolist() for a in coalesce_pairs(np.array([5, 6, 7, 1]), np.array([10, 11, 3, 2]))]
    [[1, 5, 7], [2, 10, 3], [1, 2, 1]]
    """
    n = len(device_pages)
    if n == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    order = np.argsort(device_pages, kind="stable")
    dev = device_pages[order]
    host = host_pages[order]
    breaks = (np.diff(dev) != 1) | (np.diff(host) != 1)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    lengths = np.diff(np.concatenate((starts, [n])))
    return dev[starts], host[starts], lengths.astype(np.int64)


def _runs_of(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs of consecutive ids of an already sorted page array: (starts index, lengths)."""
    n = len(pages)
    starts = np.concatenate(([0], np.flatnonzero(np.diff(pages) != 1) + 1))
    return starts, np.diff(np.concatenate((starts, [n])))


class CudaTicket(CopyTicket):
    """Ticket of one CUDA copy: an event on the copy stream, or a failure."""

    def __init__(
        self,
        direction: Direction,
        part: Part,
        layer: int,
        nbytes: int,
        event: torch.cuda.Event | None,
        error: BaseException | None = None,
        device_index: int = 0,
    ) -> None:
        super().__init__(direction, part, layer, nbytes)
        self._event = event
        self._device_index = device_index
        self._error = error
        self._done = event is None and error is None  # an empty page list is done at once

    def query(self) -> TicketState:
        """event.query(); O(1), never blocks, never raises for a failed copy."""
        if self._error is not None:
            return TicketState.FAILED
        if self._done:
            return TicketState.DONE
        try:
            self._done = bool(self._event.query())  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - an async CUDA fault surfaces here
            self._fail(exc)
            return TicketState.FAILED
        return TicketState.DONE if self._done else TicketState.PENDING

    def wait(self) -> None:
        """Host-blocking; raises CopyFailed if the copy failed."""
        if self._error is None and not self._done:
            try:
                self._event.synchronize()  # type: ignore[union-attr]
                self._done = True
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
        if self._error is not None:
            raise CopyFailed(f"{self.describe()} failed: {self._error}") from self._error

    def make_compute_wait(self) -> None:
        """The current stream waits on the copy's event; no host block.

        Raises CopyFailed for a copy already known to have failed (compute
        must not read a layer that never landed).
        """
        if self._error is not None:
            raise CopyFailed(f"{self.describe()} failed: {self._error}") from self._error
        if self._event is not None:
            torch.cuda.current_stream(self._device_index).wait_event(self._event)

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        logger.warning("%s failed: %s", self.describe(), exc)


@dataclass
class _InFlight:
    """What one copy keeps alive until its event completed."""

    event: torch.cuda.Event
    keep: list[Any] = field(default_factory=list)


class CudaCopyEngine(CopyEngine):
    """Shared machinery of the CUDA backends; subclasses implement `_enqueue`."""

    name = "cuda-abstract"

    def __init__(self, device_pool: DevicePool, host_pool: HostPool) -> None:
        super().__init__(device_pool, host_pool)
        if not device_pool.is_cuda:
            raise ValueError(f"the {self.name} io backend needs a CUDA device pool; use 'cpu' for host-memory pools")
        if not host_pool.pinned:
            raise ValueError(f"the {self.name} io backend needs a pinned host pool (HostPool(pin=True))")
        self.device = device_pool.device
        self.device_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(self.device_index):
            self._streams = {d: torch.cuda.Stream(self.device_index) for d in Direction}
        self._inflight: dict[Direction, collections.deque[_InFlight]] = {d: collections.deque() for d in Direction}
        self._host_dev_base: dict[Part, int] = {}
        for part, arena in host_pool.arenas.items():
            dptr = arena.device_ptr(0)  # waits for the first chunk only
            if dptr != arena.ptr:
                raise ValueError(
                    f"{part.value}: pinned host memory maps to device address 0x{dptr:x}, not its host "
                    f"address 0x{arena.ptr:x}; the CUDA io backends need unified addressing"
                )
            self._host_dev_base[part] = dptr

    def stream(self, direction: Direction) -> torch.cuda.Stream:
        """The copy stream of one direction (benchmarks time on it)."""
        return self._streams[direction]

    # -- submission ---------------------------------------------------------------

    def _submit(
        self, direction: Direction, part: Part, layer: int, device_pages: np.ndarray, host_pages: np.ndarray
    ) -> CudaTicket:
        p = self.layout.part(part)
        slot = p.slot(layer)
        nbytes = len(device_pages) * p.page_bytes
        if len(device_pages) == 0:
            return CudaTicket(direction, part, layer, 0, None)
        self._check_range("device", device_pages, self.device_pool.physical_pages, part, layer)
        self._check_range("host", host_pages, self.host_pool.physical_pages, part, layer)
        self._wait_host_ready(part, slot, host_pages)
        self._prune(direction)
        stream = self._streams[direction]
        keep: list[Any] = []
        try:
            with torch.cuda.device(self.device_index):
                stream.wait_stream(torch.cuda.current_stream(self.device_index))
                with torch.cuda.stream(stream):
                    self._enqueue(direction, part, slot, device_pages, host_pages, stream, keep)
                event = torch.cuda.Event()
                event.record(stream)
        except Exception as exc:  # noqa: BLE001 - the submit boundary: CUDA errors become FAILED tickets
            logger.warning(
                "%s %s layer %d (%d pages): submission failed: %s",
                direction.value, part.value, layer, len(device_pages), exc, exc_info=True,
            )
            return CudaTicket(direction, part, layer, nbytes, None, error=exc)
        self._inflight[direction].append(_InFlight(event, keep))
        logger.debug("%s %s layer %d: %d pages submitted (%s)", direction.value, part.value, layer, len(device_pages), self.name)
        return CudaTicket(direction, part, layer, nbytes, event, device_index=self.device_index)

    def _enqueue(
        self,
        direction: Direction,
        part: Part,
        slot: int,
        device_pages: np.ndarray,
        host_pages: np.ndarray,
        stream: torch.cuda.Stream,
        keep: list[Any],
    ) -> None:
        """Enqueue the copy on `stream` (already current); append to `keep`
        every object that must outlive the copy. Raises on CUDA errors."""
        raise NotImplementedError

    # -- helpers for backends -------------------------------------------------------

    def device_layer_ptr(self, part: Part, slot: int) -> int:
        """Device address of page 0 of one layer of the device pool."""
        return self.device_pool.layer_ptr(part, slot)

    def host_layer_ptr(self, part: Part, slot: int) -> int:
        """Device (= host, UVA) address of page 0 of one layer of the host pool."""
        return self._host_dev_base[part] + slot * self.host_pool.physical_pages * self.layout.part(part).page_bytes

    def index_to_device(self, rows: list[np.ndarray], keep: list[Any]) -> torch.Tensor:
        """Stack int64 page arrays into a device tensor [len(rows), n], asynchronously.

        Fills a pinned host tensor, then copies it non-blocking on the current
        (copy) stream. Both tensors go into `keep`. Allocates; no host sync.
        """
        pinned = torch.empty((len(rows), len(rows[0])), dtype=torch.int64, pin_memory=True)
        view = pinned.numpy()
        for i, r in enumerate(rows):
            view[i] = r
        dev = pinned.to(self.device, non_blocking=True)
        keep += [pinned, dev]
        return dev

    def _check_range(self, side: str, pages: np.ndarray, limit: int, part: Part, layer: int) -> None:
        # A wild page id would make a kernel or DMA write outside the pool: refuse it up front.
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 0 or hi >= limit:
            raise ValueError(
                f"{part.value} layer {layer}: {side} page ids span [{lo}, {hi}] outside the pool's [0, {limit})"
            )

    def _wait_host_ready(self, part: Part, slot: int, host_pages: np.ndarray) -> None:
        """Block until the arena is pinned up to the last host page touched.

        Only at start-up, while the arena is still being registered in the
        background; a GPU access to unregistered memory would fault.
        """
        arena = self.host_pool.arenas[part]
        page_bytes = self.layout.part(part).page_bytes
        end = (slot * self.host_pool.physical_pages + int(host_pages.max()) + 1) * page_bytes
        if arena.ready_bytes < end:
            logger.warning("%s: host arena not pinned up to byte %d yet; waiting", part.value, end)
            arena.wait_ready(end)

    def _prune(self, direction: Direction) -> None:
        q = self._inflight[direction]
        while q and q[0].event.query():
            q.popleft()

    def close(self) -> None:
        """Wait for every outstanding copy, then drop what they kept alive."""
        for direction in Direction:
            self._streams[direction].synchronize()
            self._inflight[direction].clear()


@register_backend("kernel")
class KernelCopyEngine(CudaCopyEngine):
    """Gather/scatter kernel writing/reading pinned host pages through their device address.

    Options: `sm_fraction` caps the grid at that share of the SMs (at least
    one CTA); `inline` passes page lists of up to `kernels.INLINE_PAGES`
    pages by value (no index copy).
    """

    name = "kernel"

    def __init__(
        self, device_pool: DevicePool, host_pool: HostPool, *, sm_fraction: float = DEFAULT_SM_FRACTION, inline: bool = True
    ) -> None:
        super().__init__(device_pool, host_pool)
        if not 0.0 < sm_fraction <= 1.0:
            raise ValueError(f"sm_fraction must be in (0, 1], got {sm_fraction}")
        self.kernels = kernels.load_kernels(self.device_index)
        self.max_ctas = max(1, int(self.kernels.num_sms * sm_fraction))
        self.inline = inline

    def _enqueue(self, direction, part, slot, device_pages, host_pages, stream, keep) -> None:  # type: ignore[no-untyped-def]
        page_bytes = self.layout.part(part).page_bytes
        width = kernels.vector_width(page_bytes)
        vpp = page_bytes // width
        dev_ptr, host_ptr = self.device_layer_ptr(part, slot), self.host_layer_ptr(part, slot)
        if direction is Direction.D2H:
            src, dst, src_pages, dst_pages = dev_ptr, host_ptr, device_pages, host_pages
        else:
            src, dst, src_pages, dst_pages = host_ptr, dev_ptr, host_pages, device_pages
        # 32-bit flat indices in the kernel: keep each launch's element count well under 2^32.
        per_launch = max(1, min(len(src_pages), (1 << 31) // vpp))
        handle = stream.cuda_stream
        for lo in range(0, len(src_pages), per_launch):
            s, d = src_pages[lo : lo + per_launch], dst_pages[lo : lo + per_launch]
            n = len(s)
            grid = max(1, min(self.max_ctas, -(-n * vpp // (kernels.THREADS * kernels.UNROLL))))
            if self.inline and n <= kernels.INLINE_PAGES:
                self.kernels.launch(True, width, grid, handle, src, dst, np.concatenate((s, d)), n, vpp)
            else:
                idx = self.index_to_device([s, d], keep)
                self.kernels.launch(False, width, grid, handle, src, dst, idx.data_ptr(), n, vpp)


@register_backend("direct")
class DirectCopyEngine(CudaCopyEngine):
    """One DMA per run of pages consecutive on both sides.

    Uses cudaMemcpyBatchAsync (one runtime call for all runs) when the
    runtime has it and `batch` is True, else one cudaMemcpyAsync per run
    (about 9 GB/s for scattered 42 KB pages from Python: DOMAIN.md section 5).
    """

    name = "direct"

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, *, batch: bool = True) -> None:
        super().__init__(device_pool, host_pool)
        from cuda.bindings import runtime as cudart

        self._cudart = cudart
        self.batch = batch and hasattr(cudart, "cudaMemcpyBatchAsync")
        self._attrs: Any = None

    def _enqueue(self, direction, part, slot, device_pages, host_pages, stream, keep) -> None:  # type: ignore[no-untyped-def]
        page_bytes = self.layout.part(part).page_bytes
        dev0, host0, lengths = coalesce_pairs(device_pages, host_pages)
        dev_addr = self.device_layer_ptr(part, slot) + dev0 * page_bytes
        host_off = self.host_layer_ptr(part, slot) - self._host_dev_base[part] + host0 * page_bytes
        host_dma(self, direction, part, host_off, dev_addr, lengths * page_bytes, stream)


def split_at_chunks(
    host_offsets: np.ndarray, others: np.ndarray, sizes: np.ndarray, chunk: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split DMA runs so no run crosses a multiple of `chunk` on the host side.

    The arena registers its memory in chunks (HostArena's
    register_chunk_bytes) and one cudaMemcpyAsync spanning two
    registrations fails with cudaErrorInvalidValue (seen on the H200). Runs
    that fit stay as they are; the rare crossing ones are cut. Returns
    `(host_offsets, other_addresses, sizes)`.
    """
    first, last = host_offsets // chunk, (host_offsets + sizes - 1) // chunk
    cross = np.flatnonzero(first != last)
    if len(cross) == 0:
        return host_offsets, others, sizes
    keep = np.ones(len(sizes), dtype=bool)
    keep[cross] = False
    h, o, n = [host_offsets[keep]], [others[keep]], [sizes[keep]]
    for i in cross.tolist():
        a, b, size = int(host_offsets[i]), int(others[i]), int(sizes[i])
        while size > 0:
            piece = min(size, (a // chunk + 1) * chunk - a)
            h.append(np.array([a])), o.append(np.array([b])), n.append(np.array([piece]))
            a, b, size = a + piece, b + piece, size - piece
    return np.concatenate(h), np.concatenate(o), np.concatenate(n)


def host_dma(
    engine: DirectCopyEngine | StagingCopyEngine, direction: Direction, part: Part,
    host_offsets: np.ndarray, others: np.ndarray, sizes: np.ndarray, stream: torch.cuda.Stream,
) -> None:
    """DMAs between arena byte offsets `host_offsets` and device addresses `others`."""
    arena = engine.host_pool.arenas[part]
    host_offsets, others, sizes = split_at_chunks(host_offsets, others, sizes, arena.register_chunk_bytes)
    host_addr = engine._host_dev_base[part] + host_offsets
    if direction is Direction.D2H:
        memcpy(engine, others, host_addr, sizes, stream)
    else:
        memcpy(engine, host_addr, others, sizes, stream)


def memcpy(engine: DirectCopyEngine | StagingCopyEngine, srcs: np.ndarray, dsts: np.ndarray, sizes: np.ndarray, stream: torch.cuda.Stream) -> None:
    """Enqueue DMAs `dsts[i] <- srcs[i]` of `sizes[i]` bytes on `stream`.

    One cudaMemcpyBatchAsync when enabled (falls back for good, with a
    WARNING, the first time the runtime refuses it), else a loop of
    cudaMemcpyAsync. Raises hostmem.cuda.CudaError.
    """
    from hostmem.cuda import check

    cudart = engine._cudart
    handle = cudart.cudaStream_t(stream.cuda_stream)
    if engine.batch and len(sizes) > 1:
        try:
            if engine._attrs is None:
                attrs = cudart.cudaMemcpyAttributes()
                attrs.srcAccessOrder = cudart.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
                engine._attrs = attrs
            check(
                cudart.cudaMemcpyBatchAsync(
                    dsts.tolist(), srcs.tolist(), sizes.tolist(), len(sizes), [engine._attrs], [0], 1, handle
                ),
                f"cudaMemcpyBatchAsync({len(sizes)} copies)",
            )
            return
        except Exception as exc:  # noqa: BLE001 - fall back to the plain loop once and for all
            logger.warning("%s: cudaMemcpyBatchAsync unusable (%s); using one cudaMemcpyAsync per run", engine.name, exc)
            engine.batch = False
    kind = cudart.cudaMemcpyKind.cudaMemcpyDefault
    for s, d, n in zip(srcs.tolist(), dsts.tolist(), sizes.tolist()):
        check(cudart.cudaMemcpyAsync(d, s, n, kind, handle), "cudaMemcpyAsync")


@register_backend("staging")
class StagingCopyEngine(CudaCopyEngine):
    """Device gather/scatter through a bounded device staging buffer + DMA per host run.

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
        from cuda.bindings import runtime as cudart

        self._cudart = cudart
        self.batch = batch and hasattr(cudart, "cudaMemcpyBatchAsync")
        self._attrs: Any = None
        self.staging_bytes = staging_bytes
        self._staging = {d: torch.empty(staging_bytes, dtype=torch.uint8, device=self.device) for d in Direction}

    def _enqueue(self, direction, part, slot, device_pages, host_pages, stream, keep) -> None:  # type: ignore[no-untyped-def]
        page_bytes = self.layout.part(part).page_bytes
        cap = self.staging_bytes // page_bytes
        if cap < 1:
            raise ValueError(f"staging buffer of {self.staging_bytes} B holds no {page_bytes} B page")
        order = np.argsort(host_pages, kind="stable")
        host_sorted, dev_sorted = host_pages[order], device_pages[order]
        layer = self.device_pool.layer(part, slot)  # [physical_pages, page_bytes]
        staging = self._staging[direction]
        host_base = self.host_layer_ptr(part, slot) - self._host_dev_base[part]  # arena byte offset
        for lo in range(0, len(host_sorted), cap):
            hs, ds = host_sorted[lo : lo + cap], dev_sorted[lo : lo + cap]
            k = len(hs)
            stage = staging[: k * page_bytes].view(k, page_bytes)
            idx = self.index_to_device([ds], keep)[0]
            starts, lengths = _runs_of(hs)
            host_off = host_base + hs[starts] * page_bytes
            stage_addr = stage.data_ptr() + starts * page_bytes
            sizes = lengths * page_bytes
            if direction is Direction.D2H:
                torch.index_select(layer, 0, idx, out=stage)
                host_dma(self, direction, part, host_off, stage_addr, sizes, stream)
            else:
                host_dma(self, direction, part, host_off, stage_addr, sizes, stream)
                layer.index_copy_(0, idx, stage)
