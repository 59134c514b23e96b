"""The L3 tier's building blocks (the cache side is `hicache_cp.cache.tier3`).

    config    L3Config: the [l3] section of the configuration (off by default)
    store     KVStore protocol, MooncakeStore adapter (return codes -> L3Error, once)
    keys      object keys (prefix-hash chain, part, CP rank, layout fingerprint), chunk lists
    client    L3Client: the store on worker threads, deadlines, the store's health
    ops       PrefetchOp / WriteJob state machines and their votes
    metrics   L3Metrics counters
"""

from hicache_cp.l3.config import L3Config
from hicache_cp.l3.store import KVStore, L3Error, L3Timeout, MooncakeStore

__all__ = ["KVStore", "L3Config", "L3Error", "L3Timeout", "MooncakeStore"]
