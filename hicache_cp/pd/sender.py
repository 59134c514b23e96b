"""Prefill side of PD disaggregation: send a request's pages to the decode peer.

Runs in: each prefill rank's process (one `PdSender` per rank). Pages come
straight from where they live: L1 (the device pool) or L2 (the host pool's
registered arenas; an L2-only page is written from host memory, never
loaded back to L1 first).

API (what the reference server calls, per request)::

    sender = PdSender(layout, device_pool, host_pool, decode_address=(host, port),
                      authkey=key, rank=r, cp_size=cp, agreement=a)  # registers L1 + L2
    sender.open_room(room_id, request_id, num_pages, release=cb)  # decode allocates pages
    sender.send(room_id, PageHomes(...), chunk_first_position=k)  # all parts, all layers
    #   or, from the forward's layer hooks (target and draft hooks separately):
    #   sender.send_layer(room_id, part, layer, homes, after=event)  # submitted off-thread
    result = sender.finish(room_id)   # one wait; decode verifies; CP ranks agree; RoomResult
    sender.poll()                     # decode aborts, rooms past their deadline, drained rooms
    sender.close()

Positions are request-absolute (`plan.PageHomes`); with cp_size > 1 every
rank may be given the whole request and sends only the positions it owns.

Contracts (docs/invariants.md rules 8-10):

* Exact counts: a room takes exactly its pages. A send that breaks the
  contract (positions outside the room, a chunk-local 0, pages not owned,
  a position sent twice) raises and *fails the room*: nothing is truncated.
* `finish` checks all-or-nothing: every part and layer was sent for every
  position of the room this rank owns; otherwise the room fails here and the
  decode peer is told "abort", never "done".
* With an `agreement` (CP), `finish` ends in one MIN collective on every
  rank and every path: a failure on one rank fails the room on all of them.
  A rank that fails before "done" tells the decode peer "abort" first, so
  the other ranks' "done" returns instead of waiting for it.
* Abort from either side: the decode peer pushes an "abort" event, handled at
  the next send, poll or finish; a room past its deadline refuses the next
  chunk at once.
* Drain before reclaim: an aborted room's pages are released (and the
  decode peer told "abort", which frees its pages) only when none of its
  batches can still land (`room.RoomTable.abort`).
* The destination gone before "done" is answered: the room concludes FAILED,
  with a WARNING (rule 9).
* Metrics count the bytes and descriptors actually submitted.

The control channel to the decode peer (handshake, requests, its abort
events) is `session.DecodeSession`; this module keeps the rooms and the
transfers. Logging: the registration summary (buffer counts per part, the
draft state's start index, logical layer ids) at INFO on connect. The logger
``hicache_cp.pd.partition`` at DEBUG dumps each room's transfer partition
(per part: positions, source tier and page, decode page) at finish; it has
no other effect.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable

import numpy as np

from hicache_cp.cp.agreement import Agreement
from hicache_cp.errors import ConsistencyError, IntegrityError
from hicache_cp.pd import verify as pd_verify
from hicache_cp.layout import KVLayout, Part
from hicache_cp.pd.engine import TransferEngineAdapter, TransferError, TransferTimeout
from hicache_cp.pd.feeder import LayerFeeder
from hicache_cp.pd.plan import L1, L2, PageHomes, TransferPlan, plan_transfer, tier_name
from hicache_cp.pd.registration import RegistrationDescriptor
from hicache_cp.pd.result import RoomResult, dump_partition, partition_log, room_result
from hicache_cp.pd.room import DEFAULT_DRAIN_S, DEFAULT_TIMEOUT_S, Room, RoomFailed, RoomState, RoomTable
from hicache_cp.pd.session import DecodeSession
from hicache_cp.pools import DevicePool, HostPool

logger = logging.getLogger(__name__)

__all__ = ["L1", "L2", "PageHomes", "PdSender", "RoomResult", "TransferPlan"]


class PdSender:
    """One prefill rank's sender. One caller thread per sender (its feeder
    thread only submits planned batches)."""

    def __init__(
        self,
        layout: KVLayout,
        device_pool: DevicePool | None,
        host_pool: HostPool | None,
        *,
        decode_address: tuple[str, int],
        authkey: bytes,
        rank: int = 0,
        cp_size: int = 1,
        adapter: TransferEngineAdapter | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = 10.0,
        drain_s: float = DEFAULT_DRAIN_S,
        agreement: Agreement | None = None,
        verify: bool | None = None,
    ) -> None:
        """`verify` (default: when the host pool keeps checksums): send every page's
        checksum with "done" and refuse L2 pages holding another copy (`pd.verify`)."""
        if not 0 <= rank < cp_size:
            raise ValueError(f"rank {rank} outside cp_size {cp_size}")
        if device_pool is None and host_pool is None:
            raise ValueError("PdSender needs a device pool, a host pool or both")
        if agreement is not None and agreement.world_size != cp_size:
            raise ValueError(f"agreement spans {agreement.world_size} ranks, sender cp_size {cp_size}")
        self.layout = layout
        self.rank = rank
        self.cp_size = cp_size
        self.agreement = agreement
        self.device_pool, self.host_pool = device_pool, host_pool
        self.verify = bool(host_pool is not None and host_pool.has_checksums) if verify is None else verify
        self.session = DecodeSession(decode_address, authkey, rank=rank, cp_size=cp_size,
                                     connect_timeout_s=connect_timeout_s)
        self._own_adapter = adapter is None
        self.adapter = adapter if adapter is not None else TransferEngineAdapter()
        self.sources: dict[int, RegistrationDescriptor] = {}
        self._pool_pages: dict[int, int] = {}
        for tier, pool, make in ((L1, device_pool, RegistrationDescriptor.from_device_pool),
                                 (L2, host_pool, RegistrationDescriptor.from_host_pool)):
            if pool is None:
                continue
            if getattr(pool, "cp_size", cp_size) != cp_size:
                raise ValueError(f"{tier_name(tier)} pool has cp_size {pool.cp_size}, sender {cp_size}")
            self.sources[tier] = make(pool)
            self._pool_pages[tier] = pool.physical_pages
        # The engine reads registered memory by address: hold each pool's buffers
        # until `close` unregisters them, so that a pool closed first (an
        # interrupted run unwinding) cannot unmap or free memory a transfer
        # still reads (a HostArena unmaps once its last view is dropped).
        self._held = [_buffers_of(pool) for pool in (device_pool, host_pool) if pool is not None]
        self._registered: list[int] = []
        for desc in self.sources.values():
            for base, nbytes in desc.regions():
                self.adapter.register(base, nbytes)
                self._registered.append(base)
        self.rooms = RoomTable(self.adapter.abandon, timeout_s, drain=self.adapter.drain, drain_s=drain_s)
        self._lock = threading.Lock()  # room state vs the feeder's submissions
        self._feeder: LayerFeeder | None = None
        self._marks: dict[int, threading.Thread] = {}  # forward-end watchers by room
        self._unannounced: set[int] = set()  # aborted rooms whose drain ended after the abort call
        self.decode_aborts = 0  # rooms the decode side aborted

    # -- control channel (`session.DecodeSession`) --------------------------------
    @property
    def peer(self) -> str | None:
        """The decode side's transfer-engine session, once connected."""
        return self.session.peer

    @property
    def dest(self) -> RegistrationDescriptor | None:
        """The decode side's registration, once connected."""
        return self.session.dest

    @property
    def whole_prompt(self) -> bool:
        """The decode side asks for the partial last page too."""
        return self.session.whole_prompt

    def connect(self) -> None:
        """Handshake: exchange registration descriptors; RegistrationMismatch on any disagreement."""
        self.session.connect(self.sources)

    def _request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        return self.session.request(msg, timeout)

    def _drop_conn(self) -> None:
        self.session.drop()

    def _handle_events(self) -> None:
        """Decode-initiated aborts: fail the room, drain, then acknowledge."""
        for ev in self.session.abort_events():
            room_id = int(ev["room"])
            room = self.rooms.rooms.get(room_id)
            self.decode_aborts += 1
            if room is None or room.released and room.state is RoomState.SUCCESS:
                self._tell_abort(room_id, "unknown or finished room")
                continue
            self._abort(room, f"decode aborted: {ev.get('reason')}")

    # -- rooms -----------------------------------------------------------------
    def open_room(self, room_id: int, request_id: int, num_pages: int, *,
                  release: Callable[[Room], None] | None = None, timeout_s: float | None = None,
                  prompt_tokens: int | None = None) -> Room:
        """Open a room for a request of `num_pages` pages; the decode peer allocates them.

        `prompt_tokens` lets the decode side check that `num_pages` is exactly
        what it needs (whole pages, plus the partial last one when it asks
        for the whole prompt). On a registration mismatch or a refused open
        the room is FAILED (its release called) and the error is raised."""
        room = self.rooms.open(room_id, request_id, num_pages, release=release, timeout_s=timeout_s)
        reply: dict[str, Any] = {}
        try:
            self.connect()
            msg: dict[str, Any] = {"op": "open", "room": room_id, "request": request_id, "rank": self.rank,
                                   "num_pages": num_pages, "cp_size": self.cp_size, "timeout_s": room.timeout_s}
            if prompt_tokens is not None:
                msg["prompt_tokens"] = int(prompt_tokens)
            reply = self._request(msg, max(0.0, room.deadline - time.monotonic()))
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
            if reply.get("ok"):  # the decode side allocated the room: give its pages back
                self._tell_abort(room_id, room.failure)
            raise
        room.dst_pages = dst
        room.peer = self.peer
        room.hashes = np.zeros(num_pages, dtype=np.uint64)
        room.src_tier, room.src_pages = np.full(num_pages, -1, dtype=np.int8), np.zeros(num_pages, dtype=np.int64)
        if prompt_tokens is not None:
            room.tail_tokens = int(prompt_tokens) % self.layout.page_size if self.whole_prompt else 0
        room.transition(RoomState.TRANSFERRING)
        return room

    def _open_room_for_chunks(self, room_id: int) -> Room:
        """The room, if chunks may be sent; a room past its deadline is aborted here, at once
        (our own deadline is checked before the decode side's events: its deadline is later)."""
        room = self.rooms.get(room_id)
        if not room.expired():
            self._handle_events()
        try:
            room.require_open()
        except RoomFailed as exc:
            if not room.state.final:
                self._abort(room, exc.reason)
            raise
        return room

    def plan(self, room_id: int, homes: PageHomes, parts: Iterable[tuple[Part, int]] | None = None, *,
             chunk_first_position: int | None = None) -> TransferPlan:
        """Coalesced descriptors for `homes` over (part, layer) pairs (default: all). Changes nothing.

        Raises on a broken contract (see `plan.plan_transfer`); the room is left as it was."""
        room = self._open_room_for_chunks(room_id)
        assert self.dest is not None
        return plan_transfer(self.layout, self.sources, self._pool_pages, self.dest, room, homes, parts,
                             rank=self.rank, cp_size=self.cp_size, chunk_first_position=chunk_first_position)

    def send(self, room_id: int, homes: PageHomes, *, chunk_first_position: int | None = None) -> TransferPlan:
        """Submit every part and layer of `homes` (this rank's positions). Does not wait.

        A broken contract fails the room and raises."""
        return self._send(room_id, homes, None, chunk_first_position, None, False)

    def send_layer(self, room_id: int, part: Part, layer: int, homes: PageHomes, *,
                   chunk_first_position: int | None = None, after: Any = None,
                   background: bool = False) -> TransferPlan:
        """Submit one layer of one part (call from the layer's hook). Does not wait.

        `after` (a CUDA event recorded at the hook) or `background` submit
        from the feeder thread once the layer is complete, so the forward
        neither syncs nor waits for the engine's in-flight cap."""
        return self._send(room_id, homes, [(part, layer)], chunk_first_position, after, background)

    def send_layers(self, room_id: int, keys: list[tuple[Part, int]], homes: PageHomes, *,
                    chunk_first_position: int | None = None, after: Any = None,
                    background: bool = False) -> TransferPlan:
        """`send_layer` for several (part, layer) pairs in one submission (one hook's parts)."""
        return self._send(room_id, homes, list(keys), chunk_first_position, after, background)

    def submit_plan(self, room_id: int, plan: TransferPlan) -> TransferPlan:
        """Submit a plan from `plan()` (benchmarks reuse one plan)."""
        room = self.rooms.get(room_id)
        room.require_open()
        self._record(room, plan, None)
        self._submit_now(room, plan)
        return plan

    def mark_forward_end(self, room_id: int, after: Any = None) -> None:
        """Record when the forward's last layer is complete (for `RoomResult.ready_s`):
        now, or when `after` (a CUDA event) completes, seen from a short-lived
        thread (not the feeder, whose queue may be behind)."""
        room = self.rooms.get(room_id)

        def mark() -> None:
            if after is not None:
                after.synchronize()
            room.forward_end = time.perf_counter()

        if after is None:
            mark()
            return
        t = threading.Thread(target=mark, name=f"pd-forward-end-{room_id}", daemon=True)
        t.start()
        self._marks[room_id] = t

    def _send(self, room_id: int, homes: PageHomes, parts: list[tuple[Part, int]] | None,
              chunk_first_position: int | None, after: Any, background: bool) -> TransferPlan:
        room = self._open_room_for_chunks(room_id)
        if room.first_submit is None:
            room.first_submit = time.perf_counter()  # planning counts as transfer time
        try:
            plan = self.plan(room_id, homes, parts, chunk_first_position=chunk_first_position)
            self._check_hashes(room, plan)
            if self.verify and self.host_pool is not None:
                pd_verify.check_identity(self.host_pool, plan, self.rank)
        except (ValueError, ConsistencyError, IntegrityError) as exc:  # never truncate, never send into a broken room
            self._abort(room, f"transfer contract: {exc}")
            raise
        self._record(room, plan, chunk_first_position)
        if after is not None or background:
            self._feeder_of().put(after, lambda: self._submit_now(room, plan))
        else:
            self._submit_now(room, plan)
            if room.deferred_failure:
                self._abort(room, room.deferred_failure)
                raise RoomFailed(room.room_id, room.request_id, room.failure or "failed")
        return plan

    def _check_hashes(self, room: Room, plan: TransferPlan) -> None:
        assert room.hashes is not None
        pos = plan.positions
        known = np.zeros(len(pos), dtype=bool)
        for m in room.sent.values():
            known |= m[pos]
        if known.any() and (room.hashes[pos[known]] != plan.hashes[known]).any():
            bad = pos[known][room.hashes[pos[known]] != plan.hashes[known]]
            raise ConsistencyError("prefix hash differs between sends of the same position", rank=self.rank,
                                   details={"room": room.room_id, "positions": bad})

    def _record(self, room: Room, plan: TransferPlan, chunk_first_position: int | None) -> None:
        """The room's bookkeeping of a plan, on the caller's thread."""
        assert room.hashes is not None
        pos = plan.positions
        room.hashes[pos] = plan.hashes
        if room.src_tier is not None and room.src_pages is not None:
            room.src_tier[pos], room.src_pages[pos] = plan.tiers, plan.pages
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
        if partition_log.isEnabledFor(logging.DEBUG):
            for part in {k[0] for k in plan.keys}:
                room.partition.setdefault(part, []).append((pos, plan.tiers, plan.pages, plan.dst_pages))

    def _submit_now(self, room: Room, plan: TransferPlan) -> None:
        """Submit under the lock, so an abort never misses a batch (either thread)."""
        if not plan.lens:
            return
        with self._lock:
            if room.state is not RoomState.TRANSFERRING:
                return  # aborted meanwhile: nothing more goes out
            try:
                batch = self.adapter.submit_write(room.peer, plan.srcs, plan.dsts, plan.lens)
            except TransferError as exc:
                if exc.batch is not None:  # refused part-way: what went out may still land; the abort drains it
                    room.in_flight.append(exc.batch)
                room.deferred_failure = str(exc)
                return
            self.adapter.watch(batch)
            room.in_flight.append(batch)

    def _feeder_of(self) -> LayerFeeder:
        if self._feeder is None:
            self._feeder = LayerFeeder(f"pd-feeder-{self.rank}")
        return self._feeder

    # -- finishing -------------------------------------------------------------
    def finish(self, room_id: int, *, extra: dict[str, Any] | None = None) -> RoomResult:
        """Wait for every batch, tell the decode peer "done", agree, return the verdict.

        `extra` joins the "done" message (what the peer verifies with, e.g.
        expected digests of the positions this rank sent, in their order).
        Never raises for transfer or peer failures: those give a FAILED result.
        With an agreement, every rank must call it for every room it opened."""
        self._handle_events()
        room = self.rooms.get(room_id)
        if room.state is RoomState.TRANSFERRING:
            reason = self._complete(room)
            if reason is not None:
                self._abort(room, reason)  # before the collective: the other ranks' "done" must return
            else:
                self._done(room, extra or {})
        elif room.state is RoomState.BOOTSTRAPPING:
            room.conclude_without_destination()
        if self.agreement is not None:
            agreed = self.agreement.min_int(1 if room.state is RoomState.TRANSFERRING else 0)
            if not agreed and room.state is RoomState.TRANSFERRING:
                room.fail("another CP rank failed this room (MIN agreement)")
        if room.state is RoomState.TRANSFERRING:
            room.transition(RoomState.SUCCESS)
        dump_partition(self.layout, room, self.rank)
        return room_result(room)

    def _complete(self, room: Room) -> str | None:
        """Flush the feeder, check all-or-nothing, wait every batch once; a failure reason or None."""
        if self._feeder is not None and not self._feeder.flush(max(0.0, room.deadline - time.monotonic())):
            return f"timeout after {room.timeout_s:g} s (per-layer submissions still queued)"
        if self._feeder is not None:
            for exc in self._feeder.take_errors():
                room.deferred_failure = room.deferred_failure or f"per-layer submission failed: {exc}"
        if room.deferred_failure:
            return room.deferred_failure
        owned = np.arange(room.num_pages)
        owned = owned[owned % self.cp_size == self.rank]
        for p in self.layout.parts:
            for layer in p.layer_ids:
                got = room.sent.get((p.part, layer))
                n_got = 0 if got is None else int(got[owned].sum())
                if n_got != len(owned):
                    return (f"all-or-nothing: {p.part.value} layer {layer} sent {n_got} of the {len(owned)} "
                            f"positions of the room's {room.num_pages} pages that rank {self.rank} owns")
        try:
            for batch in list(room.in_flight):
                self.adapter.wait(batch, timeout=max(0.0, room.deadline - time.monotonic()))
        except TransferTimeout:
            return f"timeout after {room.timeout_s:g} s"
        except TransferError as exc:
            return str(exc)
        mark = self._marks.pop(room.room_id, None)
        if mark is not None:
            mark.join(max(0.0, room.deadline - time.monotonic()))
        room.transfer_done = time.perf_counter()
        done_at = [t for t in (getattr(b, "done_at", None) for b in room.in_flight) if t is not None]
        if done_at:
            room.transfer_done = max(done_at)
        room.in_flight.clear()
        return None

    def _done(self, room: Room, extra: dict[str, Any]) -> None:
        """Tell the decode peer "done"; the room stays TRANSFERRING when it verified."""
        assert room.hashes is not None
        first = (self.layout.parts[0].part, self.layout.parts[0].layer_ids[0])  # all-or-nothing held: any key
        positions = np.flatnonzero(room.sent.get(first, np.zeros(room.num_pages, dtype=bool)))
        if self.verify and room.src_tier is not None and room.src_pages is not None:
            sums = pd_verify.room_checksums(self.layout, self.device_pool, self.host_pool, positions,
                                            room.src_tier[positions], room.src_pages[positions], self.cp_size)
            extra = {**extra, "checksums": pd_verify.encode(sums),
                     "checksum_units": [[p.value, layer] for p, layer in pd_verify.units_of(self.layout)]}
        try:
            reply = self._request({"op": "done", "room": room.room_id, "rank": self.rank,
                                   "positions": positions.tolist(), "hashes": room.hashes[positions].tolist(),
                                   **extra},
                                  max(0.0, room.deadline - time.monotonic()))
        except TimeoutError:
            self._abort(room, f"timeout after {room.timeout_s:g} s")
            return
        except (OSError, EOFError, ValueError) as exc:
            self._drop_conn()  # the destination is gone: FAILED, loudly (rule 9)
            room.conclude_without_destination(f"decode peer connection lost on done ({type(exc).__name__}: {exc})")
            return
        room.mismatches = list(reply.get("mismatches") or [])
        room.mismatch_count = int(reply.get("mismatch_count") or 0)
        if not reply["ok"]:
            room.fail(f"decode peer: {reply.get('error')}; first mismatches {room.mismatches[:4]}")

    # -- aborts ----------------------------------------------------------------
    def _abort(self, room: Room, reason: str) -> None:
        """Fail the room (no later chunk, from either thread), drain, then tell decode."""
        with self._lock:
            room.fail(reason)
        if self.rooms.abort(room, reason):
            self._tell_abort(room.room_id, room.failure)
        else:
            self._unannounced.add(room.room_id)  # told once its batches end (`poll`)

    def _tell_abort(self, room_id: int, reason: str | None) -> None:
        """Best effort: the decode peer frees the room's pages (nothing of ours can land any more)."""
        if not self.session.connected:
            return
        try:
            self._request({"op": "abort", "room": room_id, "rank": self.rank, "reason": reason}, 2.0)
        except (OSError, EOFError, TimeoutError, ValueError):
            self._drop_conn()

    def abort(self, room_id: int, reason: str) -> None:
        room = self.rooms.get(room_id)
        if not room.state.final:
            self._abort(room, reason)

    def poll(self) -> list[Room]:
        """Handle decode aborts, abort rooms past their deadline, release drained
        rooms (telling the decode peer); returns the rooms aborted or released now."""
        now = time.monotonic()
        expired = [r for r in self.rooms.rooms.values() if r.expired(now)]
        for room in expired:  # our own deadline first: the decode side's is a little later
            self._abort(room, f"timeout after {room.timeout_s:g} s")
        self._handle_events()
        drained = self.rooms.drained()
        for room in drained:
            if room.room_id in self._unannounced:
                self._unannounced.discard(room.room_id)
                self._tell_abort(room.room_id, room.failure)
        return expired + [r for r in drained if r not in expired]

    def close(self) -> None:
        """Fail open rooms, drop the control channel, unregister this sender's buffers."""
        for room in list(self.rooms.rooms.values()):
            if not room.state.final:
                self.abort(room.room_id, "sender closed")
        if self._feeder is not None:
            self._feeder.close()
            self._feeder = None
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
        self._held.clear()

    def __enter__(self) -> PdSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _buffers_of(pool: DevicePool | HostPool) -> list[object]:
    """References that keep a pool's memory allocated and mapped: its L1 tensors, its L2 arenas' views."""
    if isinstance(pool, HostPool):
        return [pool.part_view(part) for part in pool.arenas]
    return list(pool.buffers.values())
