"""The restore checks of the CUDA backends: a layer's ticket completes only once its
checksums ran (`hicache_cp.io.verify` says what a check is; this module says when).

    backup (D2H)  once the layer's copy landed, the checksum kernel
                  (`checksum_gpu`) reads the same device pages and writes their
                  checksums into the host pool's checksum arena (pinned, in place)
    load (H2D)    once the layer's copy landed, the kernel checksums what is in the
                  device pages now, after the work that reads them (the forward: a
                  write that raced the load into the same slots is seen), into the
                  engine's pinned landed array; when it has run, the host compares
                  with the stored checksums. That work is the caller's stream up to
                  where the owner pinned it once the forward was enqueued
                  (`pin_checks_order`), else up to the checks' launch; none for an
                  owner whose forward never writes a page it loads
                  (`CopyPlan.checks_follow_compute`)

The kernels are launched lazily, from the tickets' `query`/`wait` (the cache's
poll and settle: control paths, never the layer hook), on a stream of their
own, for every copy of the direction that landed since the last launch: the
consecutive layers of one op and part go in one launch whatever the order the
parts were submitted in (a DSA backup's latent and indexer layers alternate), so
a poll makes about one launch per op and part, not one per layer. One event
follows them; the first query that finds it complete finishes every check it
covers. Until its checksums
ran a ticket is PENDING; a mismatch makes it FAILED with the IntegrityError
(`make_compute_wait` still waits for the copy only: the forward never waits
for a check, the op's decision does). The device pages a backup reads stay
unchanged until its tickets completed (their owner reuses them only once the
op is decided or its tickets were waited for: `wait` runs the checksums too),
so checksumming them after the copy sees the bytes the copy read. A plan's
page lists reach the device through pinned memory, without a host wait.

Runs on the thread that drives the engine (the one that queries its tickets).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hicache_cp.io import checksum_gpu, verify
from hicache_cp.io.base import CopyFailed, CopyPlan, CopyTicket, Direction, TicketState
from hicache_cp.layout import Part
from hostmem.arena import HostArena

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class CheckJob:
    """The checksums of one layer of one part of a planned op."""

    plan: CopyPlan
    part: Part
    slot: int
    layer: int
    inner: CopyTicket
    launched: bool = False
    event: int = 0
    done: bool = False
    error: BaseException | None = None


@dataclass
class _PlanPages:
    """A plan's page lists on the device (uploaded once per plan): every page, and the
    pages its checks cover (`CopyPlan.check`), with their host lists."""

    device: torch.Tensor
    host: torch.Tensor
    checked_device: np.ndarray
    checked_host: np.ndarray
    checked: torch.Tensor
    checked_index: torch.Tensor
    keep: list[Any] = field(default_factory=list)


class GpuChecks:
    """The checksum work of one CUDA engine; see the module docstring."""

    def __init__(self, engine: Any) -> None:
        """`engine`: a `hicache_cp.io.cuda.CudaCopyEngine` (its pools, driver and event pool)."""
        self.engine = engine
        self.device = engine.device
        self.stream = torch.cuda.Stream(engine.device_index)
        self.handle = int(self.stream.cuda_stream)
        self.tables = checksum_gpu.DeviceTables(
            engine.layout, engine.device_pool.layer_ptr, engine.device, checksum_gpu.max_programs(engine.device)
        )
        dev = engine.device_pool.physical_pages
        units = sum(p.num_slots for p in engine.layout.parts) * dev
        self._landed_arena = HostArena(8 * units, pin=True, background=False, name="L1 landed checksums")
        flat = self._landed_arena.numpy().view(np.uint64)
        self.landed: dict[Part, np.ndarray] = {}
        offset = 0
        for p in engine.layout.parts:
            self.landed[p.part] = flat[offset : offset + p.num_slots * dev].reshape(p.num_slots, dev)
            offset += p.num_slots * dev
        self._pending: dict[Direction, collections.deque[CheckJob]] = {d: collections.deque() for d in Direction}
        self._jobs_of: dict[int, list[CheckJob]] = {}  # launch event -> its jobs, until seen complete

    def wrap(self, plan: CopyPlan, parts: tuple[Part, ...], layer: int, tickets: list[CopyTicket | None]) -> list[CopyTicket | None]:
        """`tickets` of one planned layer, each made to include its checksums."""
        out: list[CopyTicket | None] = []
        for part, t in zip(parts, tickets):
            if t is None:
                out.append(t)
                continue
            job = CheckJob(plan, part, self.engine.layout.part(part).slot(layer), layer, t)
            self._pending[plan.direction].append(job)
            out.append(CheckedTicket(t, self, job))
        return out

    # -- launching ---------------------------------------------------------------------

    def advance(self, direction: Direction) -> None:
        """Launch the checks of every copy of `direction` that landed, in submission order."""
        queue = self._pending[direction]
        if not queue:
            return
        # Copies of a direction land in submission order (the io contract): when the
        # last one landed, all did, and one query stands for the whole queue.
        everything = queue[-1].inner.query() is TicketState.DONE
        ready: list[CheckJob] = []
        while queue:
            job = queue[0]
            if everything:
                error = job.inner.error
                state = TicketState.DONE if error is None else TicketState.FAILED
            else:
                state = job.inner.query()
            if state is TicketState.PENDING:
                break
            queue.popleft()
            if state is TicketState.FAILED:
                job.done, job.error = True, job.inner.error
                continue
            ready.append(job)
        if ready:
            self._launch(direction, ready)

    def _launch(self, direction: Direction, jobs: list[CheckJob]) -> None:
        engine, sync = self.engine, self.engine._sync
        previous = sync.enter()
        event = sync.event()
        try:
            if direction is Direction.H2D:
                self._follow_compute([job.plan for job in jobs if job.plan.checks_follow_compute])
            for group in _consecutive(jobs):
                self._launch_group(direction, group)
            engine._drv.event_record(event, self.handle)
        except Exception as exc:  # noqa: BLE001 - the checks fail their tickets, never raise here
            sync.give_back(event)
            logger.warning("%s checksums of %d layers could not be launched: %s", direction.value, len(jobs), exc)
            for job in jobs:
                job.done, job.error = True, exc
            return
        finally:
            sync.leave(previous)
        self._jobs_of[event] = jobs
        for job in jobs:
            job.launched, job.event = True, event

    def _follow_compute(self, plans: list[CopyPlan]) -> None:
        """The checks stream waits for the compute that reads these loads: the point each
        plan was pinned at, or what the caller's stream queued so far (the forward)."""
        pinned = {id(p.checks_after): p.checks_after for p in plans if p.checks_after is not None}
        for event in pinned.values():
            self.stream.wait_event(event)
        if all(p.checks_after is not None for p in plans):
            return
        engine, sync = self.engine, self.engine._sync
        order = sync.event()
        engine._drv.event_record(order, sync.current_stream())
        engine._drv.stream_wait_event(self.handle, order)
        sync.give_back(order)

    def pin_order(self, plans: Iterable[CopyPlan]) -> None:
        """`CopyEngine.pin_checks_order`: one event on the caller's current stream, for
        every plan not pinned yet."""
        todo = [p for p in plans
                if p.direction is Direction.H2D and p.checks_follow_compute and p.checks_after is None]  # fmt: skip
        if not todo:
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        for plan in todo:
            plan.checks_after = event

    def _launch_group(self, direction: Direction, jobs: list[CheckJob]) -> None:
        first = jobs[0]
        pages = self._pages(first.plan)
        engine, part = self.engine, first.part
        if direction is Direction.D2H:  # into the host pool's checksum arena, at the host pages
            checksum_gpu.launch(self.tables, part, first.slot, len(jobs), pages.device,
                                engine.host_pool.sums_address(part), engine.host_pool.physical_pages, pages.host,
                                self.stream)  # fmt: skip
        else:  # into the landed array, at the device pages
            checksum_gpu.launch(self.tables, part, first.slot, len(jobs), pages.checked,
                                int(self.landed[part].ctypes.data), engine.device_pool.physical_pages,
                                pages.checked_index, self.stream)  # fmt: skip

    def _pages(self, plan: CopyPlan) -> _PlanPages:
        """The plan's device page tensors, uploaded on the checks' stream once."""
        if plan.checksum_state is None:
            rows = verify.checked_rows(plan.check, plan.num_pages)
            cd, ch = plan.device_pages[rows], plan.host_pages[rows]
            with torch.cuda.stream(self.stream):  # pinned: no host wait (torch keeps it until copied)
                up = [torch.from_numpy(np.ascontiguousarray(a)).pin_memory().to(self.device, non_blocking=True)
                      for a in (plan.device_pages, plan.host_pages, cd)]  # fmt: skip
            plan.checksum_state = _PlanPages(up[0], up[1], cd, ch, up[2], up[2])
        return plan.checksum_state

    # -- completion ---------------------------------------------------------------------

    def state(self, job: CheckJob) -> TicketState:
        """The job's state once its copy landed: PENDING until its kernel ran. Non-blocking."""
        if not job.done and not job.launched:
            self.advance(job.plan.direction)
        if not job.done and job.launched:
            try:
                ran = self.engine._drv.event_query(job.event)
            except Exception as exc:  # noqa: BLE001 - an async CUDA fault surfaces here
                job.error, ran = exc, True
            if not ran:
                return TicketState.PENDING
            self._ran(job)
        if not job.done:
            return TicketState.PENDING  # an earlier copy of its direction has not landed yet
        return TicketState.FAILED if job.error is not None else TicketState.DONE

    def wait(self, job: CheckJob) -> None:
        """Block until the job's checksums ran and were compared; raise CopyFailed on a
        failure. The copies submitted before it (of its direction) are waited for first."""
        queue = self._pending[job.plan.direction]
        while not job.done and not job.launched:
            self.advance(job.plan.direction)
            if not job.launched and not job.done and queue:
                try:
                    queue[0].inner.wait()
                except Exception:  # noqa: BLE001 - that copy's own ticket reports it
                    pass
        if not job.done:
            try:
                self.engine._drv.event_synchronize(job.event)
            except Exception as exc:  # noqa: BLE001
                job.error = exc
            self._ran(job)
        if job.error is not None:
            raise CopyFailed(f"{job.plan.direction.value} {job.part.value} layer {job.layer}: {job.error}") from job.error

    def _ran(self, job: CheckJob) -> None:
        """The job's launch event completed (or reported `job.error`, which concerns the
        whole launch): every job of the launch is finished, the event goes back."""
        jobs = self._jobs_of.pop(job.event, None)
        if jobs is None:  # finished with its launch already
            return
        fault = job.error  # from the event itself (not a comparison): the launch's
        for other in jobs:
            if fault is not None and other.error is None:
                other.error = fault
            self._finish(other)
        self.engine._sync.give_back(job.event)

    def _finish(self, job: CheckJob) -> None:
        """The job's kernel ran: compare a load's landed checksums."""
        if job.done:
            return
        job.done = True
        if job.error is None and job.plan.direction is Direction.H2D:
            pages = self._pages(job.plan)
            if len(pages.checked_device):
                got = self.landed[job.part][job.slot, pages.checked_device]
                err = verify.compare(self.engine, job.part, job.layer, got, pages.checked_host, pages.checked_device,
                                     job.plan.request)  # fmt: skip
                job.error = err

    def warm_up(self) -> None:
        """Compile the checksum kernel now: one launch per part, of device page 0 into
        the landed array (scratch until a load's check writes it). Synchronises."""
        page = torch.zeros(1, dtype=torch.int64, device=self.device)
        for p in self.engine.layout.parts:
            checksum_gpu.launch(self.tables, p.part, 0, 1, page, int(self.landed[p.part].ctypes.data),
                                self.engine.device_pool.physical_pages, page, self.stream)  # fmt: skip
        self.stream.synchronize()

    def close(self) -> None:
        self.stream.synchronize()
        self.landed.clear()
        self._landed_arena.close()


