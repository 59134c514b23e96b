"""hicache-cp: the host-memory (L2) tier of the KV cache for prefill servers.

What a serving engine imports is exported here; everything else is an
implementation module. The harness (`hicache_cp.harness`: engines, replay,
benchmarks, CLI) drives the library and is never imported by it.

    from hicache_cp import Config, HiCache, Model, Part

    with HiCache(Config(model="tiny")) as cache:
        m = cache.match_prefix(tokens)
        ...
"""

from hicache_cp.cache import HiCache, MatchResult
from hicache_cp.config import Config, WritePolicy
from hicache_cp.cp.agreement import Agreement, DistributedAgreement, LocalAgreement
from hicache_cp.errors import ConfigError, ConsistencyError, HiCacheError, IllegalTransition
from hicache_cp.layout import KVLayout, Model, Part
from hicache_cp.ops import BackupOp, BackupState, LoadOp, LoadState
from hicache_cp.pools import DevicePool, HostPool

__version__ = "0.1.0"

__all__ = [
    "Agreement",
    "BackupOp",
    "BackupState",
    "Config",
    "ConfigError",
    "ConsistencyError",
    "DevicePool",
    "DistributedAgreement",
    "HiCache",
    "HiCacheError",
    "HostPool",
    "IllegalTransition",
    "KVLayout",
    "LoadOp",
    "LoadState",
    "MatchResult",
    "Model",
    "Part",
    "WritePolicy",
    "__version__",
]
