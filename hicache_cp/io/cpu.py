"""CPU io backend: the copy contract on worker threads.

Used where there is no GPU (the device pool is host memory). Each direction
has one worker thread, the CPU analogue of one CUDA stream: copies of one
direction run in submission order, D2H and H2D overlap. A copy is a numpy
fancy-index gather/scatter over the layer's page views, so it releases the
GIL for the bulk of the bytes.

`fault` is a test double hook, called on the worker before each copy with
(direction, part, layer); raising from it fails that copy, sleeping in it
makes the copy slow. The real copy still runs for every copy it lets pass.
`landed` is one too, called after each copy and before its checksums with
(direction, part, layer, device_pages, host_pages): a test writes into the
pages there (a torn backup, a forward racing a load).

Checksums (`hicache_cp.io.verify`, an op's `HostChecks`): a backup's from the
device pages it copied, stored beside the host copy; a load's of what landed
in the device pages, compared with the stored ones (the copy FAILS with an
IntegrityError on a mismatch). A large copy's pages are hashed on its worker
right after the copy (a backup's from the rows it gathered: no second read of
the device pages); the rest in batches on the thread that asks the tickets
(`CpuTicket`), which also finalises and stores or compares every one.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import Any

import numpy as np

from hicache_cp import checksum
from hicache_cp.io import verify
from hicache_cp.io.base import CopyEngine, CopyFailed, CopyPlan, CopyTicket, Direction, TicketState, register_backend
from hicache_cp.layout import Part
from hicache_cp.pools import DevicePool, HostPool

FaultHook = Callable[[Direction, Part, int], None]
#: A copy of at least this many bytes has its pages hashed on its worker thread, right
#: after the copy, from the bytes at hand (numpy's large loops release the GIL, so they
#: run beside the caller on another core). Smaller ones are hashed in batches on the
#: thread that asks, every layer of a part in one pass (a worker's many small numpy
#: calls would contend for the GIL with the caller instead).
WORKER_CHECK_BYTES = 1 << 18
LandedHook = Callable[[Direction, Part, int, np.ndarray, np.ndarray], None]


class CpuTicket(CopyTicket):
    """A copy on a worker thread, and its checks (`verify.HostChecks` of its op), run
    once the copy is done on the thread that first asks (the cache's poll or settle,
    the forward's wait: no worker thread contends for the GIL with small numpy
    calls); a load whose landed pages fail their check FAILS with the IntegrityError."""

    def __init__(
        self, future: cf.Future[None], direction: Direction, part: Part, layer: int, nbytes: int,
        checks: verify.HostChecks | None = None,
    ) -> None:
        super().__init__(direction, part, layer, nbytes)
        self._future = future
        self._checks = checks
        self._verified = checks is None
        self._failed: BaseException | None = None
        if checks is not None:
            checks.pending.append(self)

    def checked(self, error: BaseException | None) -> None:
        """`HostChecks` ran this copy's check (`error`: its failure, None when it passed)."""
        self._verified, self._failed = True, error

    def _checked(self) -> BaseException | None:
        """The copy's error, else its check's (run now if it has not run)."""
        exc = self._future.exception()
        if exc is None and not self._verified:
            assert self._checks is not None
            self._checks.run()
        return exc or self._failed

    def query(self) -> TicketState:
        """A failed copy is FAILED at once. A landed one is PENDING until the op's copies
        submitted so far are all done: then one batch checks them all (an op is decided
        on all of its copies anyway)."""
        if not self._future.done():
            return TicketState.PENDING
        if self._future.exception() is not None:
            return TicketState.FAILED
        if not self._verified:
            assert self._checks is not None
            if not self._checks.copied():
                return TicketState.PENDING
        return TicketState.FAILED if self._checked() is not None else TicketState.DONE

    def wait(self) -> None:
        """Blocks until the copy is done and checked. The op's other submitted copies are
        waited for too, so that one batch checks them all (a caller settling an op waits
        for each of its tickets in turn)."""
        if not self._verified:
            assert self._checks is not None
            if self._checks.pending:  # the last one done: one worker runs them in submission order
                self._checks.pending[-1]._future.exception()
        exc = self._checked()
        if exc is not None:
            raise CopyFailed(f"{self.describe()} failed: {exc}") from exc

    def make_compute_wait(self) -> None:
        """Blocks until the copy is done and checked, with the op's copies done by then
        (not the later ones: the forward reads layer by layer). On CPU the forward never
        reads a page whose check failed."""
        exc = self._checked()
        if exc is not None:
            raise CopyFailed(f"{self.describe()} failed: {exc}") from exc

    @property
    def error(self) -> BaseException | None:
        return (self._future.exception() or self._failed) if self._future.done() else None


