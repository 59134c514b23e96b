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
    verify_restores                      "all" (default), "sample" or "off": restored pages checked against
                                         their checksums (docs/integrity.md)
    backup_submits_per_forward           per step, how many times the save hooks submit the backups of the
                                         layers written so far; default 8 (fewer: less worker time a step,
                                         copies trailing the forward by more layers)
    node_segment                         the node tier: L2 in this named shared segment, one copy for
                                         every worker (MLA models), kept across restarts (docs/node-tier.md)
    node_adopt, node_drop_on_close       adopt what a previous engine left (default true); remove the
                                         segment at an orderly shutdown (default false)

Unknown keys are an error (a typo would otherwise silently keep a default).
Every bad value is a `ConfigError` naming its key, raised by `from_extra_config`
before anything is built (the budget as given: nan, inf, under a byte, or above
all the memory of the machine; a value of the wrong type; an io backend that
copies with CUDA, or `pin_host = true`, in a process without CUDA), or by
`cache_config` where the model's layout decides (a budget below two pages).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache_cp import BACKUP_SUBMITS_PER_FORWARD, Config, ModelLayout
from hicache_cp import ConfigError
from hicache_cp import KVLayout, Part

SOURCE = "kv_connector_extra_config"
_KEYS = {
    "host_budget_gib", "host_budget_bytes", "eviction_policy", "l2_free_room", "io_backend", "pin_host", "debug_checks",
    "verify_restores", "backup_submits_per_forward",
    "node_segment", "node_adopt", "node_drop_on_close",
}


def _error(key: str, message: str) -> ConfigError:
    return ConfigError(f"{key}: {message} (from {SOURCE})")


@dataclass(frozen=True)
class ConnectorSettings:
    host_budget_bytes: int
    eviction_policy: str = "lru"
    l2_free_room: float | int = 0.02
    io_backend: str = "auto"
    pin_host: bool | None = None
    debug_checks: bool = False
    verify_restores: str = "all"  # hicache_cp.checksum: all, sample or off
    backup_submits_per_forward: int = BACKUP_SUBMITS_PER_FORWARD
    node_segment: str = ""
    node_adopt: bool = True
    node_drop_on_close: bool = False
    node_model_id: str = ""  # set by the connector: vLLM's model and revision
    node_session: int = 0  # set by the connector: one number for the scheduler and every worker
    budget_key: str = "host_budget_bytes"  # the key the budget was given under (errors name it)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, *, cuda: bool | None = None) -> ConnectorSettings:
        """The settings, every value checked (see the module docstring). `cuda`:
        whether this process can use CUDA (default: torch says)."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ConfigError(f"{SOURCE}: expected a mapping of settings, got {type(extra).__name__} {extra!r}")
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ConfigError(f"{SOURCE}: unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        if ("host_budget_gib" in extra) == ("host_budget_bytes" in extra):
            raise ConfigError(f"{SOURCE}: give exactly one of host_budget_gib, host_budget_bytes")
        key = "host_budget_gib" if "host_budget_gib" in extra else "host_budget_bytes"
        value = extra.pop(key)
        if key == "host_budget_gib":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise _error(key, f"must be a positive finite number of GiB, got {value!r}")
            budget = int(value * (1 << 30))
            if budget < 1:
                raise _error(key, f"{value!r} GiB is less than a byte")
        else:
            budget = value
            if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
                raise _error(key, f"must be a positive int, got {budget!r}")
        settings = cls(host_budget_bytes=budget, budget_key=key, **extra)
        probe = settings._config(Config().model_layout, Config().page_size)  # every value, before any layout
        if cuda is None:
            import torch

            cuda = torch.cuda.is_available()
        settings._named(lambda: probe.check_host(cuda=cuda))
        return settings

    def _named(self, check: Any) -> Any:
        """Run `check()`; a ConfigError comes back naming the key as given and the source."""
        try:
            return check()
        except ConfigError as exc:
            field, _, rest = str(exc).partition(":")
            if field == "host_budget_bytes":
                field = self.budget_key
            raise _error(field, rest.strip()) from None

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
        config = self._config(model, layout.page_size)
        if config.layout() != layout:
            raise ConfigError(f"the cache layout {config.layout().describe()} differs from vLLM's {layout.describe()}")
        return config

    def _config(self, model: ModelLayout | None, page_size: int) -> Config:
        return self._named(lambda: Config(
            model_layout=model,
            page_size=page_size,
            host_budget_bytes=self.host_budget_bytes,
            l1_pages=2,
            write_policy="write_through",
            eviction_policy=self.eviction_policy,
            l2_free_room=self.l2_free_room,
            io_backend=self.io_backend,
            pin_host=self.pin_host,
            debug_checks=self.debug_checks,
            verify_restores=self.verify_restores,
            backup_submits_per_forward=self.backup_submits_per_forward,
            node_segment=self.node_segment,
            node_adopt=self.node_adopt,
            node_drop_on_close=self.node_drop_on_close,
            node_model_id=self.node_model_id,
        ))


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
