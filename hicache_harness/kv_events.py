"""`replay --kv-events ENDPOINT [--kv-events-format sglang|vllm]`: the cache's KV events over ZMQ.

The replay's cache gets an event log (`hicache_cp.events`) keyed the way the
chosen engine keys its blocks; after every request its events are encoded
with the engine's own event classes (`integrations/sglang/events`,
`integrations/vllm/events`) into one batch and published in the framing
both engines' publishers use: a PUB socket, three frames per batch (topic,
8-byte big-endian sequence number, the msgpack of the engine's
`KVEventBatch`). A subscriber decodes them with the engine's own decoder.

The endpoint is bound here and must be tcp on a loopback address
(`tcp://127.0.0.1:5557`): the harness never listens beyond this machine.
Under CP every rank's tree is the same, so rank 0 publishes.

`residency(cache, fmt)` is the oracle the tests and the report use: what each
tier of the cache holds, keyed and encoded independently of the log.
"""

from __future__ import annotations

import hashlib
import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache_cp.cache import HiCache
from hicache_cp.events import BlockKeyer, Event, EventLog, Medium
from hicache_harness.errors import InputError
from hicache_cp.radix import HostState

FORMATS = ("sglang", "vllm")


@dataclass(frozen=True)
class EngineFormat:
    """One engine's keys, encoding and batch class."""

    name: str
    keyer: BlockKeyer
    encode_all: Callable[[list[Event]], list[Any]]
    batch: Callable[[float, list[Any]], Any]  # (timestamp, events) -> the engine's KVEventBatch
    wire_key: Callable[[Any], Any]  # a key as the engine's events carry it
    media: dict[Medium, str]
    batch_type: type  # the engine's KVEventBatch (its decoder's type)


def engine_format(name: str) -> EngineFormat:
    """The format `--kv-events-format` names (imports that engine, and hashes one page so
    that its hash code is loaded before the run)."""
    fmt = _engine_format(name)
    fmt.keyer.chain(None, np.zeros(1, dtype=np.int64), 1)
    return fmt


def _engine_format(name: str) -> EngineFormat:
    if name == "sglang":
        from sglang.srt.disaggregation.kv_events import KVEventBatch

        from hicache_cp.integrations.sglang.events import MEDIUM, SGLangEncoder, SGLangKeyer

        enc = SGLangEncoder()
        return EngineFormat(name, SGLangKeyer(), enc.encode_all, lambda ts, evs: KVEventBatch(ts=ts, events=evs),
                            lambda key: key[0], MEDIUM, KVEventBatch)  # fmt: skip
    if name == "vllm":
        from vllm.distributed.kv_events import KVEventBatch
        from vllm.v1.core.kv_cache_utils import init_none_hash

        from hicache_cp.integrations.vllm.events import MEDIUM, VLLMEncoder, VLLMKeyer

        keyer = VLLMKeyer("sha256")  # vLLM's default prefix_caching_hash_algo
        init_none_hash(keyer.hash_fn)  # as vLLM's engine core does before hashing
        vllm_enc = VLLMEncoder()
        return EngineFormat(name, keyer, vllm_enc.encode_all, lambda ts, evs: KVEventBatch(ts=ts, events=evs),
                            vllm_enc.wire_key, MEDIUM, KVEventBatch)  # fmt: skip
    raise InputError(f"--kv-events-format {name!r}: expected one of {', '.join(FORMATS)}")


def check_endpoint(flag: str, endpoint: str) -> tuple[str, int]:
    """A tcp endpoint on a loopback address with a port: its (host, port); InputError naming `flag` otherwise."""
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    try:
        loopback = endpoint.startswith("tcp://") and bool(sep) and ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False
    if not loopback or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"{flag} {endpoint!r}: expected tcp://127.0.0.1:PORT (a loopback address and a port)")
    return host.strip("[]"), int(port)


@dataclass
class PublishStats:
    batches: int = 0
    events: int = 0
    seconds: float = 0.0  # on the replay's thread: taking, encoding and sending


@dataclass
class KVEventPublisher:
    """Publishes a log's events as the engine's batches (see the module docstring)."""

    endpoint: str
    fmt: EngineFormat
    log: EventLog
    topic: str = ""
    stats: PublishStats = field(default_factory=PublishStats)

    def __post_init__(self) -> None:
        import msgspec
        import zmq

        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(100_000)
        self._pub.bind(self.endpoint)
        self._seq = 0

    def flush(self) -> None:
        """Publish what the log queued since the last flush, as one batch (none if empty)."""
        t0 = time.perf_counter()
        events = self.log.take()
        if events:
            wire = self.fmt.encode_all(events)
            payload = self._encoder.encode(self.fmt.batch(time.time(), wire))
            self._pub.send_multipart((self.topic.encode(), self._seq.to_bytes(8, "big"), payload), copy=False)
            self._seq += 1
            self.stats.batches += 1
            self.stats.events += len(wire)
        self.stats.seconds += time.perf_counter() - t0

    def close(self) -> None:
        self.flush()
        self._pub.close(linger=2000)  # what was sent still reaches connected subscribers


def residency(cache: HiCache, fmt: EngineFormat) -> dict[str, list[Any]]:
    """Per medium (the engine's name), the sorted wire keys of the blocks the cache
    holds: walked from the tree and keyed with `fmt.keyer`, not with the log."""
    ps = cache.layout.page_size
    held: dict[Medium, list[Any]] = {Medium.DEVICE: [], Medium.HOST: []}
    stack = [(child, None) for child in cache.tree.root.children.values()]
    while stack:
        node, parent = stack.pop()
        keys = fmt.keyer.chain(parent, node.tokens, ps)
        if node.device_pages is not None:
            held[Medium.DEVICE].extend(keys)
        if node.host_state is HostState.COMMITTED:
            held[Medium.HOST].extend(keys)
        stack.extend((c, keys[-1]) for c in node.children.values())
    return {fmt.media[m]: sorted(map(fmt.wire_key, keys), key=repr) for m, keys in held.items()}


def digest(keys: list[Any]) -> str:
    """A short digest of a sorted key list (the report carries it, not the keys)."""
    return hashlib.blake2b(repr(keys).encode(), digest_size=8).hexdigest()
