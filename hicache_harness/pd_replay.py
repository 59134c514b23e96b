"""`hicache-cp replay --pd`: the decode peer process and each rank's request sink.

The replay starts one decode peer process for the whole run (`start_decode_peer`,
in the parent; the peer is not CP and receives the full logical layout) and
each rank builds its sink once its cache exists (`make_sink`).

`PdSink` is the reference server's `RequestSink`. Each page is sent from its
current home: from L2 when its host copy is committed (straight from the
registered host arena, no load-back and no device read), otherwise from L1.
Positions are request-absolute; with CP each rank sends only the pages it
owns, and the ranks agree on each room's outcome (one MIN collective).

Two ways to send (`Config.pd_per_layer`):

* after insert (default): the engine calls `send_request` once the request
  is inserted (and still locked); every part and layer goes at once.
* per layer: the engine calls `begin_request` before the forward (the room
  opens, each page's home is known) and `on_layer_end(model, layer)` from the
  same hooks as the backups, target and draft hooks separately; each call
  submits that layer of that model's parts, off the forward's thread once
  the layer is complete (a CUDA event on GPU). `send_request` then only
  waits and says "done".

Either way the sink measures, per room, the time from the forward's end (its
last layer hook) to every byte landed at the decode peer (`pd_ready_s_*`).

The partial last page (the tokens after the last whole page) is not cached
on prefill: the radix tree and L2 hold whole pages only (a partial page's
content changes as the prompt grows, so it can never be matched). When the
decode peer asks for the whole prompt, the engine computes that page into a
scratch L1 page for the request (`TailPage`), the sink sends it as the
room's last position, and the engine frees it after.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache_cp.cache import HiCache
from hicache_cp.config import Config
from hicache_harness import lifetime
from hicache_harness.decode_peer import control_request, spawn_decode_peer
from hicache_harness.engines.synthetic import TailPage
from hicache_harness.trace import TraceRequest
from hicache_cp.layout import Model
from hicache_cp.match import MatchResult
from hicache_cp.pd.control import new_authkey
from hicache_cp.pd.room import RoomFailed, RoomState
from hicache_cp.pd.sender import L1, L2, PageHomes, PdSender
from hicache_cp.radix import Node

logger = logging.getLogger(__name__)

#: Seconds the parent waits for the decode peer's stats, its shutdown and its exit, each.
STOP_TIMEOUT_S = 10.0


def page_homes(cache: HiCache, node: Node, hashes: np.ndarray) -> PageHomes:
    """Where each page of the path root..node lives now (L2 preferred when committed)."""
    path: list[Node] = []
    n: Node | None = node
    while n is not None and n is not cache.tree.root:
        path.append(n)
        n = n.parent
    path.reverse()
    tiers, pages = [np.empty(0, np.int8)], [np.empty(0, np.int64)]
    for n in path:
        if n.host_visible:
            tiers.append(np.full(n.num_pages, L2, np.int8))
            pages.append(n.host_pages)
        elif n.on_device:
            if n.stale_load is not None:
                raise ValueError(f"{n}: its L1 pages await recompute after an aborted load, and no host copy is committed")
            tiers.append(np.full(n.num_pages, L1, np.int8))
            pages.append(n.device_pages)
        else:
            raise ValueError(f"{n} holds no copy of its pages; the request must keep its path locked")
    count = sum(n.num_pages for n in path)
    if count != len(hashes):
        raise ValueError(f"request path has {count} pages but {len(hashes)} hashes were given")
    return PageHomes(np.arange(count), np.concatenate(tiers), np.concatenate(pages), hashes)


def _with_tail(homes: PageHomes, tail: TailPage | None) -> PageHomes:
    if tail is None:
        return homes
    return homes.concat(PageHomes([len(homes)], [L1], [tail.page], [tail.prefix_hash]))


def homes_before_insert(cache: HiCache, m: MatchResult, new: np.ndarray, hashes: np.ndarray,
                        tail: TailPage | None = None) -> PageHomes:
    """Homes of a request's pages during its forward: the matched prefix where it
    lives (L2 when committed, so a page being loaded is sent from L2), then the
    new pages in L1, then the partial last page."""
    start = m.matched_pages
    prefix = page_homes(cache, m.last_node, hashes[:start])
    fresh = PageHomes(np.arange(start, start + len(new)), np.full(len(new), L1), new, hashes[start:start + len(new)])
    return _with_tail(prefix.concat(fresh), tail)


@dataclass
class PdTotals:
    rooms: int = 0
    failed_rooms: int = 0
    pages: int = 0
    pages_from_l2: int = 0
    tail_pages: int = 0
    bytes: int = 0
    descriptors: int = 0
    mismatches: int = 0
    transfer_s: float = 0.0
    requests_without_pages: int = 0  # shorter than one page: nothing to send
    decode_aborts: int = 0
    abandoned_rooms: int = 0  # per-layer rooms aborted because the engine recomputes the request
    timeout_s: float = 0.0  # the rooms' deadline (Config.pd_timeout_s)
    per_layer: bool = False
    ready_s: list[float] = field(default_factory=list)  # per room: forward's end -> all KV at decode
    examples: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        gbps = self.bytes / self.transfer_s / 1e9 if self.transfer_s else 0.0
        ready = sorted(self.ready_s)
        out: dict[str, object] = {
            "pd_rooms": self.rooms,
            "pd_failed_rooms": self.failed_rooms,
            "pd_pages": self.pages,
            "pd_pages_from_l2": self.pages_from_l2,
            "pd_tail_pages": self.tail_pages,
            "pd_bytes": self.bytes,
            "pd_descriptors": self.descriptors,
            "pd_gbps": round(gbps, 4),
            "pd_mismatches": self.mismatches,
            "pd_requests_without_pages": self.requests_without_pages,
            "pd_decode_aborts": self.decode_aborts,
            "pd_abandoned_rooms": self.abandoned_rooms,
            "pd_timeout_s": self.timeout_s,
            "pd_per_layer": self.per_layer,
            "pd_ready_rooms": len(ready),
            "pd_mismatch_examples": self.examples[:10],
        }
        if ready:
            out.update(pd_ready_s_p50=round(statistics.median(ready), 6),
                       pd_ready_s_p90=round(ready[min(len(ready) - 1, int(0.9 * len(ready)))], 6),
                       pd_ready_s_mean=round(statistics.fmean(ready), 6))
        return out


@dataclass
class _Pending:
    """A request whose room opened before its forward (per-layer, or timed)."""

    request: int
    homes: PageHomes
    tail: TailPage | None
    layers_left: int  # hooks until the forward's end
    last_event: Any = None  # the last hook's CUDA event (the forward's end on the device)


class PdSink:
    """Opens a room per request, sends every part and layer, waits once, tallies."""

    def __init__(self, sender: PdSender, cache: HiCache, *, per_layer: bool = False) -> None:
        self.sender = sender
        self.cache = cache
        self.per_layer = per_layer
        self.totals = PdTotals(timeout_s=sender.rooms.timeout_s, per_layer=per_layer)
        self._pending: dict[int, _Pending] = {}  # requests whose forward is running (per-layer, or timed)
        self._cuda = bool(cache.device_pool.is_cuda)
        self._total_layers = sum(cache.layout.num_layers(m) for m in (Model.TARGET, Model.DRAFT))

    @property
    def whole_prompt(self) -> bool:
        """The decode side asks for the partial last page too."""
        return self.sender.whole_prompt

    # -- per-layer path: called by the engine around its forward ----------------------
    def begin_request(self, request: int, m: MatchResult, new: np.ndarray, hashes: np.ndarray,
                      tail: TailPage | None = None) -> None:
        """Before the forward: open the room (decode allocates), record each page's home."""
        homes = homes_before_insert(self.cache, m, new, hashes, tail)
        if len(homes) == 0:
            return
        self._pending[request] = _Pending(request, homes, tail, self._total_layers)
        try:
            self._open(request, len(hashes), tail)
        except Exception as exc:  # the room is FAILED; `send_request` tallies it (and runs the CP vote)
            logger.warning("pd: request %d: open failed: %s", request, exc)

    def on_layer_end(self, model: Model, layer: int) -> None:
        """The forward finished `layer` of `model` (called beside `HiCache.on_layer_end`)."""
        if not self._pending:
            return
        after = self._event()
        for p in self._pending.values():
            self._layer_end(p, model, layer, after)

    def _layer_end(self, p: _Pending, model: Model, layer: int, after: Any) -> None:
        room = self.sender.rooms.get(p.request)
        if self.per_layer and room.state is RoomState.TRANSFERRING:
            keys = [(part.part, layer) for part in self.cache.layout.parts_of(model) if part.has_layer(layer)]
            try:  # one submission: this layer of every part of `model`
                self.sender.send_layers(p.request, keys, p.homes, after=after, background=True)
            except RoomFailed:
                pass  # the room failed (decode abort, deadline): `send_request` tallies it
        p.layers_left -= 1
        p.last_event = after
        if p.layers_left == 0:
            self.sender.mark_forward_end(p.request, after=after)

    def _event(self) -> Any:
        if not self._cuda:
            return None
        import torch

        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _open(self, request: int, num_full: int, tail: TailPage | None) -> None:
        tokens = num_full * self.cache.layout.page_size + (tail.tokens if tail is not None else 0)
        self.sender.open_room(request, request, num_full + (1 if tail is not None else 0), prompt_tokens=tokens)

    # -- after insert ------------------------------------------------------------------
    def send_request(
        self, request: int, node: Node, hashes: np.ndarray, cache: HiCache, *,
        digests: list[np.ndarray] | None = None, tail: TailPage | None = None,
    ) -> None:
        """Called after insert, while `node` is locked. `digests`: per page position,
        the digest rows [variants, units] the decode peer must find (the hf engine's
        real KV); None: `integrity.content` bytes."""
        pending = self._pending.pop(request, None)
        if len(hashes) == 0 and tail is None:  # shorter than one page, no tail asked for: nothing to ship
            self.totals.requests_without_pages += 1
            return
        if self.per_layer and pending is not None:
            homes = pending.homes  # what the layer hooks sent (homes before insert), for honest counts
        else:
            homes = _with_tail(page_homes(cache, node, hashes), tail)
        mine = homes.positions % cache.cp_size == cache.rank
        aborts_before = self.sender.decode_aborts
        if pending is None:
            try:
                self._open(request, len(hashes), tail)
            except Exception as exc:  # a refused open fails the room; the CP vote still runs in finish
                logger.warning("pd: request %d: open failed: %s", request, exc)
        room = self.sender.rooms.get(request)
        if not (self.per_layer and pending is not None) and room.state is RoomState.TRANSFERRING:
            if pending is not None and pending.last_event is not None:
                pending.last_event.synchronize()  # the forward's KV is complete on the device before it is read
            try:
                self.sender.send(request, homes)
            except RoomFailed:
                pass  # tallied from the result below
        extra = None
        if digests is not None:
            extra = {"digests": [np.asarray(digests[int(p)]).tolist() for p in np.flatnonzero(mine)]}
        result = self.sender.finish(request, extra=extra)
        t = self.totals
        t.rooms += 1
        t.decode_aborts += self.sender.decode_aborts - aborts_before
        t.pages += int(mine.sum())
        t.pages_from_l2 += int((homes.tier[mine] == L2).sum())
        t.tail_pages += int(tail is not None and bool(mine[-1]))
        t.bytes += result.nbytes
        t.descriptors += result.descriptors
        t.transfer_s += result.transfer_s
        if result.ready_s is not None:
            t.ready_s.append(result.ready_s)
        if not result.ok:
            t.failed_rooms += 1
            t.mismatches += result.mismatch_count
            t.examples.extend(result.mismatches or [f"request {request}: {result.failure}"])
            logger.warning("pd: request %d failed: %s", request, result.failure)
        self.sender.poll()  # decode aborts, deadlines, drained rooms (released and announced)
        if self.sender.rooms.get(request).released:
            self.sender.rooms.forget(request)

    def abandon(self, request: int, reason: str) -> None:
        """The request's forward is void (the engine recomputes it): abort its room
        (drained before its pages are released); it opens a new one when it runs again."""
        if self._pending.pop(request, None) is None:
            return
        self.sender.abort(request, reason)
        self.sender.finish(request)  # concluded (FAILED) on this side
        self.totals.abandoned_rooms += 1
        if self.sender.rooms.get(request).released:
            self.sender.rooms.forget(request)

    def close(self) -> None:
        self.sender.close()


