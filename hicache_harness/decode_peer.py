"""The decode peer: receives a request's pages and verifies every byte.

Runs in: its own process (``run_decode_peer`` under multiprocessing spawn,
or ``hicache-cp decode-peer``), or a thread of a test/bench process
(`DecodePeer.start`).

It owns destination buffers for the whole logical layout (per part
[slots, pages, page_bytes] in host arenas registered with its own
`TransferEngineAdapter`) and serves a control channel on 127.0.0.1
(`hicache_cp.pd.control`: JSON messages only, nothing is unpickled, after
the authkey challenge with a key of at least 32 bytes). Every request is a
dict with ``op`` and ``seq``; every reply echoes ``seq`` and has ``ok``:

    hello {rank, cp_size, descriptors: [prefill descriptor dicts]}
        -> {session, descriptor, whole_prompt}; or ok=False with the differences
           (both sides' values); the rejection is also kept in `rejected`.
    open {room, request, rank, num_pages, cp_size, timeout_s[, prompt_tokens]}
        -> {dst_pages}: decode pages for positions 0..num_pages-1, contiguous
           when possible, poisoned (POISON) so stale bytes cannot pass.
           Every rank of the CP group opens the room; all get the same pages.
           With `prompt_tokens` the page count must be exactly what this side
           needs: whole pages, plus the partial last page when it asks for
           the whole prompt (`whole_prompt`); otherwise the open is refused
           with both counts.
    done {room, rank, positions, hashes[, digests]}
        -> blocks until all cp_size ranks said done (or the room failed or
           passed its deadline), then verifies every position of every part
           and layer against `integrity.content` (or the digests) and replies
           {mismatches, mismatch_count, missing}.
    abort {room, reason}: this prefill rank will write no more into the room.
    cancel {room, reason}: abort the room from the decode side (a decode
        server cancelling a request); the same path as the deadline.
    stats {} -> {free_pages, rooms, draining, rejected, verified_rooms,
        unknown_aborts, decode_aborts}
    shutdown {} -> stops serving.

Abort from either side, drain before reclaim: a room fails at once (a
waiting ``done`` returns failed), the decode side pushes an event
``{"event": "abort", room, reason}`` to every rank that may still write,
and its pages are freed only when every rank is quiet (said done or abort)
or ``drain_s`` after the abort (a rank that died). An abort of a room this
side never had is logged at WARNING and counted (`unknown_aborts`).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from hicache_harness import checks, integrity, lifetime
from hicache_harness.errors import InputError, require
from hicache_cp.layout import KVLayout, Part
from hicache_cp.pd.control import ControlClient, check_authkey, listen, recv_msg, send_msg
from hicache_cp.pd.engine import TransferEngineAdapter, quiet_mooncake_logs
from hicache_cp.pd.registration import RegistrationDescriptor, differences
from hicache_cp.allocator import LanePageAllocator
from hostmem.arena import HostArena

logger = logging.getLogger(__name__)

__all__ = ["POISON", "DecodePeer", "add_arguments", "run", "run_decode_peer", "spawn_decode_peer"]

#: Byte written over a room's destination pages before it opens.
POISON = 0xA5
#: Seconds between scans for rooms past their deadline or their drain.
REAP_INTERVAL_S = 0.2
#: Mismatches listed in a reply (the count is always exact).
MAX_REPORTED = 64
#: Seconds an aborted room's pages stay held for ranks that never said they stopped
#: (above Mooncake's own TCP transfer timeout, about 30 s).
DEFAULT_DRAIN_S = 60.0
#: Closed room ids remembered, so a late abort of one is not "unknown".
CLOSED_MEMORY = 4096


class _Channel:
    """One control connection; sends from several threads (replies and pushed events)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, msg: dict[str, Any]) -> bool:
        try:
            with self.lock:
                send_msg(self.conn, msg)
            return True
        except (OSError, EOFError, ValueError):
            return False


