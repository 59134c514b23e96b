"""The L2 budget of one rank: the configured bytes, or what this machine gives."""

from __future__ import annotations

import logging
import os

from hicache_cp.config import Config
from hicache_cp.cp.agreement import Agreement
from hicache_cp.errors import ConfigError
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

