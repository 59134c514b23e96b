"""A prefix-aware router that reads KV events, in front of reference-server instances.

What KV-aware routers (SGLang's router, Dynamo, llm-d, vLLM's production
stack) do, reduced to its rule: keep, per instance, the set of block hashes
each medium holds, rebuilt from the instance's KV events as it publishes
them (engine format, msgpack on the wire, decoded with the engine's own
batch class); send a request to the instance holding the longest prefix of
its blocks in the media the router reads; on a tie, to the instance that
was sent fewer requests (then the lower index).

`compare(requests, config, fmt)` serves the same requests on two fresh pairs
of instances: one routed on the GPU tier's events only (what a router sees
of a server without host-tier events), one on the GPU and host tiers (what
hicache-cp's events add), and reports where their prompt tokens came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from hicache_cp.cache import HiCache
from hicache_cp.config import Config
from hicache_cp.events import EventLog, Medium
from hicache_harness.engines.synthetic import ReferenceServer
from hicache_harness.kv_events import EngineFormat


@dataclass
class PrefixIndex:
    """One instance's blocks per medium (the engine's medium names), from its events."""

    held: dict[str, set[Any]] = field(default_factory=dict)

    def apply(self, events: Sequence[Any]) -> None:
        for ev in events:
            name = type(ev).__name__
            if name == "AllBlocksCleared":
                self.held.clear()
            elif name == "BlockStored":
                self.held.setdefault(ev.medium, set()).update(ev.block_hashes)
            elif name == "BlockRemoved":
                self.held.get(ev.medium, set()).difference_update(ev.block_hashes)

    def prefix(self, keys: Sequence[Any], media: Sequence[str]) -> int:
        """How many of `keys`, from the first, some medium of `media` holds."""
        sets = [self.held.get(m, set()) for m in media]
        n = 0
        for k in keys:
            if not any(k in s for s in sets):
                break
            n += 1
        return n


@dataclass
class Instance:
    cache: HiCache
    server: ReferenceServer
    log: EventLog
    index: PrefixIndex = field(default_factory=PrefixIndex)
    routed: int = 0


class Router:
    """Routes on the media `media` of every instance's events (see the module docstring)."""

    def __init__(self, config: Config, fmt: EngineFormat, media: Sequence[Medium], instances: int = 2) -> None:
        self.fmt = fmt
        self.media = [fmt.media[m] for m in media]
        self.instances: list[Instance] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(type=fmt.batch_type)
        for _ in range(instances):
            cache = HiCache(config)
            log = EventLog(fmt.keyer)
            cache.attach_events(log)
            self.instances.append(Instance(cache, ReferenceServer(cache), log))
            self._deliver(self.instances[-1])

    def serve(self, request: int, tokens: np.ndarray) -> int:
        """Route and serve one request; returns the instance's index."""
        ps = self.instances[0].cache.layout.page_size
        whole = tokens[: len(tokens) // ps * ps]
        keys = [self.fmt.wire_key(k) for k in self.fmt.keyer.chain(None, whole, ps)] if len(whole) else []
        best = max(range(len(self.instances)),
                   key=lambda i: (self.instances[i].index.prefix(keys, self.media), -self.instances[i].routed, -i))
        inst = self.instances[best]
        inst.routed += 1
        inst.server.serve(request, tokens)
        self._deliver(inst)
        return best

    def _deliver(self, inst: Instance) -> None:
        """The instance's events since the last delivery, through the wire format, into its index."""
        events = inst.log.take()
        if events:
            payload = self._encoder.encode(self.fmt.batch(0.0, self.fmt.encode_all(events)))
            inst.index.apply(self._decoder.decode(payload).events)

    def totals(self) -> dict[str, Any]:
        for inst in self.instances:
            inst.cache.drain()
        stats = [inst.cache.stats() for inst in self.instances]
        out: dict[str, Any] = {k: sum(int(s[k]) for s in stats)  # type: ignore[call-overload]
                               for k in ("prompt_tokens", "l1_hit_tokens", "l2_hit_tokens", "miss_tokens")}  # fmt: skip
        out["routed"] = [inst.routed for inst in self.instances]
        out["integrity_mismatches"] = sum(inst.server.integrity.mismatches for inst in self.instances)
        return out

    def close(self) -> None:
        for inst in self.instances:
            inst.cache.close()


def compare(requests: Sequence[np.ndarray], config: Config, fmt: EngineFormat, instances: int = 2) -> dict[str, Any]:
    """The same requests routed on GPU-tier events only, then on GPU and host events."""
    out: dict[str, Any] = {}
    for name, media in (("gpu_events", [Medium.DEVICE]), ("gpu_and_host_events", [Medium.DEVICE, Medium.HOST])):
        router = Router(config, fmt, media, instances)
        try:
            for i, tokens in enumerate(requests):
                router.serve(i, tokens)
            out[name] = router.totals()
        finally:
            router.close()
    return out