@dataclass(eq=False)
class _DecodeRoom:
    room_id: int
    request_id: int
    num_pages: int
    cp_size: int
    dst_pages: np.ndarray
    deadline: float
    dones: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    #: rank -> accepted digest rows [variants, units] per position it sent, when the
    #: prefill engine's KV is not `integrity.content` (the hf engine's real model)
    digests: dict[int, list[Any]] = field(default_factory=dict)
    #: rank -> (checksum units, base64 checksums) sent with "done" (`hicache_cp.pd.verify`)
    checksums: dict[int, tuple[list[Any], str]] = field(default_factory=dict)
    result: dict[str, Any] | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)
    channels: dict[int, _Channel] = field(default_factory=dict)  # rank -> its control channel
    quiet: set[int] = field(default_factory=set)  # ranks that will write no more (done or abort)
    free_at: float | None = None  # after an abort: free even without every rank quiet


class DecodePeer:
    """Destination buffers + engine + control server for one decode endpoint."""

    def __init__(self, layout: KVLayout, pages: int, *, authkey: bytes, host: str = "127.0.0.1",
                 port: int = 0, adapter: TransferEngineAdapter | None = None, whole_prompt: bool = False,
                 drain_s: float = DEFAULT_DRAIN_S) -> None:
        try:  # first: a port in use is refused before any buffer is made
            self.listener = listen(host, port, authkey)
        except OSError as exc:
            raise InputError(f"decode peer control port {host}:{port}: {exc.strerror or exc}") from None
        self.address: tuple[str, int] = self.listener.address
        try:
            self._build(layout, pages, host, adapter, whole_prompt, drain_s)
        except BaseException:
            self.listener.close()
            raise

    def _build(self, layout: KVLayout, pages: int, host: str, adapter: TransferEngineAdapter | None,
               whole_prompt: bool, drain_s: float) -> None:
        self.layout = layout
        self.pages = pages
        self.whole_prompt = whole_prompt
        self.drain_s = drain_s
        self.allocator = LanePageAllocator(pages, 1, name="decode")
        self._own_adapter = adapter is None
        self.adapter = adapter if adapter is not None else TransferEngineAdapter(hostname=host)
        self.arenas: dict[Part, HostArena] = {}
        self.views: dict[Part, np.ndarray] = {}
        for p in layout.parts:
            arena = HostArena(p.bytes_per_page * pages, pin=None, background=False, name=f"decode {p.part.value}")
            self.arenas[p.part] = arena
            self.views[p.part] = arena.numpy().reshape(p.num_slots, pages, p.page_bytes)
            self.adapter.register(arena.ptr, arena.nbytes)
        self.descriptor = RegistrationDescriptor.from_buffers(
            "decode", layout, {part: a.ptr for part, a in self.arenas.items()}, pages)
        self.rooms: dict[int, _DecodeRoom] = {}
        self._closed_ids: deque[int] = deque(maxlen=CLOSED_MEMORY)
        self.rejected: list[str] = []
        self.verified_rooms = 0
        self.checksum_units = 0  # (position, part, layer) units checked against prefill's checksums
        self.checksum_failures = 0
        self.unknown_aborts = 0
        self.decode_aborts = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        d = self.descriptor
        logger.info("decode peer %s: %d pages; kv buffers %d (draft kv at %d, %d), state buffers %d (draft state "
                    "at %d, %d); layers %s; whole prompt %s", self.session_id, pages, d.kv_count, d.draft_kv_start,
                    d.draft_kv_count, d.state_count, d.draft_state_start, d.draft_state_count,
                    {p.part: p.layer_ids for p in d.parts}, whole_prompt)

    @property
    def session_id(self) -> str:
        return self.adapter.session_id

    # -- serving -------------------------------------------------------------
    def start(self) -> None:
        """Serve in a background thread."""
        t = threading.Thread(target=self.serve_forever, name="decode-peer", daemon=True)
        t.start()
        self._threads.append(t)

    def serve_forever(self) -> None:
        threading.Thread(target=self._reap_loop, name="decode-reaper", daemon=True).start()
        while not self._stop.is_set():
            try:
                conn = self.listener.accept()  # authenticated; a failed or silent challenge never gets here
            except OSError:  # the listener was closed
                return
            if self._stop.is_set():
                conn.close()
                return
            t = threading.Thread(target=self._serve_conn, args=(conn,), daemon=True)
            t.start()

    def _serve_conn(self, conn: Connection) -> None:
        channel = _Channel(conn)
        with conn:
            while not self._stop.is_set():
                try:
                    msg = recv_msg(conn)
                except (EOFError, OSError):
                    return
                except ValueError as exc:  # not JSON: refuse it, drop the connection
                    logger.warning("decode peer: %s; closing the connection", exc)
                    return
                try:
                    reply = self._handle(msg, channel)
                except Exception as exc:  # the one boundary: report to the caller, keep serving
                    logger.warning("decode peer: %s failed", msg.get("op"), exc_info=True)
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                reply["seq"] = msg.get("seq")
                if not channel.send(reply):
                    return
                if msg.get("op") == "shutdown":
                    return

    def _handle(self, msg: dict[str, Any], channel: _Channel) -> dict[str, Any]:
        op = msg.get("op")
        if op == "hello":
            return self._hello(msg)
        if op == "open":
            return self._open(msg, channel)
        if op == "done":
            return self._done(msg)
        if op == "abort":
            return self._abort(int(msg["room"]), f"aborted by prefill: {msg.get('reason')}", msg.get("rank"))
        if op == "cancel":
            self.decode_aborts += 1
            return self._abort(int(msg["room"]), f"cancelled by decode: {msg.get('reason')}", None)
        if op == "stats":
            with self._lock:
                draining = [r for r in self.rooms.values() if r.result is not None]
                return {"ok": True, "free_pages": self.allocator.free_pages,
                        "rooms": sorted(r.room_id for r in self.rooms.values() if r.result is None),
                        "draining": sorted(r.room_id for r in draining),
                        "draining_pages": sum(r.num_pages for r in draining),
                        "rejected": list(self.rejected), "verified_rooms": self.verified_rooms,
                        "checksum_units": self.checksum_units, "checksum_failures": self.checksum_failures,
                        "unknown_aborts": self.unknown_aborts, "decode_aborts": self.decode_aborts}
        if op == "shutdown":
            self._stop.set()
            self.listener.close()  # wakes serve_forever's accept
            return {"ok": True}
        raise ValueError(f"unknown op {op!r} (ops: hello, open, done, abort, cancel, stats, shutdown)")

    def _hello(self, msg: dict[str, Any]) -> dict[str, Any]:
        diffs = []
        for d in msg["descriptors"]:
            prefill = RegistrationDescriptor.from_dict(d)
            diffs += [(f"{prefill.tier} {what}", a, b) for what, a, b in differences(prefill, self.descriptor)]
        reply: dict[str, Any] = {"session": self.session_id, "descriptor": self.descriptor.to_dict(),
                                 "whole_prompt": self.whole_prompt}
        if diffs:
            text = "; ".join(f"{w}: prefill={a!r} decode={b!r}" for w, a, b in diffs)
            logger.warning("decode peer: registration mismatch from prefill rank %s: %s", msg.get("rank"), text)
            with self._lock:
                self.rejected.append(text)
            reply.update(ok=False, error=f"registration mismatch: {text}", differences=diffs)
        else:
            reply["ok"] = True
        return reply

    def pages_for(self, prompt_tokens: int) -> int:
        """Pages this side needs for a prompt: whole pages, plus the partial one if it asks for the whole prompt."""
        ps = self.layout.page_size
        return -(-prompt_tokens // ps) if self.whole_prompt else prompt_tokens // ps

    def _open(self, msg: dict[str, Any], channel: _Channel) -> dict[str, Any]:
        room_id, n, cp = int(msg["room"]), int(msg["num_pages"]), int(msg["cp_size"])
        rank = int(msg.get("rank", 0))
        if msg.get("prompt_tokens") is not None and self.pages_for(int(msg["prompt_tokens"])) != n:
            raise ValueError(f"room {room_id}: a prompt of {msg['prompt_tokens']} tokens needs exactly "
                             f"{self.pages_for(int(msg['prompt_tokens']))} pages here (whole prompt "
                             f"{self.whole_prompt}), prefill offered {n}")
        with self._lock:
            room = self.rooms.get(room_id)
            if room is not None:
                if (room.num_pages, room.cp_size, room.request_id) != (n, cp, int(msg["request"])):
                    raise ValueError(
                        f"room {room_id} opened with num_pages={room.num_pages} cp_size={room.cp_size} "
                        f"request={room.request_id}, now num_pages={n} cp_size={cp} request={msg['request']}")
                if room.result is not None:
                    return {"ok": False, "error": f"room {room_id} already failed: {room.result.get('error')}"}
                room.channels[rank] = channel
                return {"ok": True, "dst_pages": room.dst_pages.tolist()}
            pages = self.allocator.alloc(n)
            if pages is None:
                return {"ok": False, "error": f"decode peer out of pages: need {n}, free {self.allocator.free_pages}"}
            for part, view in self.views.items():
                view[:, pages, :] = POISON
            room = _DecodeRoom(room_id, int(msg["request"]), n, cp, pages,
                               time.monotonic() + float(msg["timeout_s"]))
            room.channels[rank] = channel
            self.rooms[room_id] = room
        logger.debug("decode peer: room %d open, %d pages", room_id, n)
        return {"ok": True, "dst_pages": pages.tolist()}

    def _done(self, msg: dict[str, Any]) -> dict[str, Any]:
        room_id, rank = int(msg["room"]), int(msg["rank"])
        with self._lock:
            room = self.rooms.get(room_id)
        if room is None:
            return {"ok": False, "error": f"room {room_id} is not open on the decode peer (aborted or timed out)"}
        with room.cond:
            if rank in room.dones:
                raise ValueError(f"room {room_id}: rank {rank} said done twice")
            room.quiet.add(rank)
            room.dones[rank] = (np.asarray(msg["positions"], dtype=np.int64),
                                np.asarray(msg["hashes"], dtype=np.uint64))
            if msg.get("digests") is not None:
                room.digests[rank] = list(msg["digests"])
            if msg.get("checksums") is not None:
                room.checksums[rank] = (list(msg.get("checksum_units") or []), str(msg["checksums"]))
            if len(room.dones) == room.cp_size and room.result is None:
                room.result = self._verify(room)
                room.cond.notify_all()
            while room.result is None:
                left = room.deadline - time.monotonic()
                if left <= 0:
                    room.result = {"ok": False, "error": f"decode: only ranks {sorted(room.dones)} of "
                                   f"{room.cp_size} said done before the deadline"}
                    room.free_at = time.monotonic() + self.drain_s
                    room.cond.notify_all()
                    break
                room.cond.wait(left)
            result = dict(room.result)
        self._maybe_free(room)
        return result

    def _reap_loop(self) -> None:
        """Abort rooms past their deadline (a prefill rank that died never says
        done or abort) and free aborted rooms whose drain ended."""
        while not self._stop.wait(REAP_INTERVAL_S):
            now = time.monotonic()
            with self._lock:
                rooms = list(self.rooms.values())
            for room in rooms:
                if room.result is None and room.deadline < now:
                    self._abort(room.room_id, "deadline passed on the decode side", None)
                else:
                    self._maybe_free(room)

    def _abort(self, room_id: int, reason: str, rank: Any) -> dict[str, Any]:
        """Fail the room now; tell every rank that may still write; free once they are quiet."""
        with self._lock:
            room = self.rooms.get(room_id)
            closed = room is None and room_id in self._closed_ids
        if room is None:
            if closed:
                logger.debug("decode peer: abort of closed room %d (%s)", room_id, reason)
            else:
                self.unknown_aborts += 1
                logger.warning("decode peer: abort of unknown room %d (%s); %d so far", room_id, reason,
                               self.unknown_aborts)
            return {"ok": True, "known": False}
        notify: list[tuple[int, _Channel]] = []
        with room.cond:
            if rank is not None:
                room.quiet.add(int(rank))
            if room.result is None:
                room.result = {"ok": False, "error": f"aborted: {reason}"}
                room.free_at = time.monotonic() + self.drain_s
                room.cond.notify_all()
                notify = [(r, c) for r, c in room.channels.items() if r not in room.quiet]
                logger.warning("decode peer: room %d aborted: %s", room_id, reason)
        for r, channel in notify:
            if not channel.send({"event": "abort", "room": room_id, "reason": reason}):
                logger.warning("decode peer: room %d: rank %d unreachable; its pages wait for the drain", room_id, r)
        self._maybe_free(room)
        return {"ok": True, "known": True}

    def _maybe_free(self, room: _DecodeRoom) -> None:
        """Free a concluded room's pages once no rank can write into them."""
        with room.cond:
            if room.result is None:
                return
            if len(room.quiet) < room.cp_size and (room.free_at is None or time.monotonic() < room.free_at):
                return
        with self._lock:
            if self.rooms.pop(room.room_id, None) is not None:
                self.allocator.free(room.dst_pages)
                self._closed_ids.append(room.room_id)
                if len(room.quiet) < room.cp_size:
                    logger.warning("decode peer: room %d freed after the %g s drain; ranks %s never said they "
                                   "stopped", room.room_id, self.drain_s,
                                   sorted(set(range(room.cp_size)) - room.quiet))

# -- verification --------------------------------------------------------
    def _verify(self, room: _DecodeRoom) -> dict[str, Any]:
        """Compare every position of every part and layer with integrity.content."""
        hashes = np.zeros(room.num_pages, dtype=np.uint64)
        seen = np.zeros(room.num_pages, dtype=np.int64)
        for pos, h in room.dones.values():
            if len(pos) != len(h) or (len(pos) and (pos.min() < 0 or pos.max() >= room.num_pages)):
                return {"ok": False, "error": f"room {room.room_id}: bad positions/hashes ({len(pos)}/{len(h)})"}
            hashes[pos] = h
            np.add.at(seen, pos, 1)
        missing = np.flatnonzero(seen == 0)
        doubled = np.flatnonzero(seen > 1)
        failed = self._verify_checksums(room)
        if failed is not None:
            return failed
        mismatches: list[integrity.Mismatch] = []
        count = 0
        if room.digests:
            count, mismatches = self._verify_digests(room)
        for p in self.layout.parts if not room.digests else ():
            for slot, layer in enumerate(p.layer_ids):
                actual = self.views[p.part][slot][room.dst_pages]
                expected = integrity.content(hashes, p.part, layer, p.page_bytes)
                bad = integrity.compare(actual, expected)
                count += len(bad)
                mismatches += [integrity.Mismatch(room.request_id, int(i), p.part.value, layer)
                               for i in bad[:max(0, MAX_REPORTED - len(mismatches))]]
        ok = count == 0 and not len(missing) and not len(doubled)
        self.verified_rooms += 1
        if not ok:
            logger.warning("decode peer: room %d request %d: %d mismatching page-layers, missing positions %s, "
                           "positions sent twice %s; first: %s", room.room_id, room.request_id, count,
                           missing[:16].tolist(), doubled[:16].tolist(), [str(m) for m in mismatches[:4]])
        return {"ok": ok, "mismatch_count": count, "mismatches": [str(m) for m in mismatches],
                "missing": missing.tolist(), "doubled": doubled.tolist(),
                "error": None if ok else f"verification failed: {count} mismatching page-layers, "
                                         f"{len(missing)} missing positions, {len(doubled)} sent twice"}

    def _verify_checksums(self, room: _DecodeRoom) -> dict[str, Any] | None:
        """The library's check (`hicache_cp.pd.verify`), before the byte oracle: every
        received page of every part and layer against the checksums prefill sent.
        The failed verdict, or None when every checksum matched (or none was sent)."""
        from hicache_cp.pd import verify as pd_verify

        failures: list[Any] = []
        units_checked = 0
        for rank, (units, text) in room.checksums.items():
            pos = room.dones[rank][0]
            try:
                sums = pd_verify.decode(text, len(units), len(pos))
                failures += pd_verify.check_received(self.layout, self.views, room.dst_pages, pos, units, sums)
            except ValueError as exc:
                return {"ok": False, "error": f"room {room.room_id}: checksums from rank {rank}: {exc}",
                        "mismatch_count": 0, "mismatches": []}
            units_checked += len(units) * len(pos)
        self.checksum_units += units_checked
        if not failures:
            return None
        self.checksum_failures += len(failures)
        self.verified_rooms += 1
        shown = [str(integrity.Mismatch(room.request_id, f.position, f.part, f.layer)) for f in failures[:MAX_REPORTED]]
        logger.warning("decode peer: room %d request %d: %d received (page, part, layer) units differ from the "
                       "checksums prefill sent (tier pd); first: %s", room.room_id, room.request_id, len(failures),
                       shown[:4])  # fmt: skip
        return {"ok": False, "mismatch_count": len(failures), "mismatches": shown, "checksum_failures": len(failures),
                "error": f"checksum check failed: {len(failures)} received (page, part, layer) units differ"}

    def _verify_digests(self, room: _DecodeRoom) -> tuple[int, list[integrity.Mismatch]]:
        """Every (position, part, layer) unit against the digests prefill recorded
        when it computed the page (`hicache_harness.engines.hf_oracle`)."""
        from hicache_harness.engines.hf_oracle import unit_digests

        import torch

        expected: dict[int, np.ndarray] = {}
        for rank, (pos, _) in room.dones.items():
            rows = room.digests.get(rank)
            if rows is None or len(rows) != len(pos):
                return 1, [integrity.Mismatch(room.request_id, -1, "digests", -1, rank)]
            expected.update({int(p): np.asarray(r, dtype=np.int64) for p, r in zip(pos, rows)})
        units = [(p, slot, layer) for p in self.layout.parts for slot, layer in enumerate(p.layer_ids)]
        count = 0
        mismatches: list[integrity.Mismatch] = []
        for u, (p, slot, layer) in enumerate(units):
            got = unit_digests(torch.from_numpy(np.ascontiguousarray(self.views[p.part][slot][room.dst_pages]))).numpy()
            for position, rows in expected.items():
                if not (rows[:, u] == got[position]).any():
                    count += 1
                    if len(mismatches) < MAX_REPORTED:
                        mismatches.append(integrity.Mismatch(room.request_id, position, p.part.value, layer))
        return count, mismatches

    # -- teardown ------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        self.listener.close()  # wakes serve_forever's accept
        if self._own_adapter:
            self.adapter.close()
        else:
            for a in self.arenas.values():
                self.adapter.unregister(a.ptr)
        self.views.clear()
        for a in self.arenas.values():
            a.close()


# -- process entry points ------------------------------------------------------
def run_decode_peer(layout: KVLayout, pages: int, authkey: bytes, ready: Connection | None = None,
                    whole_prompt: bool = False, drain_s: float = DEFAULT_DRAIN_S) -> None:
    """Process entry (under `lifetime.child_main`): serve until `shutdown` or
    termination; sends (address, session) on `ready`.

    Ctrl-C reaches the whole process group: the peer ignores SIGINT
    (`child_main`) and lets its parent stop it (`shutdown`, then terminate), so
    the parent never waits on a peer that is half torn down; it dies with its parent."""
    quiet_mooncake_logs()
    peer = DecodePeer(layout, pages, authkey=authkey, whole_prompt=whole_prompt, drain_s=drain_s)
    if ready is not None:
        ready.send({"address": peer.address, "session": peer.session_id})
        ready.close()
    try:
        peer.serve_forever()
    finally:
        peer.close()


def spawn_decode_peer(layout: KVLayout, pages: int, authkey: bytes, timeout_s: float = 60.0, *,
                      whole_prompt: bool = False,
                      drain_s: float = DEFAULT_DRAIN_S) -> tuple[mp.process.BaseProcess, tuple[str, int]]:
    """Start a decode peer in a spawned process; returns (process, control address).

    The start holds SIGINT and SIGTERM (`lifetime.start_processes`), and an
    interrupt or failure before the peer is ready stops it (SIGTERM, then
    SIGKILL): no peer outlives a start that did not return it."""
    check_authkey(authkey)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=lifetime.child_main,
                       args=(os.getpid(), run_decode_peer, layout, pages, authkey, child, whole_prompt, drain_s),
                       daemon=True, name="hicache-cp-decode-peer")  # fmt: skip
    try:
        lifetime.start_processes([proc])
        child.close()
        if not parent.poll(timeout_s):
            raise RuntimeError(f"decode peer did not start within {timeout_s} s (exit code {proc.exitcode})")
        info = parent.recv()
    except BaseException:
        lifetime.stop_processes([proc])
        raise
    finally:
        parent.close()
    return proc, tuple(info["address"])  # type: ignore[return-value]


