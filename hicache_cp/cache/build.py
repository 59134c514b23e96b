"""What a HiCache is built of, beside its parts: the L2 budget of a rank and the L3 tier.

`HiCache.__init__` (`cache/hicache.py`) assembles the cache from these and the
components over its `CacheState`; a failed construction closes what it made."""

from __future__ import annotations

import logging
import os

from hicache_cp.cache.eviction import Evictor
from hicache_cp.cache.state import CacheState
from hicache_cp.cache.tier3 import Tier3
from hicache_cp.checksum import Verify
from hicache_cp.config import Config
from hicache_cp.cp.agreement import Agreement
from hicache_cp.errors import ConfigError
from hicache_cp.l3.client import L3Client, Region
from hicache_cp.l3.keys import KeyScheme
from hicache_cp.l3.metrics import L3Metrics
from hicache_cp.l3.store import KVStore, MooncakeStore
from hostmem.sizing import host_memory

logger = logging.getLogger(__name__)


def host_budget(config: Config, agreement: Agreement, rank: int = 0) -> int:
    """The L2 budget of this rank in bytes: the configured one, or for "auto"
    what this machine or container can give (minus `host_reserve_bytes`),
    shared by the ranks on the machine and agreed across CP ranks by MIN.

    Raises ConfigError when "auto" leaves less than two logical pages."""
    if config.host_budget_bytes != "auto":
        return int(config.host_budget_bytes)
    memory = host_memory(config.host_reserve_bytes)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", config.cp_size))
    budget = agreement.min_int(memory.pool_bytes // max(1, local_ranks))
    need = 2 * config.layout().bytes_per_page
    if budget < need:
        raise ConfigError(
            f"host_budget_bytes = auto: {budget} B per rank is below two logical pages ({need} B); "
            f"{memory.describe()}, {local_ranks} rank(s) on this machine"
        )
    logger.info("rank %d: host budget auto -> %.1f GiB (%s, %d local ranks)", rank, budget / 2**30, memory.describe(), local_ranks)
    return budget


def make_tier3(s: CacheState, evictor: Evictor, store: KVStore | None) -> Tier3:
    """The L3 tier of the cache whose state is `s`, over `store` (default: a Mooncake Store
    client per `config.l3`, closed with the cache; a store handed in stays the caller's)."""
    cfg = s.config.l3
    name = f"l3 rank {s.rank}"
    own = store is None
    store = store or MooncakeStore.open(cfg, name=name)
    try:
        regions = [Region(p.part, s.host_pool.arenas[p.part].ptr, s.host_pool.arenas[p.part].nbytes)
                   for p in s.layout.parts]  # fmt: skip
        checked = s.host_pool if s.config.verify_restores is not Verify.OFF else None
        scheme = KeyScheme(s.layout, s.config.model, cfg, s.cp_size, s.rank, checksums=checked is not None)
        client = L3Client(store, scheme, cfg, regions, s.host_pool.physical_pages, L3Metrics(), name=name,
                          close_store=own, checksums=checked, integrity=s.engine.integrity)  # fmt: skip
    except BaseException:
        if own:
            store.close()
        raise
    tier3 = Tier3(s, evictor, client, cfg)
    s.l3 = tier3
    return tier3
