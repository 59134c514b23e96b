"""`hicache-cp replay --pd`: the decode peer process and each rank's request sink.

The replay starts one decode peer process for the whole run (`start_decode_peer`,
in the parent; the peer is not CP and receives the full logical layout) and
each rank builds its sink once its cache exists (`make_sink`).

`PdSink` is the reference server's `RequestSink`: once a request is inserted
(and still locked), each page is sent from its current home: from L2 when its
host copy is committed (straight from the registered host arena, no
load-back and no device read), otherwise from L1. Positions are
request-absolute; with CP each rank sends only the pages it owns.
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing as mp
import os
from dataclasses import dataclass, field
from multiprocessing.connection import Client
from typing import Any

import numpy as np

from hicache_cp.cache import HiCache
from hicache_cp.config import Config
from hicache_cp.harness import lifetime
from hicache_cp.harness.decode_peer import run_decode_peer
from hicache_cp.harness.trace import TraceRequest
from hicache_cp.pd.sender import L1, L2, PageHomes, PdSender
from hicache_cp.radix import Node

logger = logging.getLogger(__name__)


def page_homes(cache: HiCache, node: Node, hashes: np.ndarray) -> PageHomes:
    """Where each page of the path root..node lives now (L2 preferred when committed)."""
    path: list[Node] = []
    n: Node | None = node
    while n is not None and n is not cache.tree.root:
        path.append(n)
        n = n.parent
    path.reverse()
    tiers, pages = [], []
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


@dataclass
class PdTotals:
    rooms: int = 0
    failed_rooms: int = 0
    pages: int = 0
    pages_from_l2: int = 0
    bytes: int = 0
    descriptors: int = 0
    mismatches: int = 0
    transfer_s: float = 0.0
    requests_without_pages: int = 0  # shorter than one page: nothing to send
    examples: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        gbps = self.bytes / self.transfer_s / 1e9 if self.transfer_s else 0.0
        return {
            "pd_rooms": self.rooms,
            "pd_failed_rooms": self.failed_rooms,
            "pd_pages": self.pages,
            "pd_pages_from_l2": self.pages_from_l2,
            "pd_bytes": self.bytes,
            "pd_descriptors": self.descriptors,
            "pd_gbps": round(gbps, 4),
            "pd_mismatches": self.mismatches,
            "pd_requests_without_pages": self.requests_without_pages,
            "pd_mismatch_examples": self.examples[:10],
        }


class PdSink:
    """Opens a room per request, sends every part and layer, waits once, tallies."""

    def __init__(self, sender: PdSender) -> None:
        self.sender = sender
        self.totals = PdTotals()

    def send_request(
        self, request: int, node: Node, hashes: np.ndarray, cache: HiCache, *, digests: list[np.ndarray] | None = None
    ) -> None:
        """`digests`: per page position, the digest rows [variants, units] the decode
        peer must find (the hf engine's real KV); None: `integrity.content` bytes."""
        if len(hashes) == 0:  # shorter than one page: no cached KV to ship (decode recomputes the tail)
            self.totals.requests_without_pages += 1
            return
        homes = page_homes(cache, node, hashes)
        mine = homes.positions % cache.cp_size == cache.rank
        self.sender.open_room(request, request, len(hashes))
        self.sender.send(request, homes)
        extra = None
        if digests is not None:
            extra = {"digests": [digests[int(p)] for p in np.flatnonzero(mine)]}
        result = self.sender.finish(request, extra=extra)
        t = self.totals
        t.rooms += 1
        t.pages += int(mine.sum())
        t.pages_from_l2 += int((homes.tier[mine] == L2).sum())
        t.bytes += result.nbytes
        t.descriptors += result.descriptors
        t.transfer_s += result.transfer_s
        if not result.ok:
            t.failed_rooms += 1
            t.mismatches += result.mismatch_count
            t.examples.extend(result.mismatches or [f"request {request}: {result.failure}"])
            logger.warning("pd: request %d failed: %s", request, result.failure)

    def close(self) -> None:
        self.sender.close()


@dataclass(frozen=True)
class PeerInfo:
    """What a rank needs to reach the decode peer (picklable)."""

    address: tuple[str, int]
    authkey: bytes


#: Bounds on the peer's start and on each step of its orderly stop (no wait is unbounded).
PEER_START_TIMEOUT_S = 60.0
PEER_STOP_TIMEOUT_S = 10.0


class DecodePeerProcess:
    def __init__(self, process: Any, info: PeerInfo) -> None:
        self.process = process
        self.rank_info = info

    def stop(self) -> dict[str, Any]:
        """Collect the peer's counters, shut it down, and return them. Every step
        is bounded; a peer that does not answer is stopped by signal."""
        try:
            stats = self._ask({"op": "stats", "seq": 0})
            self._ask({"op": "shutdown", "seq": 0})
            self.process.join(timeout=PEER_STOP_TIMEOUT_S)
        finally:
            self.terminate()
        return {
            "decode_verified_rooms": stats.get("verified_rooms"),
            "decode_rejected": stats.get("rejected"),
            "decode_open_rooms_at_exit": stats.get("rooms"),
        }

    def terminate(self) -> None:
        """Stop the peer by signal (after a failure or an interrupt): never waits on it."""
        lifetime.stop_processes([self.process])

    def _ask(self, message: dict[str, Any]) -> Any:
        if not self.process.is_alive():
            raise RuntimeError(f"decode peer (pid {self.process.pid}) exited with {self.process.exitcode}")
        with Client(self.rank_info.address, authkey=self.rank_info.authkey) as c:
            c.send(message)
            if not c.poll(PEER_STOP_TIMEOUT_S):
                raise TimeoutError(f"decode peer gave no answer to {message['op']!r} within {PEER_STOP_TIMEOUT_S} s")
            return c.recv()


def start_decode_peer(args: argparse.Namespace, config: Config, requests: list[TraceRequest]) -> DecodePeerProcess:
    # Rooms are served one request at a time; room for the two longest requests.
    longest = max((len(r.hash_ids) for r in requests), default=1)
    pages = 2 * longest * math.ceil((args.tokens_per_block or config.page_size) / config.page_size) + 2
    authkey = os.urandom(32)
    process, address = _spawn_peer(config.layout(), pages, authkey)
    return DecodePeerProcess(process, PeerInfo(address, authkey))


def _spawn_peer(layout: Any, pages: int, authkey: bytes) -> tuple[Any, tuple[str, int]]:
    """`decode_peer.run_decode_peer` in a spawned child tied to this process
    (`lifetime.child_main`: dies with it, leaves Ctrl-C to it)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=lifetime.child_main, args=(os.getpid(), run_decode_peer, layout, pages, authkey, child),
                       daemon=True, name="hicache-cp-decode-peer")  # fmt: skip
    try:
        lifetime.start_processes([proc])
        child.close()
        if not parent.poll(PEER_START_TIMEOUT_S):
            raise RuntimeError(f"decode peer did not start within {PEER_START_TIMEOUT_S} s (exit code {proc.exitcode})")
        info = parent.recv()
    except BaseException:
        lifetime.stop_processes([proc])
        raise
    finally:
        parent.close()
    return proc, tuple(info["address"])


def make_sink(info: PeerInfo, cache: HiCache) -> PdSink:
    sender = PdSender(
        cache.layout,
        cache.device_pool,
        cache.host_pool,
        decode_address=info.address,
        authkey=info.authkey,
        rank=cache.rank,
        cp_size=cache.cp_size,
    )
    return PdSink(sender)