@dataclass(frozen=True)
class PeerInfo:
    """What a rank needs to reach the decode peer (picklable)."""

    address: tuple[str, int]
    authkey: bytes


class DecodePeerProcess:
    def __init__(self, process: Any, info: PeerInfo) -> None:
        self.process = process
        self.rank_info = info

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> dict[str, Any]:
        """Collect the peer's counters, shut it down, and return them.

        Every wait is bounded (an interrupted run must not hang on a peer that
        got the signal too): the control calls run on a helper thread, then
        join, terminate and kill, each with `timeout_s`."""
        stats: dict[str, Any] = {}

        def ask() -> None:
            addr, key = self.rank_info.address, self.rank_info.authkey
            stats.update(control_request(addr, key, {"op": "stats"}, timeout_s))
            control_request(addr, key, {"op": "shutdown"}, timeout_s)

        if self.process.is_alive():
            t = threading.Thread(target=self._quietly, args=(ask,), daemon=True, name="decode-peer-stop")
            t.start()
            t.join(2 * timeout_s)
        self.process.join(timeout_s)
        for stop in (self.process.terminate, self.process.kill):
            if not self.process.is_alive():
                break
            stop()
            self.process.join(timeout_s)
        if not stats:
            logger.warning("decode peer: no stats at shutdown (exit code %s)", self.process.exitcode)
        return {
            "decode_verified_rooms": stats.get("verified_rooms"),
            "decode_checksum_units": stats.get("checksum_units"),  # the library's check (pd.verify)
            "decode_checksum_failures": stats.get("checksum_failures"),
            "decode_rejected": stats.get("rejected"),
            "decode_open_rooms_at_exit": stats.get("rooms"),
            "decode_draining_rooms_at_exit": stats.get("draining"),
            "decode_unknown_aborts": stats.get("unknown_aborts"),
        }

    def terminate(self) -> None:
        """Stop the peer by signal after a failure or an interrupt: no control
        calls, never waits on it past `lifetime.STOP_GRACE_S` (then SIGKILL)."""
        lifetime.stop_processes([self.process])

    @staticmethod
    def _quietly(fn: Any) -> None:
        try:
            fn()
        except (OSError, EOFError, TimeoutError, ValueError) as exc:
            logger.warning("decode peer: stop: %s: %s", type(exc).__name__, exc)


def start_decode_peer(args: argparse.Namespace, config: Config, requests: list[TraceRequest]) -> DecodePeerProcess:
    # Rooms are served one request at a time; room for the two longest requests (and their tails).
    longest = max((len(r.hash_ids) for r in requests), default=1)
    pages = 2 * longest * math.ceil((args.tokens_per_block or config.page_size) / config.page_size) + 4
    authkey = new_authkey()
    engine = getattr(args, "engine", None) or "synthetic"
    whole_prompt = engine == "synthetic"  # the hf engine computes and sends whole pages only
    process, address = spawn_decode_peer(config.layout(), pages, authkey, whole_prompt=whole_prompt)
    return DecodePeerProcess(process, PeerInfo(address, authkey))


def make_sink(info: PeerInfo, cache: HiCache) -> PdSink:
    config = cache.config
    sender = PdSender(
        cache.layout,
        cache.device_pool,
        cache.host_pool,
        decode_address=info.address,
        authkey=info.authkey,
        rank=cache.rank,
        cp_size=cache.cp_size,
        timeout_s=config.pd_timeout_s,
        agreement=cache.agreement if cache.cp_size > 1 else None,
    )
    sender.connect()
    return PdSink(sender, cache, per_layer=config.pd_per_layer)
