"""hicache-cp's KV cache events in vLLM 0.33's own format.

    VLLMKeyer    a page's key is vLLM's block hash: `kv_cache_utils.hash_block_tokens`
                 with the engine's prefix-caching hash function, chained from vLLM's
                 `NONE_HASH` (read when hashing, so it is the one the engine core set)
    VLLMEncoder  library events (`hicache_cp.events`) -> vLLM's `BlockStored`,
                 `BlockRemoved`, `AllBlocksCleared` (`vllm.distributed.kv_events`), the
                 hashes converted as vLLM's `maybe_convert_block_hash` converts its GPU
                 tier's (ints, or the bytes when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is 0)

Media: L2 is `CPU`, L3 `STORAGE`, the reference server's L1 `GPU`; group 0
(the connector serves one KV cache group). Only requests whose KV is a
function of their tokens reach hicache-cp (no LoRA, multimodal input, cache
salt or prompt embeddings), so no extra keys enter the hash, as in vLLM.

The connector's scheduler side queues the events; vLLM's scheduler takes
them each step with its own (`KVConnectorBase_V1.take_events`) and publishes
both through its publisher. vLLM puts its own events first in each batch, so
a clear from hicache-cp would wipe the GPU blocks of that step: with
`clear_as_removals` the encoder sends a cleared tier as `BlockRemoved` of
every block it announced in it, which touches no other medium.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from vllm import envs
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import hash_block_tokens

from hicache_cp import AllCleared, Event, EventLog, BlockKey as Key, Medium
from hicache_cp import BlockStored as Stored

_LOW64 = (1 << 64) - 1
MEDIUM = {Medium.DEVICE: MEDIUM_GPU, Medium.HOST: MEDIUM_CPU, Medium.STORE: MEDIUM_STORAGE}


class VLLMKeyer:
    """vLLM's block hashes (see the module docstring). O(tokens)."""

    def __init__(self, hash_algo: str | Callable[[Any], bytes] = "sha256") -> None:
        self.hash_fn = get_hash_fn_by_name(hash_algo) if isinstance(hash_algo, str) else hash_algo

    def chain(self, parent: Key | None, tokens: np.ndarray, page_size: int) -> list[Key]:
        ids = np.asarray(tokens, dtype=np.int64).tolist()
        out: list[Key] = []
        h = parent
        for lo in range(0, len(ids) - page_size + 1, page_size):
            h = hash_block_tokens(self.hash_fn, h, ids[lo : lo + page_size])  # type: ignore[arg-type]
            out.append(h)
        return out


class VLLMEncoder:
    """Library events -> vLLM events (one each, or none; see `clear_as_removals`)."""

    def __init__(self, *, clear_as_removals: bool = False) -> None:
        self.clear_as_removals = clear_as_removals
        self._held: dict[Medium, set[Key]] = {m: set() for m in Medium}  # kept only with clear_as_removals
        # vLLM's maybe_convert_block_hash reads this from the environment on every call (microseconds
        # a block); read once here, the same conversion is applied below (tests check they agree)
        self._ints = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)

    def wire_key(self, key: Key) -> Any:
        """`maybe_convert_block_hash(key)`: the low 64 bits as an int, or the bytes."""
        return int.from_bytes(key, "big") & _LOW64 if self._ints else key  # type: ignore[arg-type]

    def _wire(self, keys: list[Key] | set[Key]) -> list[Any]:
        return [int.from_bytes(k, "big") & _LOW64 for k in keys] if self._ints else list(keys)  # type: ignore[arg-type]

    def encode(self, event: Event) -> list[Any]:
        if isinstance(event, AllCleared):
            if not self.clear_as_removals:
                return [AllBlocksCleared()]
            out = [BlockRemoved(block_hashes=self._wire(held), medium=MEDIUM[m], group_idx=0)
                   for m, held in self._held.items() if held]  # fmt: skip
            for held in self._held.values():
                held.clear()
            return out
        medium = MEDIUM[event.medium]
        hashes = self._wire(event.keys)
        if isinstance(event, Stored):
            if self.clear_as_removals:
                self._held[event.medium].update(event.keys)
            return [BlockStored(
                block_hashes=hashes,
                parent_block_hash=None if event.parent is None else self._wire([event.parent])[0],
                token_ids=event.tokens.tolist(),
                block_size=len(event.tokens) // len(event.keys),
                lora_id=None,
                medium=medium,
                lora_name=None,
                group_idx=0,
            )]  # fmt: skip
        if self.clear_as_removals:
            self._held[event.medium].difference_update(event.keys)
        return [BlockRemoved(block_hashes=hashes, medium=medium, group_idx=0)]

    def encode_all(self, events: list[Event]) -> list[Any]:
        return [out for ev in events for out in self.encode(ev)]


def connector_log(vllm_config: Any) -> EventLog | None:
    """The scheduler side's event log when vLLM publishes KV events
    (`--kv-events-config` with `enable_kv_cache_events`), keyed with the engine's
    prefix-caching hash; None otherwise. L2 and L3 only: vLLM publishes its GPU tier."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    if cfg is None or not cfg.enable_kv_cache_events:
        return None
    if getattr(vllm_config, "num_hash_lookahead_tokens", 0):
        raise ValueError(
            "hicache-cp's KV events key blocks by their tokens; vLLM's lookahead block hashes "
            f"(num_hash_lookahead_tokens={vllm_config.num_hash_lookahead_tokens}) are not supported"
        )
    return EventLog(VLLMKeyer(vllm_config.cache_config.prefix_caching_hash_algo), media=(Medium.HOST, Medium.STORE))