def _consecutive(jobs: list[CheckJob]) -> list[list[CheckJob]]:
    """`jobs` (in submission order) as launches: per plan and part, runs of consecutive
    slots, whatever other plans and parts they interleave with. O(jobs)."""
    by_unit: dict[tuple[int, Part], list[CheckJob]] = {}
    for job in jobs:
        by_unit.setdefault((id(job.plan), job.part), []).append(job)
    out: list[list[CheckJob]] = []
    for unit in by_unit.values():
        start = 0
        for i in range(1, len(unit) + 1):
            if i == len(unit) or unit[i].slot != unit[i - 1].slot + 1:
                out.append(unit[start:i])
                start = i
    return out


class CheckedTicket(CopyTicket):
    """A copy's ticket that completes once its checksums ran (see the module docstring)."""

    def __init__(self, inner: CopyTicket, checks: GpuChecks, job: CheckJob) -> None:
        self.direction = inner.direction
        self.part = inner.part
        self.layer = inner.layer
        self.nbytes = inner.nbytes
        self.submitted_at = inner.submitted_at
        self._inner = inner
        self._checks = checks
        self._job = job

    def query(self) -> TicketState:
        job = self._job
        if job.done:  # its checks ran (so its copy landed), or its copy failed
            return TicketState.FAILED if job.error is not None else TicketState.DONE
        if not job.launched:  # checks launch only once the copy landed: ask the copy first
            state = self._inner.query()
            if state is not TicketState.DONE:
                return state
        return self._checks.state(job)

    def wait(self) -> None:
        if not (self._job.launched or self._job.done):  # checks launch only once the copy landed
            self._inner.wait()
        self._checks.wait(self._job)

    def make_compute_wait(self) -> None:
        self._inner.make_compute_wait()  # the forward waits for the copy, never for a check

    @property
    def error(self) -> BaseException | None:
        return self._inner.error or self._job.error