def control_request(address: tuple[str, int], authkey: bytes, msg: dict[str, Any],
                    timeout_s: float = 10.0) -> dict[str, Any]:
    """One request on a fresh control connection (stats, cancel, shutdown)."""
    ctl = ControlClient(address, authkey)
    try:
        return ctl.request(msg, timeout_s)
    finally:
        ctl.close()


def shutdown_decode_peer(address: tuple[str, int], authkey: bytes, timeout_s: float = 10.0) -> None:
    control_request(address, authkey, {"op": "shutdown"}, timeout_s)


# -- CLI ---------------------------------------------------------------------------
def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """Model layout flags shared by decode-peer and bench-pd (defaults: DeepSeek-V3.2-like, 4 layers)."""
    g = parser.add_argument_group("layout")
    g.add_argument("--page-size", type=int, default=64)
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--kv-bytes", type=int, default=656, help="target KV bytes per token per layer")
    g.add_argument("--state-bytes", type=int, default=132, help="target NSA state bytes per token (0: none)")
    g.add_argument("--state-layers", type=str, default="0,2", help="comma-separated logical layer ids, or 'all'")
    g.add_argument("--draft-layers", type=int, default=1)
    g.add_argument("--draft-kv-bytes", type=int, default=656)
    g.add_argument("--draft-state-bytes", type=int, default=132)


