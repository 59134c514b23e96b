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
#
# What an engine uses (HiCache and its settings, ops, pools, errors) and what a
# plug-in builds on besides (the copy-engine contract, the node tier, KV cache
# events, the L3 store): `hicache_cp/integrations/` imports only these names.
_EXPORTS = {
    "hicache_cp.cache": ("HiCache", "MatchResult"),
    "hicache_cp.cache.node_tier": ("NodeTier",),
    "hicache_cp.checksum": ("Verify", "sample_positions"),
    "hicache_cp.config": ("BACKUP_SUBMITS_PER_FORWARD", "Config", "ResolvedConfig", "WritePolicy"),
    "hicache_cp.cp.agreement": ("Agreement", "DistributedAgreement", "LocalAgreement"),
    "hicache_cp.errors": ("ConfigError", "ConsistencyError", "HiCacheError", "IllegalTransition", "IntegrityError"),
    "hicache_cp.events": ("AllCleared", "BlockKeyer", "BlockRemoved", "BlockStored", "Event", "EventLog", "Medium",
                          "Removal"),
    "hicache_cp.io.base": ("CopyEngine", "CopyFailed", "CopyPlan", "CopyTicket", "Direction", "TicketState",
                           "make_engine"),
    "hicache_cp.io.verify": ("failure_from_report",),
    "hicache_cp.l3.config": ("L3Config",),
    "hicache_cp.l3.store": ("L3Error", "MooncakeStore"),
    "hicache_cp.layout": ("KVLayout", "Model", "Part"),
    "hicache_cp.ops": ("BackupOp", "BackupState", "LoadOp", "LoadState",
                       "backup_layer_group"),
    "hicache_cp.pools": ("DevicePool", "HostPool"),
    "hicache_cp.presets": ("PRESETS", "ModelLayout"),
    "hicache_cp.prometheus": ("Exporter", "start_exporter"),
}  # fmt: skip
#: Exported under a name that says what it is (public name -> module, name there).
_RENAMED = {
    "BlockKey": ("hicache_cp.events", "Key"),  # an engine's key of one page
    "L3_FORMAT_VERSION": ("hicache_cp.l3.config", "FORMAT_VERSION"),  # the stored objects' format
    "METRIC_FAMILIES": ("hicache_cp.prometheus", "FAMILIES"),  # the metrics' names, types, labels
    "metric_family_values": ("hicache_cp.prometheus", "family_values"),  # a cache's samples of them
}
_WHERE = {name: (module, name) for module, names in _EXPORTS.items() for name in names} | _RENAMED


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'hicache_cp' has no attribute {name!r}")
    value = getattr(importlib.import_module(where[0]), where[1])
    globals()[name] = value  # later look-ups skip this function
    return value


__version__ = "0.1.0"

__all__ = [
    "Agreement",
    "AllCleared",
    "BackupOp",
    "BackupState",
    "BlockKey",
    "BlockKeyer",
    "BlockRemoved",
    "BlockStored",
    "Config",
    "ConfigError",
    "ConsistencyError",
    "CopyEngine",
    "CopyFailed",
    "CopyPlan",
    "CopyTicket",
    "DevicePool",
    "Direction",
    "DistributedAgreement",
    "Event",
    "EventLog",
    "Exporter",
    "HiCache",
    "HiCacheError",
    "HostPool",
    "IllegalTransition",
    "IntegrityError",
    "KVLayout",
    "L3Config",
    "L3Error",
    "L3_FORMAT_VERSION",
    "LoadOp",
    "LoadState",
    "LocalAgreement",
    "METRIC_FAMILIES",
    "MatchResult",
    "Medium",
    "Model",
    "ModelLayout",
    "MooncakeStore",
    "NodeTier",
    "PRESETS",
    "Part",
    "Removal",
    "ResolvedConfig",
    "TicketState",
    "Verify",
    "WritePolicy",
    "failure_from_report",
    "make_engine",
    "metric_family_values",
    "sample_positions",
    "start_exporter",
    "__version__",
]
