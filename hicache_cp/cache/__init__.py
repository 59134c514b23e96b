"""The cache manager: `HiCache` (the facade) and `MatchResult`.

    hicache     the public API a prefill server calls
    prefix      match_prefix and insert over the radix tree
    lifecycle   backups and loads: submission per layer, agreed decisions
    eviction    allocation with eviction, free-room targets
    match       the MatchResult record
    state       what the parts share, and the cross-structure invariants
"""

from hicache_cp.cache.hicache import HiCache
from hicache_cp.cache.match import MatchResult

__all__ = ["HiCache", "MatchResult"]
