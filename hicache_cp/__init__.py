"""hicache-cp: the host-memory (L2) tier of the KV cache for prefill servers.

What a serving engine imports is exported here; everything else is an
implementation module. The harness (`hicache_harness`: engines, replay,
benchmarks, CLI) drives the library and is never imported by it.

    from hicache_cp import Config, HiCache, Model, Part

    with HiCache(Config(model="tiny")) as cache:
        m = cache.match_prefix(tokens)
        ...
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use (PEP 562), so that `python -m hicache_harness` starts in
# milliseconds and installs its signal handlers before torch is imported
# (a Ctrl-C during that import otherwise ends in a KeyboardInterrupt traceback).
_EXPORTS = {
    "hicache_cp.cache": ("HiCache", "MatchResult"),
    "hicache_cp.config": ("Config", "WritePolicy"),
    "hicache_cp.cp.agreement": ("Agreement", "DistributedAgreement", "LocalAgreement"),
    "hicache_cp.errors": ("ConfigError", "ConsistencyError", "HiCacheError", "IllegalTransition", "IntegrityError"),
    "hicache_cp.layout": ("KVLayout", "Model", "Part"),
    "hicache_cp.ops": ("BackupOp", "BackupState", "LoadOp", "LoadState"),
    "hicache_cp.pools": ("DevicePool", "HostPool"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'hicache_cp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


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
    "IntegrityError",
    "KVLayout",
    "LoadOp",
    "LoadState",
    "MatchResult",
    "Model",
    "Part",
    "WritePolicy",
    "__version__",
]
