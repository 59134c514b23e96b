"""`hicache-cp replay --pd`: the decode peer process and each rank's sink.

`hicache_cp.launch` calls `start_decode_peer` in the parent (one decode peer
process for the whole run; it is not CP and receives the full logical
layout) and `make_sink` in every rank process once its cache exists.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from multiprocessing.connection import Client
from typing import Any

from hicache_cp.cache import HiCache
from hicache_cp.config import Config
from hicache_cp.pd.decode_peer import shutdown_decode_peer, spawn_decode_peer
from hicache_cp.pd.sender import PdSender
from hicache_cp.pd.sink import PdSink
from hicache_cp.trace import TraceRequest


@dataclass(frozen=True)
class PeerInfo:
    """What a rank needs to reach the decode peer (picklable)."""

    address: tuple[str, int]
    authkey: bytes


class DecodePeerProcess:
    def __init__(self, process: Any, info: PeerInfo) -> None:
        self.process = process
        self.rank_info = info

    def stop(self) -> dict[str, Any]:
        """Collect the peer's counters, shut it down, and return them."""
        with Client(self.rank_info.address, authkey=self.rank_info.authkey) as c:
            c.send({"op": "stats", "seq": 0})
            stats = c.recv()
        shutdown_decode_peer(self.rank_info.address, self.rank_info.authkey)
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
        return {
            "decode_verified_rooms": stats.get("verified_rooms"),
            "decode_rejected": stats.get("rejected"),
            "decode_open_rooms_at_exit": stats.get("rooms"),
        }


def start_decode_peer(args: argparse.Namespace, config: Config, requests: list[TraceRequest]) -> DecodePeerProcess:
    # Rooms are served one request at a time; room for the two longest requests.
    longest = max((len(r.hash_ids) for r in requests), default=1)
    pages = 2 * longest * math.ceil((args.tokens_per_block or config.page_size) / config.page_size) + 2
    authkey = os.urandom(16)
    process, address = spawn_decode_peer(config.layout(), pages, authkey)
    return DecodePeerProcess(process, PeerInfo(address, authkey))


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
