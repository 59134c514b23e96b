"""The connector's settings: `kv_connector_extra_config` of vLLM's `--kv-transfer-config`.

    {"kv_connector": "HiCacheConnector",
     "kv_connector_module_path": "hicache_cp.integrations.vllm",
     "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"host_budget_gib": 64}}

Keys (all optional except the budget):

    host_budget_gib / host_budget_bytes  L2 bytes per worker (GPU), all parts together (one of them)
    eviction_policy                      "lru" (default), "hit_weighted" or "reuse_lru"
    l2_free_room                         fraction (float) or pages (int) kept free in L2; default 0.02
    io_backend                           "auto" (default: "direct" on CUDA, "cpu" otherwise), "direct", "cpu"
    pin_host                             pin L2 for CUDA; default: when CUDA is available
    debug_checks                         check the cache's invariants after every operation (tests)
    node_segment                         the node tier: L2 in this named shared segment, one copy for
                                         every worker (MLA models), kept across restarts (docs/node-tier.md)
    node_adopt, node_drop_on_close       adopt what a previous engine left (default true); remove the
                                         segment at an orderly shutdown (default false)

Unknown keys are an error (a typo would otherwise silently keep a default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache_cp.config import Config, ModelLayout
from hicache_cp.errors import ConfigError
from hicache_cp.layout import KVLayout, Part

_KEYS = {
    "host_budget_gib", "host_budget_bytes", "eviction_policy", "l2_free_room", "io_backend", "pin_host", "debug_checks",
    "verify_restores",
    "node_segment", "node_adopt", "node_drop_on_close",
}


@dataclass(frozen=True)
class ConnectorSettings:
    host_budget_bytes: int
    eviction_policy: str = "lru"
    l2_free_room: float | int = 0.02
    io_backend: str = "auto"
    pin_host: bool | None = None
    debug_checks: bool = False
    verify_restores: str = "all"  # hicache_cp.checksum: all, sample or off
    node_segment: str = ""
    node_adopt: bool = True
    node_drop_on_close: bool = False
    node_model_id: str = ""  # set by the connector: vLLM's model and revision
    node_session: int = 0  # set by the connector: one number for the scheduler and every worker
    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        if ("host_budget_gib" in extra) == ("host_budget_bytes" in extra):
            raise ConfigError("kv_connector_extra_config: give exactly one of host_budget_gib, host_budget_bytes")
        if "host_budget_gib" in extra:
            gib = extra.pop("host_budget_gib")
            if isinstance(gib, bool) or not isinstance(gib, (int, float)) or gib <= 0:
                raise ConfigError(f"kv_connector_extra_config: host_budget_gib must be a positive number, got {gib!r}")
            extra["host_budget_bytes"] = int(gib * (1 << 30))
        budget = extra["host_budget_bytes"]
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise ConfigError(f"kv_connector_extra_config: host_budget_bytes must be a positive int, got {budget!r}")
        return cls(**extra)

    def cache_config(self, layout: KVLayout) -> Config:
        """The cache's `Config` for this layout: write-through (the layer hooks
        back up every new page), one rank, L1 unused (vLLM owns the device pages)."""
        p = {x.part: x for x in layout.parts}

        def ids(part: Part) -> tuple[int, ...] | None:
            return p[part].layer_ids if part in p else None

        model = ModelLayout(
            name="vllm",
            num_layers=layout.num_target_layers,
            kv_bytes_per_token=p[Part.TARGET_KV].bytes_per_token,
            state_bytes_per_token=p[Part.TARGET_STATE].bytes_per_token if Part.TARGET_STATE in p else 0,
            state_layers=ids(Part.TARGET_STATE),
            draft_layers=layout.num_draft_layers,
            draft_kv_bytes_per_token=p[Part.DRAFT_KV].bytes_per_token if Part.DRAFT_KV in p else 0,
            draft_state_bytes_per_token=p[Part.DRAFT_STATE].bytes_per_token if Part.DRAFT_STATE in p else 0,
        )
        config = Config(
            model_layout=model,
            page_size=layout.page_size,
            host_budget_bytes=self.host_budget_bytes,
            l1_pages=2,
            write_policy="write_through",
            eviction_policy=self.eviction_policy,
            l2_free_room=self.l2_free_room,
            io_backend=self.io_backend,
            pin_host=self.pin_host,
            debug_checks=self.debug_checks,
            verify_restores=self.verify_restores,
            node_segment=self.node_segment,
            node_adopt=self.node_adopt,
            node_drop_on_close=self.node_drop_on_close,
            node_model_id=self.node_model_id,
        )
        if config.layout() != layout:
            raise ConfigError(f"the cache layout {config.layout().describe()} differs from vLLM's {layout.describe()}")
        return config


def node_settings(settings: ConnectorSettings, vllm_config: Any) -> ConnectorSettings:
    """The node tier's facts only vLLM's config knows: one session for the scheduler and
    every worker (vLLM's instance id), the model's identity in the segment's fingerprint,
    and whether the workers' KV is the same (MLA; TP-sharded heads are refused)."""
    import hashlib

    model = vllm_config.model_config
    if not model.use_mla:
        raise ConfigError("kv_connector_extra_config: node_segment keeps one copy of KV every worker holds "
                          "alike (MLA models); this model's KV is sharded over the TP workers")  # fmt: skip
    session = int.from_bytes(hashlib.blake2b(str(vllm_config.instance_id).encode(), digest_size=8).digest(), "little")
    model_id = f"{model.model}@{getattr(model, 'revision', None) or 'main'}"
    return dataclasses.replace(settings, node_session=session, node_model_id=model_id)
