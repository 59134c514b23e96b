"""The scheduler process's copy engine: copies that run in vLLM's workers.

In vLLM the cache's decisions (tree, allocators, backup and load state
machines) live in the scheduler process, and the bytes live in the workers
(`worker.py`). The scheduler-side `HiCache` is built on this engine: a
submission copies nothing; it returns a `RemoteTicket` that stays PENDING
until the workers report the job it belongs to (`resolve`), through vLLM's
worker-to-scheduler metadata. The ops then reap their tickets and `poll`
commits or aborts them exactly as with a local engine.

Runs in: the scheduler process. Never blocks: `wait()` on an unresolved
ticket raises instead (only the workers can make progress).
"""

from __future__ import annotations

import numpy as np

from hicache_cp import CopyEngine, CopyFailed, CopyPlan, CopyTicket, DevicePool, Direction, HostPool, TicketState
from hicache_cp import Part


class RemoteTicket(CopyTicket):
    """One layer of one part, copied by the workers; resolved by their report."""

    def __init__(self, direction: Direction, part: Part, layer: int, nbytes: int) -> None:
        super().__init__(direction, part, layer, nbytes)
        self._state = TicketState.PENDING
        self._error: BaseException | None = None

    def resolve(self, error: BaseException | None) -> None:
        """The workers reported this copy: landed (None) or failed (`error`)."""
        assert self._state is TicketState.PENDING, f"{self.describe()} resolved twice"
        self._error = error
        self._state = TicketState.FAILED if error is not None else TicketState.DONE

    def query(self) -> TicketState:
        return self._state

    def wait(self) -> None:
        if self._state is TicketState.PENDING:
            raise RuntimeError(f"{self.describe()}: runs in vLLM's workers; only their report resolves it")
        if self._error is not None:
            raise CopyFailed(f"{self.describe()} failed in a worker: {self._error}") from self._error

    def make_compute_wait(self) -> None:
        self.wait()

    @property
    def error(self) -> BaseException | None:
        return self._error


class RemoteCopyEngine(CopyEngine):
    """Hands out `RemoteTicket`s; the connector resolves them per job."""

    name = "vllm-workers"

    def __init__(self, device_pool: DevicePool, host_pool: HostPool) -> None:
        super().__init__(device_pool, host_pool)
        self._page_bytes = {p.part: p.page_bytes for p in self.layout.parts}

    def _submit(
        self, direction: Direction, part: Part, layer: int, device_pages: np.ndarray, host_pages: np.ndarray
    ) -> RemoteTicket:
        return RemoteTicket(direction, part, layer, len(device_pages) * self._page_bytes[part])

    def submit_layers(self, plan: CopyPlan, jobs: list[tuple[tuple[Part, ...], int]]) -> list[list[CopyTicket | None]]:
        """A ticket per part of each (parts, layer) of `jobs` (None for a plan without
        pages), as `submit_layer` of each would: an op's every layer in one call costs
        one ticket a layer and part, nothing else (a step's saves and loads). Never
        raises CopyFailed: nothing is copied here."""
        n, direction, page_bytes = plan.num_pages, plan.direction, self._page_bytes
        if not n:
            return [[None] * len(parts) for parts, _ in jobs]
        return [[RemoteTicket(direction, part, layer, n * page_bytes[part]) for part in parts] for parts, layer in jobs]


def resolve_op(tickets: list[CopyTicket], error: BaseException | None) -> None:
    """Resolve every ticket of one op (its job) with the workers' verdict."""
    for t in tickets:
        assert isinstance(t, RemoteTicket), f"{t.describe()} is not a remote ticket"
        if t.query() is TicketState.PENDING:
            t.resolve(error)
