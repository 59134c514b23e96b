"""hicache-cp's KV cache events in SGLang 0.5.23's own format.

    SGLangKeyer    a page's key is the one SGLang gives it: the SHA-256 chain of
                   `mem_cache.utils.get_hash_str` (hex strings), which SGLang's radix
                   cache computes for the same tokens (`compute_node_hash_values`)
    SGLangEncoder  library events (`hicache_cp.events`) -> SGLang's `BlockStored`,
                   `BlockRemoved`, `AllBlocksCleared` (`disaggregation/kv_events.py`),
                   each hash as `hash_str_to_int64` of SGLang's hex string, as its
                   recorder publishes its GPU tier's

Media: L2 is `CPU_PINNED` (SGLang's host tier), L3 `EXTERNAL` (a shared pool,
Mooncake Store), the reference server's L1 `GPU`. A router therefore joins
a block's host copy with SGLang's own GPU events on the same 64-bit hash.
Only requests whose KV is a function of their tokens reach hicache-cp (no
LoRA, cache salt or multimodal input: the plug-in's `_eligible`), so no
namespace applies (SGLang's `namespaced_block_hash` is the identity then).

The plug-in hands the encoded events to its radix cache's own
`KVCacheEventRecorder` as they happen; SGLang's scheduler takes them with its
GPU events (`take_events`) and publishes them through its own publisher.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, StorageMedium
from sglang.srt.mem_cache.utils import get_hash_str

from hicache_cp import AllCleared, Event, EventLog, BlockKey as Key, Medium
from hicache_cp import BlockStored as Stored

MEDIUM = {Medium.DEVICE: StorageMedium.GPU.value, Medium.HOST: StorageMedium.CPU.value,
          Medium.STORE: StorageMedium.EXTERNAL.value}  # fmt: skip


class SGLangKeyer:
    """SGLang's page hashes (see the module docstring). O(tokens), in SGLang's native code.

    A key is `(int64, hex)`: the hash as SGLang's events carry it
    (`hash_str_to_int64`), computed once, and the hex string the next page chains on."""

    def chain(self, parent: Key | None, tokens: np.ndarray, page_size: int) -> list[Key]:
        ids = array("q")
        ids.frombytes(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
        prior = parent[1] if isinstance(parent, tuple) else None
        out = get_hash_str(ids, prior, page_size=page_size)
        hexes = out if isinstance(out, list) else [out]
        # hash_str_to_int64 of each, in one pass: the first 16 hex digits, big-endian, signed
        ints = np.frombuffer(bytes.fromhex("".join(h[:16] for h in hexes)), dtype=">i8").tolist()
        return list(zip(ints, hexes))


class SGLangEncoder:
    """One SGLang event per library event."""

    def encode(self, event: Event) -> Any:
        if isinstance(event, AllCleared):
            return AllBlocksCleared()
        medium = MEDIUM[event.medium]
        hashes = [k[0] for k in event.keys]  # type: ignore[index]
        if isinstance(event, Stored):
            return BlockStored(
                block_hashes=hashes,
                parent_block_hash=None if event.parent is None else event.parent[0],  # type: ignore[index]
                token_ids=event.tokens.tolist(),
                block_size=len(event.tokens) // len(event.keys),
                lora_id=None,
                medium=medium,
            )
        return BlockRemoved(block_hashes=hashes, medium=medium)

    def encode_all(self, events: list[Event]) -> list[Any]:
        return [self.encode(ev) for ev in events]


def recorder_log(recorder: Any) -> EventLog | None:
    """An event log for the plug-in's cache that hands every event, encoded, to
    SGLang's `KVCacheEventRecorder` of its radix cache as it happens (None when
    SGLang's KV events are off). L2 and L3 only: SGLang publishes its GPU tier."""
    if recorder is None or not recorder.enabled:
        return None
    encoder = SGLangEncoder()
    return EventLog(SGLangKeyer(), sink=lambda ev: recorder.enqueue(encoder.encode(ev)),
                    media=(Medium.HOST, Medium.STORE))  # fmt: skip
