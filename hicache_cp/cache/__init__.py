"""The cache manager: `HiCache` (the facade) and `MatchResult`.

    hicache     the public API a prefill server calls
    prefix      match_prefix and insert over the radix tree
    lifecycle   backups and loads: submission per layer, agreed decisions
    eviction    allocation with eviction, free-room targets
    engine_l1   load_into / reserve_host_copy for an engine that owns its device pages (vLLM)
    tier3       the L3 tier: prefetch on match, write-back on commit
    state       what the parts share, and the cross-structure invariants
"""

from hicache_cp.cache.hicache import HiCache
from hicache_cp.match import MatchResult

__all__ = ["HiCache", "MatchResult"]
