"""The copy-engine contract every io backend follows.

One submission copies one layer of one part between L1 (device) pages and
L2 (host) pages and returns a `CopyTicket`:

    ticket = engine.submit_backup(part, layer, device_pages, host_pages)  # D2H
    ticket = engine.submit_load(part, layer, host_pages, device_pages)    # H2D
    ticket.query()              # non-blocking: PENDING, DONE or FAILED
    ticket.make_compute_wait()  # the forward waits for this layer (CUDA: the
                                # current stream waits on the event; no host block)
    ticket.wait()               # host-blocking; control paths and tests only

The cache's hot path plans an op once and submits it layer by layer:

    plan = engine.plan(direction, device_pages, host_pages)   # validated once
    tickets = engine.submit_layer(plan, parts, layer)         # one per part (None: no pages)

A plan holds what every layer of the op shares (the validated page lists and
the backend's prepared form, e.g. DMA descriptor tables), so a layer's
submission does no per-page work; a backend may copy all `parts` of a layer
with one driver call, their tickets then completing together.

Ordering: submissions of one direction run in submission order (one D2H
"stream", one H2D "stream"); the two directions overlap. A backup reads the device
pages as they are when the copy runs, so the caller submits layer i's
backup only after layer i was written (the layer hooks do exactly that).

Page lists are CPU numpy int64 arrays of *physical* page ids of this rank's
pools. An engine never synchronises the host on submission. A failed copy
reports FAILED through its ticket (with the exception) and never raises out
of `query()`; the cache turns it into an abort of the backup or load.
"""

from __future__ import annotations

import abc
import time
import enum
import importlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache_cp.checksum import Verify
from hicache_cp.layout import Part
from hicache_cp.metrics import IntegrityStats

if TYPE_CHECKING:
    from hicache_cp.pools import DevicePool, HostPool


class Direction(enum.Enum):
    D2H = "d2h"  # backup
    H2D = "h2d"  # load back

    __hash__ = object.__hash__  # as layout.Model's: a dict key of the hot path


class TicketState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class CopyFailed(RuntimeError):
    """A copy did not land; carries the part, layer and direction.

    Raised by a submission refused part-way, it carries the tickets of the copies
    that submission had already started (`submitted`): they still read and write
    their pages, and the caller waits for them before it gives those pages up."""

    def __init__(self, *args: object, submitted: Sequence[CopyTicket] = ()) -> None:
        super().__init__(*args)
        self.submitted: list[CopyTicket] = list(submitted)


class CopyTicket(abc.ABC):
    """Completion handle of one submitted copy (one layer of one part)."""

    def __init__(self, direction: Direction, part: Part, layer: int, nbytes: int) -> None:
        self.direction = direction
        self.part = part
        self.layer = layer
        self.nbytes = nbytes
        self.submitted_at = time.perf_counter()  # for the copy-latency metric only

    @abc.abstractmethod
    def query(self) -> TicketState:
        """Non-blocking completion check. Never raises for a failed copy."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block the host until the copy finished; raise CopyFailed if it failed."""

    @abc.abstractmethod
    def make_compute_wait(self) -> None:
        """Order the caller's compute after this copy without blocking the host
        where the backend allows it (CUDA); otherwise block (CPU)."""

    @property
    def error(self) -> BaseException | None:
        return None

    def describe(self) -> str:
        return f"{self.direction.value} {self.part.value} layer {self.layer}"


@dataclass(slots=True)
class CopyPlan:
    """One op's page lists, validated once for every layer and part it copies
    (`CopyEngine.plan`). `prepared` is the backend's own form of them."""

    direction: Direction
    device_pages: np.ndarray
    host_pages: np.ndarray
    prepared: Any = None
    #: Loads: indices (into the page lists) whose landed bytes are checked against
    #: their stored checksums; None: every page (`hicache_cp.checksum.sample_positions`).
    check: np.ndarray | None = None
    #: What the op is for (a request id), named in integrity warnings.
    request: Any = None
    #: The checksum backend's own form of the page lists (device index tensors).
    checksum_state: Any = None
    #: Loads on CUDA: whether the checks of what landed also wait for the work the
    #: caller's stream queued by the time they launch (the forward so far, so a write
    #: racing the load into its pages is seen). False: they follow the copies alone, for
    #: an owner whose forward never writes a page it is loading and that waits for the
    #: checks before the forward ends (vLLM's worker, `integrations.vllm.worker`).
    checks_follow_compute: bool = True
    #: Loads whose checks follow compute: the point of the compute stream where the work
    #: that reads the pages ends (`CopyEngine.pin_checks_order`; a backend's event). Once
    #: set, the checks follow it instead of whatever the caller's stream holds when they
    #: launch (a scheduler may have queued its next forward there by then).
    checks_after: Any = None

    @property
    def num_pages(self) -> int:
        return len(self.device_pages)


