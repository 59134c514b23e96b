"""The two in-flight operations of the cache, as explicit state machines.

Backup (D2H, device pages -> reserved host pages):

    RESERVED --first layer submitted--> WRITING --every layer of every part
        |                                  |       landed, all ranks agree--> COMMITTED
        |                                  v
        +---------- a copy failed / abort -> FAILING --no copy in flight on
                                                       any rank--> ABORTED

    RESERVED and WRITING may also go straight to ABORTED when nothing is in
    flight. Until COMMITTED the host copy is invisible to `match_prefix` and
    its pages cannot be evicted; ABORTED releases the whole reservation.

    A write-through backup is reserved for a request's pages before its
    forward and attached at `insert` to the nodes that took those pages (its
    nodes: a new node, or existing ones without a host copy). Positions the
    tree already held otherwise (with a host copy, or L1 pages a request
    holds) leave it *trimmed*: their host pages are spare, still written by
    the copies in flight, and freed at the decision (COMMITTED or ABORTED).
    Every layer of every page is still copied and landed before the commit;
    trimming changes which nodes it commits, never the state machine.

Load-back (H2D, host pages -> newly allocated device pages):

    RESERVED --submitted--> LOADING --every layer of every part landed,
        all ranks agree--> DONE
    LOADING --a copy failed--> FAILING --drained everywhere--> ABORTED

    While RESERVED/LOADING/FAILING the source host pages are pinned (not
    evictable). ABORTED leaves the device pages with the nodes, but their
    bytes are not the cached KV: the request holding them recomputes them.

Each op keeps, per part, the set of layers submitted and landed, and the
tickets still in flight. "Landed" means the bytes landed: a layer of a part
counts as landed only when copies covering every page of the op that this
rank owns were submitted and have completed. A submission that covers fewer
pages fails the op (`ConsistencyError` with part, layer and rank context,
agreed at the next poll), and a backup whose forward ended with a layer of
a part never submitted fails at `insert` (`missing_layers`). `local_vote()` condenses that into the two numbers
the CP agreement reduces with MIN (see `hicache_cp.cp.agreement`). Only
`transition()` changes `state`, and it checks the table.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache_cp.cp.agreement import Vote
from hicache_cp.errors import ConsistencyError, IllegalTransition, integrity_error_of
from hicache_cp.io.base import CopyTicket, TicketState
from hicache_cp.layout import KVLayout, Model, Part

if TYPE_CHECKING:
    from hicache_cp.io.base import CopyPlan
    from hicache_cp.radix import Node


@dataclass(frozen=True, slots=True)
class _Shape:
    """What the per-layer calls need of a layout, looked up once per layout:
    each model's (part, layer ids) in layout order, each part's page bytes, and
    every (parts, layer) of both models in forward order (an all-layer op's jobs)
    and, per model and layer, the parts that own it."""

    layout: KVLayout
    parts_of: dict[Model, tuple[tuple[Part, frozenset[int]], ...]]
    page_bytes: dict[Part, int]
    all_layers: list[tuple[tuple[Part, ...], int]]
    parts_at: dict[Model, dict[int, tuple[Part, ...]]]


_SHAPES: dict[int, _Shape] = {}


def _shape(layout: KVLayout) -> _Shape:
    """The layout's `_Shape` (cached by identity; a handful of layouts per process)."""
    shape = _SHAPES.get(id(layout))
    if shape is None or shape.layout is not layout:
        if len(_SHAPES) > 256:  # tests build many layouts; keep the cache bounded
            _SHAPES.clear()
        parts_of = {m: tuple((p.part, frozenset(p.layer_ids)) for p in layout.parts_of(m)) for m in Model}
        all_layers = [
            (parts, layer)
            for model in (Model.TARGET, Model.DRAFT)
            for layer in range(layout.num_layers(model))
            for parts in [tuple(part for part, owned in parts_of[model] if layer in owned)]
            if parts
        ]
        parts_at: dict[Model, dict[int, tuple[Part, ...]]] = {m: {} for m in Model}
        for parts, layer in all_layers:
            parts_at[parts[0].model][layer] = parts
        shape = _Shape(layout, parts_of, {p.part: p.page_bytes for p in layout.parts}, all_layers, parts_at)
        _SHAPES[id(layout)] = shape
    return shape


class BackupState(enum.Enum):
    RESERVED = "reserved"
    WRITING = "writing"
    FAILING = "failing"
    COMMITTED = "committed"
    ABORTED = "aborted"


class LoadState(enum.Enum):
    RESERVED = "reserved"
    LOADING = "loading"
    FAILING = "failing"
    DONE = "done"
    ABORTED = "aborted"


_BACKUP_TABLE: dict[BackupState, frozenset[BackupState]] = {
    BackupState.RESERVED: frozenset({BackupState.WRITING, BackupState.FAILING, BackupState.ABORTED}),
    BackupState.WRITING: frozenset({BackupState.COMMITTED, BackupState.FAILING, BackupState.ABORTED}),
    BackupState.FAILING: frozenset({BackupState.ABORTED}),
    BackupState.COMMITTED: frozenset(),
    BackupState.ABORTED: frozenset(),
}

_LOAD_TABLE: dict[LoadState, frozenset[LoadState]] = {
    LoadState.RESERVED: frozenset({LoadState.LOADING, LoadState.FAILING, LoadState.ABORTED}),
    LoadState.LOADING: frozenset({LoadState.DONE, LoadState.FAILING, LoadState.ABORTED}),
    LoadState.FAILING: frozenset({LoadState.ABORTED}),
    LoadState.DONE: frozenset(),
    LoadState.ABORTED: frozenset(),
}

_op_ids = itertools.count(1)

def backup_layer_group(num_layers: int, submits: int) -> int:
    """How many written layers a layer hook gathers before it submits a backup's copies
    of them (one engine call per op): about `submits` calls for the model's `num_layers`
    (`Config.backup_submits_per_forward`; a call per layer would cost the hook its stream
    ordering and hand-off every layer); the copies trail the forward by at most a group."""
    if submits < 1:
        raise ValueError(f"backup submits per forward must be >= 1, got {submits}")
    return max(1, -(-num_layers // submits))


@dataclass(eq=False)
class _CopyOp:
    """What backups and loads share: page lists, per-layer progress, tickets."""

    layout: KVLayout
    device_pages: np.ndarray  # logical L1 pages
    host_pages: np.ndarray  # logical L2 pages
    first_position: int  # request-absolute page position of the first page
    local_pages: int = -1  # pages of the op this rank owns and copies (CP); -1: all of them
    rank: int = 0
    id: int = field(default_factory=lambda: next(_op_ids))
    submitted: dict[Part, set[int]] = field(default_factory=dict)
    landed: dict[Part, set[int]] = field(default_factory=dict)
    inflight: list[CopyTicket] = field(default_factory=list)
    error: BaseException | None = None
    nbytes: int = 0
    created_at: float = field(default_factory=time.perf_counter)  # metrics only
    #: Submission-to-completion seconds of copies reaped since the last poll (metrics only).
    copy_latencies: list[float] = field(default_factory=list)
    #: This rank's (device, host) physical page ids, computed at the first submission
    #: and shared by every layer and part (the page lists never change).
    physical: tuple[np.ndarray, np.ndarray] | None = None
    #: The copy engine's plan of this rank's pages (`CopyEngine.plan`), made once per op.
    plan: CopyPlan | None = None
    #: What the op is for (a request id), named in its warnings and integrity errors.
    request: Any = None
    #: The identity of each page (its prefix hash, `hicache_cp.keys.prefix_hashes`):
    #: a backup records it with the committed copy, a load checks it (`HostPool.tags`).
    tags: np.ndarray | None = None
    _shape: _Shape = field(init=False, repr=False)

    kind = "op"

    def __post_init__(self) -> None:
        assert len(self.device_pages) == len(self.host_pages), (len(self.device_pages), len(self.host_pages))
        if self.local_pages < 0:
            self.local_pages = len(self.device_pages)
        assert self.local_pages <= len(self.device_pages), (self.local_pages, len(self.device_pages))
        self._shape = _shape(self.layout)
        for p in self.layout.parts:
            self.submitted[p.part] = set()
            self.landed[p.part] = set()

    @property
    def num_pages(self) -> int:
        return len(self.device_pages)

    def all_submitted(self) -> bool:
        return all(len(self.submitted[p.part]) == p.num_slots for p in self.layout.parts)

    def all_landed(self) -> bool:
        return all(len(self.landed[p.part]) == p.num_slots for p in self.layout.parts)

    def missing_layers(self) -> dict[Part, list[int]]:
        """Layers of each part never submitted (empty when all were)."""
        out = {}
        for p in self.layout.parts:
            missing = [layer for layer in p.layer_ids if layer not in self.submitted[p.part]]
            if missing:
                out[p.part] = missing
        return out

    def layers_to_submit(self, model: Model, layer: int) -> tuple[Part, ...]:
        """Parts of `model` that own `layer` and have not submitted it yet, in layout order."""
        parts = self._shape.parts_at[model].get(layer, ())
        submitted = self.submitted
        for part in parts:
            if layer in submitted[part]:  # a repeated hook: only what is still due
                return tuple(p for p in parts if layer not in submitted[p])
        return parts

    def all_layers(self) -> list[tuple[tuple[Part, ...], int]]:
        """Every (parts, layer) of both models in forward order, for an op none of whose
        layers was submitted yet (the all-layer paths). One list shared by every op of
        the layout: read it, never change it."""
        assert not any(self.submitted.values()), (self.id, self.submitted)
        return self._shape.all_layers

    def record_layers(
        self, jobs: list[tuple[tuple[Part, ...], int]], tickets: list[list[CopyTicket | None]]
    ) -> None:
        """`record_layer` for every (parts, layer) of `jobs`, as `submit_layers` returns
        their tickets: the all-layer paths record a whole op in one call."""
        for (parts, layer), per_part in zip(jobs, tickets):
            self.record_layer(parts, layer, per_part)
        if len(tickets) != len(jobs):  # the layers left out stay unsubmitted: the op never lands
            self.error = self.error or ConsistencyError(
                f"{self.kind} {self.id}: tickets for {len(tickets)} of {len(jobs)} layers", rank=self.rank
            )

    def record_layer(self, parts: tuple[Part, ...], layer: int, tickets: list[CopyTicket | None]) -> None:
        """`record_submit` for every part of one layer copied together, given one ticket
        per part (None: this rank copies none of the pages), as `submit_layer` returns
        them; the checks of `record_submit`, without its lists on the hot path."""
        if len(tickets) != len(parts):
            self.error = self.error or ConsistencyError(
                f"{self.kind} {self.id}: {len(tickets)} tickets for {len(parts)} parts",
                part=parts[0].value, layer=layer, rank=self.rank,
            )  # fmt: skip
            return
        submitted, page_bytes, local = self.submitted, self._shape.page_bytes, self.local_pages
        for part, ticket in zip(parts, tickets):
            done = submitted[part]
            if ticket is None or layer in done or ticket.nbytes // page_bytes[part] != local:
                self.record_submit(part, layer, [] if ticket is None else [ticket])  # the checks' slow path
                continue
            done.add(layer)
            self.inflight.append(ticket)
            self._recorded(part, layer, ticket)

    def _recorded(self, part: Part, layer: int, ticket: CopyTicket) -> None:
        """One ticket recorded by `record_layer` (a subclass's own bookkeeping)."""

    def record_submit(self, part: Part, layer: int, tickets: list[CopyTicket]) -> None:
        """Record the copies submitted for one layer of one part.

        They must cover every page this rank owns (`local_pages`): an empty
        list is right only for a rank that owns none. Anything else records a
        ConsistencyError, so the op fails on every rank at the next poll and
        that layer never counts as landed.
        """
        assert layer not in self.submitted[part], (self.id, part, layer)
        self.submitted[part].add(layer)
        page_bytes = self._shape.page_bytes[part]
        covered = sum(t.nbytes for t in tickets) // page_bytes
        if covered != self.local_pages:
            self.error = self.error or ConsistencyError(
                f"{self.kind} {self.id}: copies submitted for {covered} of the {self.local_pages} pages this rank owns",
                pages=self.device_pages,
                part=part.value,
                layer=layer,
                rank=self.rank,
            )
            self.inflight.extend(tickets)
            return
        if tickets:
            self.inflight.extend(tickets)
        else:  # this rank owns none of the pages: nothing to copy
            self.landed[part].add(layer)

    def reap(self) -> None:
        """Move finished tickets out of flight; record landed layers and failures.

        A layer counts as landed when none of its tickets is still in flight
        and none failed (a failure fails the op instead). Non-blocking.
        """
        # An op's copies go one way, and copies of one direction complete in
        # submission order (the io contract): the first PENDING ticket ends the
        # scan. The scan's queries are cheap below a ticket seen landed (a CUDA
        # engine's `EngineSync` answers them without a driver call), so the newest
        # landed ticket is found first by bisection: a poll costs O(log in flight)
        # driver queries, not one per layer.
        inflight = self.inflight
        if not inflight or inflight[0].query() is TicketState.PENDING:
            return
        _bisect_landed(inflight)
        finished: list[CopyTicket] = []
        now = time.perf_counter()
        done = 0
        for t in inflight:
            state = t.query()
            if state is TicketState.PENDING:
                break
            done += 1
            if state is TicketState.FAILED:
                self.error = self.error or t.error or RuntimeError(f"{t.describe()} failed")
            else:
                finished.append(t)
                self.nbytes += t.nbytes
                self.copy_latencies.append(now - t.submitted_at)
        if not done:
            return
        still = inflight[done:]
        self.inflight = still
        if self.error is not None:
            return
        pending_layers = {(t.part, t.layer) for t in still} if still else ()
        for t in finished:
            if (t.part, t.layer) not in pending_layers:
                self.landed[t.part].add(t.layer)


def _bisect_landed(tickets: list[CopyTicket]) -> None:
    """Query `tickets` (in submission order, the first one finished) by bisection for the
    newest finished one; only what the queries leave cached matters (see `reap`)."""
    lo, hi = 1, len(tickets)  # tickets[:lo] finished; the first pending one is below hi
    while lo < hi:
        mid = (lo + hi) // 2
        if tickets[mid].query() is TicketState.PENDING:
            hi = mid
        else:
            lo = mid + 1


@dataclass(eq=False)
class BackupOp(_CopyOp):
    """A D2H backup of a run of pages into a host reservation.

    `layerwise` ops are driven by the forward's layer hooks; the others (the
    all-layer fallback) submit every layer at once.
    """

    layerwise: bool = True
    state: BackupState = BackupState.RESERVED
    kind = "backup"
    nodes: list[Node] = field(default_factory=list)
    #: Loads of the prefix that were in flight when these pages were computed:
    #: the backup commits only after all of them are DONE, and fails if one aborts.
    after: list[LoadOp] = field(default_factory=list)
    #: Host pages of the reservation no node took at insert (their positions were in
    #: the tree already): the copies still write them, so they are freed at the decision.
    spare_host_pages: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))

    def transition(self, new: BackupState) -> None:
        if new not in _BACKUP_TABLE[self.state]:
            raise IllegalTransition(f"backup {self.id}: {self.state.value} -> {new.value} is not allowed")
        self.state = new

    def local_vote(self) -> Vote:
        self.reap()
        failing = self.state is BackupState.FAILING or self.error is not None
        if failing:
            return Vote(ok=False, settled=not self.inflight)
        return Vote(ok=True, settled=not self.inflight and self.all_landed())

    def tags_at(self, lo: int, hi: int) -> np.ndarray | None:
        """The identity tags of the op's pages [lo, hi), if recorded."""
        return None if self.tags is None else self.tags[lo:hi]

    @property
    def active(self) -> bool:
        return self.state in (BackupState.RESERVED, BackupState.WRITING, BackupState.FAILING)


@dataclass(eq=False)
class LoadOp(_CopyOp):
    """An H2D load of host-only nodes into newly allocated device pages."""

    state: LoadState = LoadState.RESERVED
    kind = "load"
    nodes: list[Node] = field(default_factory=list)
    by_layer: dict[tuple[Part, int], list[CopyTicket]] = field(default_factory=dict)
    #: The nodes whose committed host copies it reads (its `nodes`, or the matched
    #: host continuation of a load into engine-owned pages): dropped if a check fails.
    sources: list[Node] = field(default_factory=list)

    def transition(self, new: LoadState) -> None:
        if new not in _LOAD_TABLE[self.state]:
            raise IllegalTransition(f"load {self.id}: {self.state.value} -> {new.value} is not allowed")
        self.state = new

    def record_submit(self, part: Part, layer: int, tickets: list[CopyTicket]) -> None:
        super().record_submit(part, layer, tickets)
        self.by_layer[(part, layer)] = tickets

    def _recorded(self, part: Part, layer: int, ticket: CopyTicket) -> None:
        self.by_layer[(part, layer)] = [ticket]

    def wait_layer(self, layer: int, model: Model = Model.TARGET) -> None:
        """Make the forward wait until `layer` of every part of `model` is on the device.

        On CUDA the current stream waits on the layer's events (no host block);
        on CPU this blocks. A failed copy does not raise here: it is recorded
        and the op aborts on every rank at the next `poll()`.
        """
        for part, owned in self._shape.parts_of[model]:
            if layer in owned:
                self.wait_part(part, layer)

    def wait_part(self, part: Part, layer: int) -> None:
        """`wait_layer` for one part (a part read before its layer's attention, such as
        the NSA indexer's keys); nothing when the op copies no such layer."""
        for t in self.by_layer.get((part, layer), ()):
            try:
                t.make_compute_wait()
            except Exception as exc:  # recorded; the agreed poll aborts the op
                self.error = self.error or exc

    def local_vote(self) -> Vote:
        self.reap()
        if self.state is LoadState.FAILING or self.error is not None:
            return Vote(ok=False, settled=not self.inflight, intact=integrity_error_of(self.error) is None)
        return Vote(ok=True, settled=not self.inflight and self.all_landed())

    @property
    def active(self) -> bool:
        return self.state in (LoadState.RESERVED, LoadState.LOADING, LoadState.FAILING)
