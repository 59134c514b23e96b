"""The plug-in's configuration: hicache-cp's own `Config`, shaped by SGLang's pools.

SGLang's `--radix-cache-backend` takes a name and nothing else, so the
settings come from hicache-cp's usual sources, in its usual precedence:

    defaults  <  TOML file named by HICACHE_CP_CONFIG  <  HICACHE_<FIELD> variables

What SGLang decides is not configurable here and is taken from its pools:
`page_size` (SGLang's `--page-size`), `model_layout` (every part's bytes per
token and layer ids) and `l1_pages` (SGLang owns L1). `write_policy` must be
`write_through` (backups run per layer inside the forward) and `cp_size` 1
(SGLang's TP ranks each keep the L2 of what they hold). A value for any of
these from a source is an error naming the field and its source, as is
any invalid value (`ConfigError`, raised at server start).

Main keys: `host_budget_bytes` (per TP rank, all parts together, or "auto"),
`l2_free_room`, `eviction_policy`, `io_backend`, `pin_host`, `debug_checks`,
`verify_restores`, `backup_submits_per_forward`; `node_segment` (`HICACHE_NODE_SEGMENT`) puts L2 in one
shared segment for the node's TP ranks, kept across a server restart
(docs/node-tier.md; the served model's path is its identity there).

Metrics: `HICACHE_CP_METRICS_PORT=P` serves the cache's Prometheus metrics
(`hicache_cp.prometheus`, SGLang's `sglang:hicache_*` names) from each
scheduler process at http://127.0.0.1:(P + its torch.distributed rank)/metrics,
so the TP ranks of a server never share a port; `0` picks free ports (logged).
Unset: no endpoint.

Keys the plug-in cannot honour are refused when a source sets them, with the
source: `l1_free_room` (SGLang evicts its own device tree), `write_threshold`
(another write policy), `pd_timeout_s` and `pd_per_layer` (the plug-in does
no PD); `l2_exclusive` is refused with the write-back it needs. So is what
this process cannot run (`Config.check_host`): an io backend that copies with
CUDA, or `pin_host = true`, without CUDA, and a budget above all the memory of
the machine. Every error is a `ConfigError` raised by `resolve`, before
anything is built.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from hicache_cp import Config, ResolvedConfig
from hicache_cp import ConfigError
from hicache_cp.integrations.sglang.pools import SGLangKV

CONFIG_ENV = "HICACHE_CP_CONFIG"
METRICS_PORT_ENV = "HICACHE_CP_METRICS_PORT"

#: Fields SGLang decides; a source that sets them is refused.
ENGINE_FIELDS = ("page_size", "model", "model_layout", "l1_pages", "cp_size")
#: Fields that do nothing under SGLang, and why; a source that sets them is refused.
UNHONOURED = {
    "l1_free_room": "SGLang evicts its own device tree",
    "write_threshold": "the plug-in backs up write-through, never after hits",
    "pd_timeout_s": "the plug-in does no PD transfers",
    "pd_per_layer": "the plug-in does no PD transfers",
}


def resolve(kv: SGLangKV, env: Mapping[str, str] | None = None, *, cuda: bool | None = None) -> ResolvedConfig:
    """The cache's configuration for SGLang's pools `kv` (see the module docstring).

    `cuda`: whether this process can use CUDA (default: torch says)."""
    env = dict(os.environ if env is None else env)
    path = env.pop(CONFIG_ENV, None) or None
    base = Config.resolve(path, env)
    unhonoured = [f"{name} (from {base.sources[name]}): {why}" for name, why in UNHONOURED.items()
                  if base.sources[name] != "default"]  # fmt: skip
    if unhonoured:
        raise ConfigError(f"hicache-cp under SGLang cannot honour {'; '.join(unhonoured)}")
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    base.check(lambda c: c.check_host(cuda=cuda))
    fixed = [f"{name} (from {base.sources[name]})" for name in ENGINE_FIELDS if base.sources[name] not in ("default", "preset")]
    if fixed:
        raise ConfigError(
            f"hicache-cp under SGLang: {', '.join(fixed)} come from SGLang's pools and flags (--page-size, the model), "
            "not from hicache-cp's config"
        )
    if base.config.write_policy.value != "write_through":
        raise ConfigError(
            f"hicache-cp under SGLang: write_policy must be write_through (from {base.sources['write_policy']}: "
            f"{base.config.write_policy.value}); backups run per layer inside SGLang's forward"
        )
    config = dataclasses.replace(base.config, page_size=kv.page_size, model_layout=kv.model_layout(), l1_pages=2)
    sources = dict(base.sources)
    sources.update(dict.fromkeys(("page_size", "model_layout", "l1_pages"), "sglang"))
    return ResolvedConfig(config, sources)


def metrics_port(env: Mapping[str, str] | None = None) -> int | None:
    """The metrics endpoint's base port from `HICACHE_CP_METRICS_PORT` (None: unset or
    empty, no endpoint); a value that is not a port is a `ConfigError` naming the variable."""
    raw = (os.environ if env is None else env).get(METRICS_PORT_ENV, "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or not 0 <= int(raw) <= 65535:
        raise ConfigError(f"{METRICS_PORT_ENV}: {raw!r} is not a port in [0, 65535] (from the environment)")
    return int(raw)