def layout_from_args(args: argparse.Namespace) -> KVLayout:
    def ids(s: str) -> tuple[int, ...] | None:
        if s == "all":
            return None
        try:
            return tuple(int(x) for x in s.split(",") if x)
        except ValueError:
            raise InputError(f"--state-layers {s!r}: expected comma-separated layer ids or 'all'") from None

    try:
        layout = KVLayout.build(
            page_size=args.page_size, num_layers=args.num_layers, kv_bytes_per_token=args.kv_bytes,
            state_bytes_per_token=args.state_bytes, state_layers=ids(args.state_layers),
            draft_layers=args.draft_layers, draft_kv_bytes_per_token=args.draft_kv_bytes,
            draft_state_bytes_per_token=args.draft_state_bytes if args.draft_layers else 0)
        layout.check_aligned()  # what the prefill side's config refuses, refused here too
    except ValueError as exc:  # the layout flags describe no valid model
        raise InputError(f"layout: {exc}") from None
    return layout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_layout_arguments(parser)
    parser.add_argument("--pages", type=int, default=4096, help="destination pages per part")
    parser.add_argument("--port", type=int, default=0, help="control port on 127.0.0.1 (0: any)")
    parser.add_argument("--authkey-env", default="HICACHE_CP_PD_AUTHKEY",
                        help="environment variable holding the control channel's authkey (at least 32 bytes; "
                             "python -c 'import secrets; print(secrets.token_hex(32))')")
    parser.add_argument("--whole-prompt", action="store_true",
                        help="ask prefill for the partial last page of each prompt too")


def run(args: argparse.Namespace) -> int:
    checks.in_range("--pages", args.pages, 1, 1 << 24)
    checks.in_range("--port", args.port, 0, 65535)
    quiet_mooncake_logs(getattr(args, "verbose", 0))  # before Mooncake loads
    require("mooncake.engine", "pd", "decode-peer")
    key = os.environ.get(args.authkey_env)
    if not key:
        raise InputError(f"set {args.authkey_env} to the control channel's authkey "
                         f"(python -c 'import secrets; print(secrets.token_hex(32))')")
    try:
        authkey = check_authkey(key.encode())
    except ValueError as exc:
        raise InputError(f"{args.authkey_env}: {exc}") from None
    peer = DecodePeer(layout_from_args(args), args.pages, authkey=authkey, port=args.port,
                      whole_prompt=args.whole_prompt)
    print(f"decode-peer control {peer.address[0]}:{peer.address[1]} engine {peer.session_id}", flush=True)
    try:
        peer.serve_forever()  # until `shutdown`; SIGINT/SIGTERM unwind through here (130/143, `lifetime`)
    finally:
        peer.close()
    return 0