class CheckedSubmissions:
    """Mixin of the CUDA engines: the public planned submissions are the backend's
    `_layer` / `_layers` with their tickets wrapped by `GpuChecks` while the engine's
    `verify` is on (nothing else happens at submission: the checks launch later)."""

    _checks: GpuChecks | None = None

    def _layer(self, plan: CopyPlan, parts: tuple[Part, ...], layer: int) -> list[CopyTicket | None]:
        raise NotImplementedError

    def _layers(self, plan: CopyPlan, jobs: list[tuple[tuple[Part, ...], int]]) -> list[list[CopyTicket | None]]:
        raise NotImplementedError

    def submit_layer(self, plan: CopyPlan, parts: tuple[Part, ...], layer: int) -> list[CopyTicket | None]:
        tickets = self._layer(plan, parts, layer)
        checks = self._checks_on()
        return tickets if checks is None else checks.wrap(plan, parts, layer, tickets)

    def submit_layers(self, plan: CopyPlan, jobs: list[tuple[tuple[Part, ...], int]]) -> list[list[CopyTicket | None]]:
        out = self._layers(plan, jobs)
        checks = self._checks_on()
        if checks is None:
            return out
        return [checks.wrap(plan, parts, layer, tickets) for (parts, layer), tickets in zip(jobs, out)]

    def pin_checks_order(self, plans: Iterable[CopyPlan]) -> None:
        checks = self._checks_on()
        if checks is not None:
            checks.pin_order(plans)

    def warm_up(self) -> None:
        """The checks' state made and their kernel compiled now, while `verify` is on."""
        checks = self._checks_on()
        if checks is not None:
            checks.warm_up()

    def _checks_on(self) -> GpuChecks | None:
        """The engine's `GpuChecks` while `verify` is on (made on first use)."""
        if not verify.active(self):  # type: ignore[arg-type]
            return None
        if self._checks is None:
            self._checks = GpuChecks(self)
        return self._checks

    def _close_checks(self) -> None:
        if self._checks is not None:
            self._checks.close()
            self._checks = None