class CopyEngine(abc.ABC):
    """Moves pages of one part and one layer between the two pools."""

    name: str = "abstract"

    def __init__(self, device_pool: DevicePool, host_pool: HostPool) -> None:
        if device_pool.layout != host_pool.layout:
            raise ValueError("device and host pools were built for different layouts")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.layout = host_pool.layout
        #: Restore checks (`hicache_cp.checksum`), off until the owner turns them on
        #: (`HiCache` does, from `Config.verify_restores`; it needs a host pool with a
        #: checksum arena): a backup then stores the checksum of every page and layer
        #: it copies, a load compares what landed with it (its ticket FAILS with an
        #: IntegrityError on a mismatch).
        self.verify = Verify.OFF
        self.integrity = IntegrityStats()

    def submit_backup(
        self, part: Part, layer: int, device_pages: np.ndarray, host_pages: np.ndarray
    ) -> CopyTicket:
        """Copy `device_pages` of (part, layer) to `host_pages` (D2H)."""
        return self._submit(Direction.D2H, part, layer, *self._check(part, layer, device_pages, host_pages))

    def submit_load(
        self, part: Part, layer: int, host_pages: np.ndarray, device_pages: np.ndarray
    ) -> CopyTicket:
        """Copy `host_pages` of (part, layer) to `device_pages` (H2D)."""
        return self._submit(Direction.H2D, part, layer, *self._check(part, layer, device_pages, host_pages))

    def plan(self, direction: Direction, device_pages: np.ndarray, host_pages: np.ndarray) -> CopyPlan:
        """Validate an op's page lists once and prepare them for `submit_layer`.

        Raises TypeError/ValueError for bad input (as the submit calls do). Costs
        O(pages) once; every layer's submission then reuses it.
        """
        dev, host = self._check_pages(device_pages, host_pages)
        plan = CopyPlan(direction, dev, host)
        self._prepare(plan)
        return plan

    def submit_layer(self, plan: CopyPlan, parts: tuple[Part, ...], layer: int) -> list[CopyTicket | None]:
        """Copy `layer` of each of `parts` for a planned op; one ticket per part, None
        for a plan without pages. The parts must own `layer` (KeyError/ValueError
        otherwise). Generic form: one `_submit` per part."""
        if not plan.num_pages:
            return [None] * len(parts)
        return [self._submit(plan.direction, part, layer, plan.device_pages, plan.host_pages) for part in parts]

    def submit_layers(self, plan: CopyPlan, jobs: list[tuple[tuple[Part, ...], int]]) -> list[list[CopyTicket | None]]:
        """`submit_layer` for each (parts, layer) of `jobs`, in order, all at once (the
        all-layer paths: a load, the all-layer backup); a backend may share the
        ordering calls among them. A layer refused with CopyFailed raises it with
        the earlier layers' tickets (`CopyFailed.submitted`)."""
        out: list[list[CopyTicket | None]] = []
        try:
            for parts, layer in jobs:
                out.append(self.submit_layer(plan, parts, layer))
        except CopyFailed as exc:
            exc.submitted += [t for tickets in out for t in tickets if t is not None]
            raise
        return out

    def pin_checks_order(self, plans: Iterable[CopyPlan]) -> None:
        """The work that reads the pages of these loads is all enqueued on the caller's
        current stream: their checks that follow compute follow the stream as it is now
        (`CopyPlan.checks_after`; the first pin of a plan holds). Never blocks. Default:
        nothing (a backend whose checks follow no stream)."""

    def _prepare(self, plan: CopyPlan) -> None:
        """Backend hook of `plan`: check and precompute whatever every layer shares."""

    @abc.abstractmethod
    def _submit(
        self, direction: Direction, part: Part, layer: int, device_pages: np.ndarray, host_pages: np.ndarray
    ) -> CopyTicket:
        """Backend work: pages are validated int64 arrays of equal length."""

    def warm_up(self) -> None:
        """Pay the backend's one-time costs now, at start-up, not in the first step that
        copies (the CUDA engines: the restore checks' state and the checksum kernel's
        compilation, when `verify` is on). Call it after setting `verify`. May
        synchronise. Default: nothing."""

    def close(self) -> None:
        """Wait for outstanding copies and release backend resources."""

    def _check(
        self, part: Part, layer: int, device_pages: np.ndarray, host_pages: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        checked = self._check_pages(device_pages, host_pages, part, layer)
        self.layout.part(part).slot(layer)  # raises for a layer the part lacks
        return checked

    @staticmethod
    def _check_pages(
        device_pages: np.ndarray, host_pages: np.ndarray, part: Part | None = None, layer: int = -1
    ) -> tuple[np.ndarray, np.ndarray]:
        if not isinstance(device_pages, np.ndarray) or not isinstance(host_pages, np.ndarray):
            raise TypeError("page lists must be CPU numpy arrays (control paths never take device tensors)")
        if device_pages.shape != host_pages.shape or device_pages.ndim != 1:
            where = f"{part.value} layer {layer}: " if part is not None else ""
            raise ValueError(
                f"{where}device and host page counts differ "
                f"({device_pages.shape} vs {host_pages.shape}); copies are never truncated"
            )
        return device_pages.astype(np.int64, copy=False), host_pages.astype(np.int64, copy=False)


EngineFactory = Callable[..., CopyEngine]
_BACKENDS: dict[str, EngineFactory] = {}

# Built-in backends, the product: name -> module that registers it. Imported only
# when a backend is asked for, so the CPU path never imports cuda-python code and
# the backends (which import this module) are never imported by it. Other engines
# (the benchmark's SM-kernel and staging variants, or a third party's) join the
# registry with `register_backend` once their module is imported.
BUILTIN: dict[str, str] = {
    "cpu": "hicache_cp.io.cpu",
    "direct": "hicache_cp.io.dma",
}


#: The built-in backends that copy with CUDA (the others run anywhere).
CUDA_BACKENDS = ("hybrid", "kernel", "direct", "staging")


def register_backend(name: str) -> Callable[[EngineFactory], EngineFactory]:
    """Class decorator adding an io backend to the registry under `name`."""

    def deco(factory: EngineFactory) -> EngineFactory:
        if name in _BACKENDS:
            raise ValueError(f"io backend {name!r} registered twice")
        _BACKENDS[name] = factory
        return factory

    return deco


def backend_names() -> list[str]:
    """Every backend name `make_engine` accepts besides "auto"."""
    return sorted(set(BUILTIN) | set(_BACKENDS))


def make_engine(name: str, device_pool: DevicePool, host_pool: HostPool, **options: Any) -> CopyEngine:
    """Build the io backend `name` ("auto" picks the best one for the pools)."""
    if name == "auto":
        name = default_backend(device_pool)
    if name not in _BACKENDS and name in BUILTIN:
        importlib.import_module(BUILTIN[name])
    try:
        factory = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown io backend {name!r}; supported: {', '.join(['auto', *backend_names()])}") from None
    return factory(device_pool, host_pool, **options)


def default_backend(device_pool: DevicePool) -> str:
    """The backend "auto" means for the pools' placement: "direct" on CUDA, "cpu" otherwise.

    "direct" (`hicache_cp.io.dma`) moves every byte with the GPU's copy engines, one
    descriptor per run of pages consecutive on both sides, so its copies take no SMs
    from the forward; the cache plans each op once (`CopyEngine.plan`) and submits a
    layer of all its parts as one precomputed descriptor-table row. Its host cost is
    O(runs) driver work per layer, issued off the caller's thread for large layers
    (`hicache_cp.io.issue`). docs/design/copy-engines.md records why this is the
    default and what the other engines measured.
    """
    return "direct" if device_pool.is_cuda else "cpu"
