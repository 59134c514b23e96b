"""The decode peer: receives a request's pages and verifies every byte.

Runs in: its own process (``run_decode_peer`` under multiprocessing spawn,
or ``hicache-cp decode-peer``), or a thread of a test/bench process
(`DecodePeer.start`).

It owns destination buffers for the whole logical layout (per part
[slots, pages, page_bytes] in host arenas registered with its own
`TransferEngineAdapter`) and serves a control channel
(`multiprocessing.connection` on 127.0.0.1 with an authkey). Every request
is a dict with ``op`` and ``seq``; every reply echoes ``seq`` and has ``ok``:

    hello {rank, cp_size, descriptors: [prefill descriptor dicts]}
        -> {session, descriptor}; or ok=False with the differences (both sides'
           values); the rejection is also kept in `rejected` (see ``stats``).
    open {room, request, num_pages, cp_size, timeout_s}
        -> {dst_pages}: decode pages for positions 0..num_pages-1, contiguous
           when possible, poisoned (POISON) so stale bytes cannot pass.
           Every rank of the CP group opens the room; all get the same pages.
    done {room, rank, positions, hashes}
        -> blocks until all cp_size ranks said done (or the room's deadline),
           then verifies every position of every part and layer against
           `integrity.content` and replies {mismatches, mismatch_count,
           missing}. The room's pages are freed.
    abort {room, reason} -> frees the room's pages; waiting ``done`` calls fail.
        Rooms past their deadline are aborted the same way by a reaper thread
        (a prefill rank that died never sends done or abort).
    stats {} -> {free_pages, rooms, rejected, verified_rooms}
    shutdown {} -> stops serving.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import numpy as np

from hicache_cp.harness import checks, integrity
from hicache_cp.harness.errors import InputError, require
from hicache_cp.layout import KVLayout, Part
from hicache_cp.pd.engine import TransferEngineAdapter, quiet_mooncake_logs
from hicache_cp.pd.registration import RegistrationDescriptor, differences
from hicache_cp.pools import LanePageAllocator
from hostmem.arena import HostArena

logger = logging.getLogger(__name__)

__all__ = ["POISON", "DecodePeer", "add_arguments", "run", "run_decode_peer", "spawn_decode_peer"]

#: Byte written over a room's destination pages before it opens.
POISON = 0xA5
#: Seconds between scans for rooms past their deadline.
REAP_INTERVAL_S = 1.0
#: Mismatches listed in a reply (the count is always exact).
MAX_REPORTED = 64


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
    result: dict[str, Any] | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)


class DecodePeer:
    """Destination buffers + engine + control server for one decode endpoint."""

    def __init__(self, layout: KVLayout, pages: int, *, authkey: bytes, host: str = "127.0.0.1",
                 port: int = 0, adapter: TransferEngineAdapter | None = None) -> None:
        self.layout = layout
        self.pages = pages
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
        self._authkey = authkey
        self.listener = Listener((host, port), authkey=authkey)
        self.address: tuple[str, int] = self.listener.address  # type: ignore[assignment]
        self.rooms: dict[int, _DecodeRoom] = {}
        self.rejected: list[str] = []
        self.verified_rooms = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

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
                conn = self.listener.accept()
            except Exception as exc:  # a client that fails the authkey challenge must not stop the server
                if self._stop.is_set():
                    return
                logger.warning("decode peer: accept failed: %s", exc)
                continue
            if self._stop.is_set():
                conn.close()
                return
            t = threading.Thread(target=self._serve_conn, args=(conn,), daemon=True)
            t.start()

    def _serve_conn(self, conn: Connection) -> None:
        with conn:
            while not self._stop.is_set():
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    reply = self._handle(msg)
                except Exception as exc:  # the one boundary: report to the caller, keep serving
                    logger.warning("decode peer: %s failed", msg.get("op"), exc_info=True)
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                reply["seq"] = msg.get("seq")
                try:
                    conn.send(reply)
                except (OSError, EOFError):
                    return
                if msg.get("op") == "shutdown":
                    return

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "hello":
            return self._hello(msg)
        if op == "open":
            return self._open(msg)
        if op == "done":
            return self._done(msg)
        if op == "abort":
            return self._abort(int(msg["room"]), str(msg.get("reason", "aborted by prefill")))
        if op == "stats":
            with self._lock:
                return {"ok": True, "free_pages": self.allocator.free_pages, "rooms": sorted(self.rooms),
                        "rejected": list(self.rejected), "verified_rooms": self.verified_rooms}
        if op == "shutdown":
            self._stop.set()
            threading.Thread(target=self._wake_accept, daemon=True).start()
            return {"ok": True}
        raise ValueError(f"unknown op {op!r} (ops: hello, open, done, abort, stats, shutdown)")

    def _hello(self, msg: dict[str, Any]) -> dict[str, Any]:
        diffs = []
        for d in msg["descriptors"]:
            prefill = RegistrationDescriptor.from_dict(d)
            diffs += [(f"{prefill.tier} {what}", a, b) for what, a, b in differences(prefill, self.descriptor)]
        reply: dict[str, Any] = {"session": self.session_id, "descriptor": self.descriptor.to_dict()}
        if diffs:
            text = "; ".join(f"{w}: prefill={a!r} decode={b!r}" for w, a, b in diffs)
            logger.warning("decode peer: registration mismatch from prefill rank %s: %s", msg.get("rank"), text)
            with self._lock:
                self.rejected.append(text)
            reply.update(ok=False, error=f"registration mismatch: {text}", differences=diffs)
        else:
            reply["ok"] = True
        return reply

    def _open(self, msg: dict[str, Any]) -> dict[str, Any]:
        room_id, n, cp = int(msg["room"]), int(msg["num_pages"]), int(msg["cp_size"])
        with self._lock:
            room = self.rooms.get(room_id)
            if room is not None:
                if (room.num_pages, room.cp_size, room.request_id) != (n, cp, int(msg["request"])):
                    raise ValueError(
                        f"room {room_id} opened with num_pages={room.num_pages} cp_size={room.cp_size} "
                        f"request={room.request_id}, now num_pages={n} cp_size={cp} request={msg['request']}")
                return {"ok": True, "dst_pages": room.dst_pages.tolist()}
            pages = self.allocator.alloc(n)
            if pages is None:
                return {"ok": False, "error": f"decode peer out of pages: need {n}, free {self.allocator.free_pages}"}
            for part, view in self.views.items():
                view[:, pages, :] = POISON
            self.rooms[room_id] = _DecodeRoom(room_id, int(msg["request"]), n, cp, pages,
                                              time.monotonic() + float(msg["timeout_s"]))
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
            room.dones[rank] = (np.asarray(msg["positions"], dtype=np.int64),
                                np.asarray(msg["hashes"], dtype=np.uint64))
            if msg.get("digests") is not None:
                room.digests[rank] = list(msg["digests"])
            if len(room.dones) == room.cp_size and room.result is None:
                room.result = self._verify(room)
                self._close_room(room)
                room.cond.notify_all()
            while room.result is None:
                left = room.deadline - time.monotonic()
                if left <= 0:
                    room.result = {"ok": False, "error": f"decode: only ranks {sorted(room.dones)} of "
                                   f"{room.cp_size} said done before the deadline"}
                    self._close_room(room)
                    room.cond.notify_all()
                    break
                room.cond.wait(left)
            return dict(room.result)

    def _reap_loop(self) -> None:
        """Free rooms past their deadline (a prefill rank that died never says done or abort)."""
        while not self._stop.wait(REAP_INTERVAL_S):
            now = time.monotonic()
            with self._lock:
                expired = [r for r in self.rooms.values() if r.deadline < now]
            for room in expired:
                self._abort(room.room_id, "deadline passed on the decode side")

    def _abort(self, room_id: int, reason: str) -> dict[str, Any]:
        with self._lock:
            room = self.rooms.get(room_id)
        if room is None:
            return {"ok": True}
        with room.cond:
            if room.result is None:
                room.result = {"ok": False, "error": f"aborted: {reason}"}
                self._close_room(room)
                room.cond.notify_all()
        logger.warning("decode peer: room %d aborted: %s", room_id, reason)
        return {"ok": True}

    def _close_room(self, room: _DecodeRoom) -> None:
        with self._lock:
            if self.rooms.pop(room.room_id, None) is not None:
                self.allocator.free(room.dst_pages)

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

    def _verify_digests(self, room: _DecodeRoom) -> tuple[int, list[integrity.Mismatch]]:
        """Every (position, part, layer) unit against the digests prefill recorded
        when it computed the page (`hicache_cp.harness.engines.hf_oracle`)."""
        from hicache_cp.harness.engines.hf_oracle import unit_digests

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
    def _wake_accept(self) -> None:
        """Unblock `listener.accept()` so serve_forever sees the stop flag."""
        try:
            Client(self.address, authkey=self._authkey).close()
        except Exception:  # the listener may already be closed
            pass

    def close(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._wake_accept()
        try:
            self.listener.close()
        except OSError:
            pass
        if self._own_adapter:
            self.adapter.close()
        else:
            for a in self.arenas.values():
                self.adapter.unregister(a.ptr)
        self.views.clear()
        for a in self.arenas.values():
            a.close()


# -- process entry points ------------------------------------------------------
def run_decode_peer(layout: KVLayout, pages: int, authkey: bytes, ready: Connection | None = None) -> None:
    """Process entry: serve until `shutdown` or termination; sends (address, session) on `ready`."""
    quiet_mooncake_logs()
    peer = DecodePeer(layout, pages, authkey=authkey)
    if ready is not None:
        ready.send({"address": peer.address, "session": peer.session_id})
        ready.close()
    try:
        peer.serve_forever()
    finally:
        peer.close()


def spawn_decode_peer(layout: KVLayout, pages: int, authkey: bytes,
                      timeout_s: float = 60.0) -> tuple[mp.process.BaseProcess, tuple[str, int]]:
    """Start a decode peer in a spawned process; returns (process, control address)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_decode_peer, args=(layout, pages, authkey, child), daemon=True,
                       name="hicache-cp-decode-peer")
    proc.start()
    child.close()
    if not parent.poll(timeout_s):
        proc.terminate()
        raise RuntimeError(f"decode peer did not start within {timeout_s} s (exit code {proc.exitcode})")
    info = parent.recv()
    return proc, tuple(info["address"])  # type: ignore[return-value]


