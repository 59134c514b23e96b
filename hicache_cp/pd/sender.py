"""Prefill side of PD disaggregation: send a request's pages to the decode peer.

Runs in: each prefill rank's process (one `PdSender` per rank). Pages come
straight from where they live: L1 (the device pool) or L2 (the host pool's
registered arenas; an L2-only page is written from host memory, never
loaded back to L1 first).

API (what the reference server calls, per request)::

    sender = PdSender(layout, device_pool, host_pool, decode_address=(host, port),
                      authkey=key, rank=r, cp_size=cp)           # registers L1 + L2
    sender.open_room(room_id, request_id, num_pages, release=cb)  # decode allocates pages
    sender.send(room_id, PageHomes(...), chunk_first_position=k)  # all parts, all layers
    #   or, as layers finish: sender.send_layer(room_id, part, layer, homes, ...)
    result = sender.finish(room_id)   # one wait; decode verifies; RoomResult
    sender.poll()                     # abort rooms past their deadline (300 s default)
    sender.close()

`PageHomes` lists, per request-absolute page position, the tier (0 = L1,
1 = L2), the logical page id in that tier's pool and the page's prefix hash
(for verification). With cp_size > 1 every rank may be given the whole
request: rank r sends only positions with position % cp_size == r (those
pages live on its lane by construction), translating logical to physical
with `cp_mapping.to_physical`.

Contracts (DOMAIN.md rules 8-10):

* Position i goes to the decode room's ``dst_pages[i]``. Positions are
  request-absolute; with ``chunk_first_position`` (the chunk's cumulative
  page offset) a chunk must start at or after the end of this rank's
  previous chunk, or repeat the latest chunk's start (more layers of it); a
  chunk-local 0 raises, and so does a (part, layer, position) sent twice.
* Source and destination counts must match exactly: mismatched array
  lengths, positions outside the room or pages outside the pool raise
  ValueError; nothing is truncated.
* Descriptors are runs per (part, layer) where both source and destination
  pages are consecutive (and the tier is the same).
* `finish` checks all-or-nothing (every part and layer sent for the same
  positions), waits every batch once, then tells the decode peer "done" with
  the prefix hashes and returns its verdict. Transfer failures come back as
  a FAILED `RoomResult`; chunks for a FAILED room raise `RoomFailed`.
* Metrics count the bytes and descriptors actually submitted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection
from typing import Any, Callable, Iterable

import numpy as np

from hicache_cp.cp import mapping as cp_mapping
from hicache_cp.errors import ConsistencyError
from hicache_cp.layout import KVLayout, Part, PartLayout
from hicache_cp.pd.engine import TransferEngineAdapter, TransferError, TransferTimeout
from hicache_cp.pd.registration import RegistrationDescriptor, RegistrationMismatch, check_compatible
from hicache_cp.pd.room import DEFAULT_TIMEOUT_S, Room, RoomFailed, RoomState, RoomTable

logger = logging.getLogger(__name__)

__all__ = ["L1", "L2", "PageHomes", "PdSender", "RoomResult", "TransferPlan"]

L1 = 0
L2 = 1


@dataclass
class PageHomes:
    """Where each page of a request (or chunk) lives. All arrays have one entry per position."""

    positions: np.ndarray  # int64, request-absolute page positions
    tier: np.ndarray  # 0 = L1, 1 = L2
    pages: np.ndarray  # int64, logical page id in that tier's pool
    prefix_hashes: np.ndarray  # uint64, for the decode peer's verification

    def __post_init__(self) -> None:
        self.positions = np.asarray(self.positions, dtype=np.int64)
        self.tier = np.asarray(self.tier, dtype=np.int8)
        self.pages = np.asarray(self.pages, dtype=np.int64)
        self.prefix_hashes = np.asarray(self.prefix_hashes, dtype=np.uint64)
        n = {len(self.positions), len(self.tier), len(self.pages), len(self.prefix_hashes)}
        if len(n) != 1:
            raise ValueError(f"PageHomes: {len(self.positions)} positions, {len(self.tier)} tiers, "
                             f"{len(self.pages)} pages, {len(self.prefix_hashes)} hashes; counts must match")
        if len(self.tier) and not np.isin(self.tier, (L1, L2)).all():
            raise ValueError(f"PageHomes: tiers must be 0 (L1) or 1 (L2), got {np.unique(self.tier).tolist()}")
        if len(np.unique(self.positions)) != len(self.positions):
            raise ValueError("PageHomes: duplicate positions")


@dataclass
class TransferPlan:
    """The descriptors one send submits (coalesced runs), and its per-part counts."""

    srcs: list[int]
    dsts: list[int]
    lens: list[int]
    positions: np.ndarray  # owned positions, sorted
    hashes: np.ndarray
    keys: list[tuple[Part, int]]  # (part, layer) covered
    bytes_per_part: dict[Part, int] = field(default_factory=dict)
    descriptors_per_part: dict[Part, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(self.lens)


@dataclass
class RoomResult:
    room_id: int
    request_id: int
    state: RoomState
    failure: str | None
    bytes_per_part: dict[str, int]
    descriptors_per_part: dict[str, int]
    pages_per_part: dict[str, int]
    transfer_s: float
    gbps: float  # bytes / transfer_s / 1e9 (first submit to last batch done)
    mismatches: list[str] = field(default_factory=list)
    mismatch_count: int = 0

    @property
    def ok(self) -> bool:
        return self.state is RoomState.SUCCESS

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_per_part.values())

    @property
    def descriptors(self) -> int:
        return sum(self.descriptors_per_part.values())


class PdSender:
    """One prefill rank's sender. Not thread-safe: one caller thread per sender."""

    def __init__(
        self,
        layout: KVLayout,
        device_pool: Any | None,
        host_pool: Any | None,
        *,
        decode_address: tuple[str, int],
        authkey: bytes,
        rank: int = 0,
        cp_size: int = 1,
        adapter: TransferEngineAdapter | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = 10.0,
    ) -> None:
        if not 0 <= rank < cp_size:
            raise ValueError(f"rank {rank} outside cp_size {cp_size}")
        if device_pool is None and host_pool is None:
            raise ValueError("PdSender needs a device pool, a host pool or both")
        self.layout = layout
        self.rank = rank
        self.cp_size = cp_size
        self.decode_address = tuple(decode_address)
        self._authkey = authkey
        self.connect_timeout_s = connect_timeout_s
        self._own_adapter = adapter is None
        self.adapter = adapter if adapter is not None else TransferEngineAdapter()
        self.sources: dict[int, RegistrationDescriptor] = {}
        self._pool_pages: dict[int, int] = {}
        for tier, pool, make in ((L1, device_pool, RegistrationDescriptor.from_device_pool),
                                 (L2, host_pool, RegistrationDescriptor.from_host_pool)):
            if pool is None:
                continue
            if getattr(pool, "cp_size", cp_size) != cp_size:
                raise ValueError(f"{'L1' if tier == L1 else 'L2'} pool has cp_size {pool.cp_size}, sender {cp_size}")
            desc = make(pool)
            self.sources[tier] = desc
            self._pool_pages[tier] = pool.physical_pages
        self._registered: list[int] = []
        for desc in self.sources.values():
            for base, nbytes in desc.regions():
                self.adapter.register(base, nbytes)
                self._registered.append(base)
        self.rooms = RoomTable(self.adapter.abandon, timeout_s)
        self._conn: Connection | None = None
        self._seq = 0
        self.peer: str | None = None
        self.dest: RegistrationDescriptor | None = None

    # -- control channel -------------------------------------------------------
    def connect(self) -> None:
        """Handshake: exchange registration descriptors; RegistrationMismatch on any disagreement."""
        if self._conn is not None:
            return
        self._conn = Client(self.decode_address, authkey=self._authkey)
        try:
            reply = self._request({"op": "hello", "rank": self.rank, "cp_size": self.cp_size,
                                   "descriptors": [d.to_dict() for d in self.sources.values()]},
                                  self.connect_timeout_s)
            dest = RegistrationDescriptor.from_dict(reply["descriptor"])
            diffs: list[tuple[str, object, object]] = []
            for desc in self.sources.values():
                try:
                    check_compatible(desc, dest)
                except RegistrationMismatch as exc:
                    diffs += [(f"{desc.tier} {w}", a, b) for w, a, b in exc.differences]
            if diffs or not reply["ok"]:
                raise RegistrationMismatch("prefill", "decode", diffs or [("decode", None, reply.get("error"))])
        except BaseException:
            self._drop_conn()
            raise
        self.dest = dest
        self.peer = reply["session"]

    def _request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one request and wait `timeout` s for its reply (stale replies are skipped)."""
        if self._conn is None:
            raise ConnectionError("no control connection to the decode peer")
        self._seq += 1
        msg["seq"] = self._seq
        self._conn.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._conn.poll(left):
                raise TimeoutError(f"decode peer did not answer {msg['op']} within {timeout:g} s")
            reply = self._conn.recv()
            if reply.get("seq") == self._seq:
                return reply
            logger.debug("dropping stale control reply %s", reply.get("seq"))

    def _drop_conn(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
        self._conn = None

    # -- rooms -----------------------------------------------------------------
    def open_room(self, room_id: int, request_id: int, num_pages: int, *,
                  release: Callable[[Room], None] | None = None, timeout_s: float | None = None) -> Room:
        """Open a room for a request of `num_pages` pages; the decode peer allocates them.

        On a registration mismatch or a refused open the room is FAILED (its
        release called) and the error is raised."""
        room = self.rooms.open(room_id, request_id, num_pages, release=release, timeout_s=timeout_s)
        try:
            self.connect()
            reply = self._request({"op": "open", "room": room_id, "request": request_id, "num_pages": num_pages,
                                   "cp_size": self.cp_size, "timeout_s": room.timeout_s},
                                  max(0.0, room.deadline - time.monotonic()))
            if not reply["ok"]:
                raise TransferError("open room", peer=self.peer, detail=str(reply.get("error")))
            dst = np.asarray(reply["dst_pages"], dtype=np.int64)
            if len(dst) != num_pages:
                raise ConsistencyError("decode peer returned the wrong number of pages", rank=self.rank,
                                       details={"room": room_id, "asked": num_pages, "got": len(dst)})
        except (OSError, EOFError, TimeoutError) as exc:
            self._drop_conn()
            room.fail(f"control channel: {type(exc).__name__}: {exc}")
            raise
        except Exception as exc:
            room.fail(str(exc))
            raise
        room.dst_pages = dst
        room.peer = self.peer
        room.hashes = np.zeros(num_pages, dtype=np.uint64)
        room.transition(RoomState.TRANSFERRING)
        return room

    def plan(self, room_id: int, homes: PageHomes, parts: Iterable[tuple[Part, int]] | None = None, *,
             chunk_first_position: int | None = None) -> TransferPlan:
        """Coalesced descriptors for `homes` over (part, layer) pairs (default: all). Changes nothing.

        Cost: O(n log n) numpy over the n positions, plus one list of runs per (part, layer)."""
        room = self.rooms.get(room_id)
        room.require_open()
        assert room.dst_pages is not None and self.dest is not None
        keys = [(p.part, layer) for p in self.layout.parts for layer in p.layer_ids] if parts is None else list(parts)
        own = homes.positions % self.cp_size == self.rank
        order = np.argsort(homes.positions[own], kind="stable")
        pos = homes.positions[own][order]
        tier = homes.tier[own][order]
        pages = homes.pages[own][order]
        hashes = homes.prefix_hashes[own][order]
        n = len(pos)
        if n and (pos[0] < 0 or pos[-1] >= room.num_pages):
            raise ValueError(f"room {room_id}: positions [{pos[0]}, {pos[-1]}] outside the request's "
                             f"{room.num_pages} pages")
        if chunk_first_position is not None and n:
            if pos[0] < chunk_first_position:
                raise ValueError(f"room {room_id}: position {pos[0]} precedes the chunk start "
                                 f"{chunk_first_position}; positions are request-absolute")
        if chunk_first_position is not None and chunk_first_position < room.next_position \
                and chunk_first_position != room.chunk_start:
            raise ValueError(f"room {room_id}: chunk starts at page {chunk_first_position} but this rank already "
                             f"sent up to page {room.next_position - 1}; pass the cumulative page offset")
        if n:
            owners = cp_mapping.owner(pages, self.cp_size)
            if (owners != self.rank).any():
                bad = np.flatnonzero(owners != self.rank)
                raise ConsistencyError("page not owned by the rank of its position's lane", rank=self.rank,
                                       pages=pages[bad], details={"positions": pos[bad], "room": room_id})
        phys = cp_mapping.to_physical(pages, self.cp_size)
        for t in (L1, L2):
            sel = tier == t
            if not sel.any():
                continue
            if t not in self.sources:
                raise ValueError(f"room {room_id}: {int(sel.sum())} pages in {'L1' if t == L1 else 'L2'}, "
                                 f"which this sender was not given")
            bad = sel & ((phys < 1) | (phys >= self._pool_pages[t]))
            if bad.any():
                raise ValueError(f"room {room_id}: physical pages {phys[bad][:8].tolist()} outside the "
                                 f"{'L1' if t == L1 else 'L2'} pool [1, {self._pool_pages[t]})")
        for key in keys:
            sent = room.sent.get(key)
            if sent is not None and n and sent[pos].any():
                again = pos[sent[pos]]
                raise ValueError(f"room {room_id}: {key[0].value} layer {key[1]} positions {again[:8].tolist()} "
                                 f"already sent (overlapping chunk?)")
        dst = room.dst_pages[pos]
        # Runs: break where the tier changes or source or destination pages are not consecutive.
        brk = np.ones(n, dtype=bool)
        if n > 1:
            brk[1:] = (tier[1:] != tier[:-1]) | (phys[1:] != phys[:-1] + 1) | (dst[1:] != dst[:-1] + 1)
        starts = np.flatnonzero(brk)
        lengths = np.diff(np.append(starts, n))
        run_tier, run_src, run_dst = tier[starts], phys[starts], dst[starts]
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        plan = TransferPlan(srcs, dsts, lens, pos, hashes, keys)
        for part, layer in keys:
            pl: PartLayout = self.layout.part(part)
            slot = pl.slot(layer)
            d = self.dest.part(part)
            base = np.zeros(len(starts), dtype=np.int64)
            for t, desc in self.sources.items():
                base[run_tier == t] = desc.part(part).bases[slot]
            srcs += (base + run_src * pl.page_bytes).tolist()
            dsts += (d.bases[slot] + run_dst * d.page_stride).tolist()
            lens += (lengths * pl.page_bytes).tolist()
            plan.bytes_per_part[part] = plan.bytes_per_part.get(part, 0) + n * pl.page_bytes
            plan.descriptors_per_part[part] = plan.descriptors_per_part.get(part, 0) + len(starts)
        assert len(srcs) == len(dsts) == len(lens), (len(srcs), len(dsts), len(lens))
        return plan

    def send(self, room_id: int, homes: PageHomes, *, chunk_first_position: int | None = None) -> TransferPlan:
        """Submit every part and layer of `homes` (this rank's positions). Does not wait."""
        self._start_clock(room_id)
        return self._submit(room_id, self.plan(room_id, homes, chunk_first_position=chunk_first_position),
                            chunk_first_position)

    def send_layer(self, room_id: int, part: Part, layer: int, homes: PageHomes, *,
                   chunk_first_position: int | None = None) -> TransferPlan:
        """Submit one layer of one part (call as layers finish). Does not wait."""
        self._start_clock(room_id)
        plan = self.plan(room_id, homes, [(part, layer)], chunk_first_position=chunk_first_position)
        return self._submit(room_id, plan, chunk_first_position)

    def submit_plan(self, room_id: int, plan: TransferPlan) -> TransferPlan:
        """Submit a plan from `plan()` (benchmarks reuse one plan)."""
        return self._submit(room_id, plan, None)

    def _start_clock(self, room_id: int) -> None:
        """Transfer time runs from the first send call (planning included) to the last batch done."""
        room = self.rooms.get(room_id)
        if room.first_submit is None and room.state is RoomState.TRANSFERRING:
            room.first_submit = time.perf_counter()

    def _submit(self, room_id: int, plan: TransferPlan, chunk_first_position: int | None) -> TransferPlan:
        room = self.rooms.get(room_id)
        room.require_open()
        assert room.hashes is not None
        pos = plan.positions
        known = np.zeros(len(pos), dtype=bool)
        for m in room.sent.values():
            known |= m[pos]
        if known.any() and (room.hashes[pos[known]] != plan.hashes[known]).any():
            bad = pos[known][room.hashes[pos[known]] != plan.hashes[known]]
            raise ConsistencyError("prefix hash differs between sends of the same position", rank=self.rank,
                                   details={"room": room_id, "positions": bad})
        if room.first_submit is None:
            room.first_submit = time.perf_counter()
        if plan.lens:
            try:
                room.in_flight.append(self.adapter.submit_write(room.peer, plan.srcs, plan.dsts, plan.lens))
            except TransferError as exc:
                self.rooms.abort(room, str(exc))
                self._tell_abort(room)
                raise RoomFailed(room.room_id, room.request_id, str(exc)) from exc
        room.hashes[pos] = plan.hashes
        for key in plan.keys:
            m = room.sent.setdefault(key, np.zeros(room.num_pages, dtype=bool))
            m[pos] = True
        for part, b in plan.bytes_per_part.items():
            room.bytes_sent[part] = room.bytes_sent.get(part, 0) + b
        for part, c in plan.descriptors_per_part.items():
            room.descriptors_sent[part] = room.descriptors_sent.get(part, 0) + c
        if len(pos):
            room.next_position = max(room.next_position, int(pos[-1]) + 1)
        if chunk_first_position is not None:
            room.chunk_start = chunk_first_position
        return plan

    def finish(self, room_id: int, *, extra: dict[str, Any] | None = None) -> RoomResult:
        """Wait for every batch, tell the decode peer "done", return its verdict.

        `extra` joins the "done" message (what the peer verifies with, e.g.
        expected digests of the positions this rank sent, in their order).
        Never raises for transfer or peer failures: those give a FAILED result
        (the room's release has been called either way)."""
        room = self.rooms.get(room_id)
        if room.state is RoomState.TRANSFERRING:
            self._finish(room, extra or {})
        elif room.state is RoomState.BOOTSTRAPPING:
            room.conclude_without_destination()
        return self._result(room)

    def _finish(self, room: Room, extra: dict[str, Any]) -> None:
        positions = room.positions
        want = [(p.part, layer) for p in self.layout.parts for layer in p.layer_ids]
        for key in want:
            got = room.sent.get(key)
            n_got = 0 if got is None else int(got[positions].sum())
            if n_got != len(positions):
                self.rooms.abort(room, f"all-or-nothing: {key[0].value} layer {key[1]} sent {n_got} of the "
                                       f"{len(positions)} positions rank {self.rank} sent")
                self._tell_abort(room)
                return
        try:
            for batch in list(room.in_flight):
                self.adapter.wait(batch, timeout=max(0.0, room.deadline - time.monotonic()))
                room.in_flight.remove(batch)
        except TransferTimeout:
            self.rooms.abort(room, f"timeout after {room.timeout_s:g} s")
            self._tell_abort(room)
            return
        except TransferError as exc:
            self.rooms.abort(room, str(exc))
            self._tell_abort(room)
            return
        room.transfer_done = time.perf_counter()
        assert room.hashes is not None
        try:
            reply = self._request({"op": "done", "room": room.room_id, "rank": self.rank,
                                   "positions": positions.tolist(), "hashes": room.hashes[positions].tolist(),
                                   **extra},
                                  max(0.0, room.deadline - time.monotonic()))
        except TimeoutError:
            self.rooms.abort(room, f"timeout after {room.timeout_s:g} s")
            self._tell_abort(room)
            return
        except (OSError, EOFError) as exc:
            self._drop_conn()
            room.conclude_without_destination(f"decode peer connection lost ({type(exc).__name__}: {exc})")
            return
        room.mismatches = list(reply.get("mismatches") or [])
        room.mismatch_count = int(reply.get("mismatch_count") or 0)
        if reply["ok"]:
            room.transition(RoomState.SUCCESS)
        else:
            room.fail(f"decode peer: {reply.get('error')}; first mismatches {room.mismatches[:4]}")

    def _tell_abort(self, room: Room) -> None:
        """Best effort: the decode peer frees the room's pages."""
        if self._conn is None:
            return
        try:
            self._request({"op": "abort", "room": room.room_id, "reason": room.failure}, 2.0)
        except (OSError, EOFError, TimeoutError):
            self._drop_conn()

    def _result(self, room: Room) -> RoomResult:
        t = 0.0
        if room.first_submit is not None and room.transfer_done is not None:
            t = room.transfer_done - room.first_submit
        nbytes = sum(room.bytes_sent.values())
        pages = {}
        for (part, _), m in room.sent.items():
            pages[part.value] = max(pages.get(part.value, 0), int(m.sum()))
        return RoomResult(
            room.room_id, room.request_id, room.state, room.failure,
            {p.value: b for p, b in room.bytes_sent.items()},
            {p.value: c for p, c in room.descriptors_sent.items()}, pages, t,
            nbytes / t / 1e9 if t > 0 else 0.0,
            list(room.mismatches), room.mismatch_count)

    def abort(self, room_id: int, reason: str) -> None:
        room = self.rooms.get(room_id)
        if not room.state.final:
            self.rooms.abort(room, reason)
            self._tell_abort(room)

    def poll(self) -> list[Room]:
        """Abort rooms past their deadline (tells the decode peer); returns them."""
        aborted = self.rooms.poll()
        for room in aborted:
            self._tell_abort(room)
        return aborted

    def close(self) -> None:
        """Fail open rooms, drop the control channel, unregister this sender's buffers."""
        for room in list(self.rooms.rooms.values()):
            if not room.state.final:
                self.abort(room.room_id, "sender closed")
        self._drop_conn()
        if self._own_adapter:
            self.adapter.close()
        else:
            for base in self._registered:
                try:
                    self.adapter.unregister(base)
                except (TransferError, ValueError) as exc:
                    logger.warning("unregister %#x failed: %s", base, exc)
        self._registered.clear()

    def __enter__(self) -> PdSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