@register_backend("cpu")
class CpuCopyEngine(CopyEngine):
    name = "cpu"

    def __init__(
        self, device_pool: DevicePool, host_pool: HostPool, fault: FaultHook | None = None,
        landed: LandedHook | None = None,
    ) -> None:
        super().__init__(device_pool, host_pool)
        if device_pool.is_cuda:
            raise ValueError("the cpu io backend needs a host-memory device pool; use 'direct' (or 'auto')")
        self.fault = fault
        self.landed = landed
        self._salts: checksum.LayoutSalts | None = None  # the checks' table rows, once asked for
        self._workers = {
            d: cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hicache-{d.value}") for d in Direction
        }

    def submit_layer(self, plan: CopyPlan, parts: tuple[Part, ...], layer: int) -> list[CopyTicket | None]:
        """The generic per-part submission; the op's tickets share its checks (`HostChecks`)."""
        if not plan.num_pages:
            return [None] * len(parts)
        if plan.checksum_state is None and verify.active(self):
            plan.checksum_state = self._checks(plan.direction, plan.device_pages, plan.host_pages, plan.check, plan.request)
        return [self._submit(plan.direction, part, layer, plan.device_pages, plan.host_pages, plan.checksum_state)
                for part in parts]  # fmt: skip

    def _checks(
        self, direction: Direction, device_pages: np.ndarray, host_pages: np.ndarray, check: np.ndarray | None,
        request: Any,
    ) -> verify.HostChecks:
        if self._salts is None:
            self._salts = checksum.layout_salts(self.layout)
        return verify.HostChecks(self, direction, device_pages, host_pages, check, request, self._salts)

    def _submit(
        self, direction: Direction, part: Part, layer: int, device_pages: np.ndarray, host_pages: np.ndarray,
        checks: verify.HostChecks | None = None,
    ) -> CpuTicket:
        slot = self.layout.part(part).slot(layer)
        dev = self.device_pool.layer_view(part, slot)
        host = self.host_pool.layer_view(part, slot)
        nbytes = len(device_pages) * self.layout.part(part).page_bytes
        if checks is None and verify.active(self):  # an unplanned copy: checks of its own
            checks = self._checks(direction, device_pages, host_pages, None, None)
        on_worker = checks if checks is not None and nbytes >= WORKER_CHECK_BYTES else None
        copy = (direction, part, layer, slot, dev, host, device_pages, host_pages, on_worker)
        worker = self._workers[direction]
        future = worker.submit(self._copy, *copy) if checks is None else worker.submit(self._reported, checks, *copy)
        return CpuTicket(future, direction, part, layer, nbytes, checks)

    def _reported(self, checks: verify.HostChecks, *copy: Any) -> None:
        """`_copy(*copy)` on the worker, its end reported to the op's `checks` (landed or
        failed, `HostChecks.finished`); a failure still fails the copy's future."""
        try:
            self._copy(*copy)
        except BaseException:
            checks.finished(False)
            raise
        checks.finished(True)

    def _copy(
        self,
        direction: Direction,
        part: Part,
        layer: int,
        slot: int,
        dev: np.ndarray,
        host: np.ndarray,
        device_pages: np.ndarray,
        host_pages: np.ndarray,
        checks: verify.HostChecks | None,
    ) -> None:
        """The copy, on the direction's worker; with `checks`, its pages hashed after it."""
        if self.fault is not None:
            self.fault(direction, part, layer)
        if direction is Direction.D2H:
            rows = dev[device_pages]
            host[host_pages] = rows
            if checks is not None:  # from the rows the copy read
                checks.hash_copied(part, slot, rows)
        else:
            dev[device_pages] = host[host_pages]
        if self.landed is not None:
            self.landed(direction, part, layer, device_pages, host_pages)
        if checks is not None and direction is Direction.H2D:
            checks.hash_landed(part, slot, dev)

    def close(self) -> None:
        for worker in self._workers.values():
            worker.shutdown(wait=True)