def shutdown_decode_peer(address: tuple[str, int], authkey: bytes) -> None:
    with Client(address, authkey=authkey) as c:
        c.send({"op": "shutdown", "seq": 0})
        c.recv()


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
        return KVLayout.build(
            page_size=args.page_size, num_layers=args.num_layers, kv_bytes_per_token=args.kv_bytes,
            state_bytes_per_token=args.state_bytes, state_layers=ids(args.state_layers),
            draft_layers=args.draft_layers, draft_kv_bytes_per_token=args.draft_kv_bytes,
            draft_state_bytes_per_token=args.draft_state_bytes if args.draft_layers else 0)
    except ValueError as exc:  # the layout flags describe no valid model
        raise InputError(f"layout: {exc}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_layout_arguments(parser)
    parser.add_argument("--pages", type=int, default=4096, help="destination pages per part")
    parser.add_argument("--port", type=int, default=0, help="control port on 127.0.0.1 (0: any)")
    parser.add_argument("--authkey-env", default="HICACHE_CP_PD_AUTHKEY",
                        help="environment variable holding the control channel's authkey")


def run(args: argparse.Namespace) -> int:
    checks.in_range("--pages", args.pages, 1, 1 << 24)
    checks.in_range("--port", args.port, 0, 65535)
    quiet_mooncake_logs(getattr(args, "verbose", 0))  # before Mooncake loads
    require("mooncake.engine", "pd", "decode-peer")
    key = os.environ.get(args.authkey_env)
    if not key:
        raise InputError(f"set {args.authkey_env} to the control channel's authkey")
    peer = DecodePeer(layout_from_args(args), args.pages, authkey=key.encode(), port=args.port)
    print(f"decode-peer control {peer.address[0]}:{peer.address[1]} engine {peer.session_id}", flush=True)
    try:
        peer.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        peer.close()
    return 0
