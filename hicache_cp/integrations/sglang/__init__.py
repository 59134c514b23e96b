"""hicache-cp inside SGLang 0.5.23 (imports sglang; never imported by the library).

Two plug-ins:

- `--radix-cache-backend hicache-cp`: hicache-cp as SGLang's host tier (L2)
  behind its own device radix cache (`radix_cache.HiCacheCpRadixCache`).
  Importing this package registers the name with SGLang's registry
  (`register_radix_cache_backend`) and the hook that hands it the MTP
  draft's pools (`drafts`); SGLang imports it in every process through its
  plug-in entry point (`sglang.srt.plugins`, declared in this project's
  pyproject.toml), so an installed hicache-cp needs no code. What it serves
  and refuses: `modes`. User guide: docs/integrations/sglang.md::

      HICACHE_CP_CONFIG=hicache.toml python -m sglang.launch_server \\
          --model-path deepseek-ai/DeepSeek-V3.2 --page-size 64 --radix-cache-backend hicache-cp

- `storage.HiCacheCpStorage`: an L3 storage backend SGLang loads as
  `--hicache-storage-backend dynamic` (see that module).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

logger = logging.getLogger(__name__)

BACKEND_NAME = "hicache-cp"


def build_tree_cache(ctx: TreeCacheBuildContext, *, env: dict[str, str] | None = None, agreement: Any = None) -> Any:
    """SGLang's radix-cache factory for `--radix-cache-backend hicache-cp` (SGLang passes
    `ctx` only; `env` stands in for the process environment and `agreement` for the DP
    rank's, in harnesses and tests). Refuses the modes `modes` lists, naming the flag."""
    from hicache_cp import Model
    from hicache_cp.integrations.sglang.drafts import require_draft_pools
    from hicache_cp.integrations.sglang.modes import check_modes
    from hicache_cp.integrations.sglang.radix_cache import HiCacheCpRadixCache

    if ctx.enable_hierarchical_cache:
        raise ValueError("--radix-cache-backend hicache-cp is a host tier itself: drop --enable-hierarchical-cache")
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm:
        raise ValueError("--radix-cache-backend hicache-cp supports full-attention (MLA, DSA, MHA/GQA) models only")
    check_modes(ctx.server_args)
    worker = ctx.tp_worker
    require_draft_pools(ctx.server_args, worker)
    runner = getattr(worker, "model_runner", None)
    cache = HiCacheCpRadixCache(
        ctx.params, draft_pools=tuple(ctx.params.mtp_draft_device_pools),
        agreement=agreement or cache_group_agreement(ctx), env=_with_model_id(ctx, env),
        forward_stream=getattr(runner, "forward_stream", None),
    )  # fmt: skip
    if worker is not None and hasattr(worker, "register_hicache_layer_transfer_counter"):
        # The TP worker calls set_consumer at the start of every forward: the hooks' forward boundary.
        worker.register_hicache_layer_transfer_counter(cache.hooks[Model.TARGET])
    return cache


def _with_model_id(ctx: TreeCacheBuildContext, env: dict[str, str] | None) -> dict[str, str]:
    """The settings' environment, with the served model (path and revision) as the node
    tier's model identity unless one is set: a restarted server adopts only its own model's
    segment (with `HICACHE_NODE_SEGMENT`, docs/node-tier.md)."""
    import os

    env = dict(os.environ if env is None else env)
    args = ctx.server_args
    env.setdefault("HICACHE_NODE_MODEL_ID", f"{getattr(args, 'model_path', '')}@{getattr(args, 'revision', None) or 'main'}")
    return env


def cache_group_agreement(ctx: TreeCacheBuildContext) -> Any:
    """One MIN all-reduce per poll over the ranks that run one DP rank's batch: SGLang's
    DP-aware cache group (`CacheInitParams.tp_cache_group`, the attention-TP group under
    DP attention, else the TP group; its CPU group), or none for one rank. Never the
    whole TP group: under DP attention its DP ranks serve different requests."""
    group = getattr(ctx.params, "tp_cache_group", None)
    if group is None:
        return None
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) <= 1:
        return None
    from hicache_cp import DistributedAgreement

    return DistributedAgreement(group)


def register() -> None:
    """Register `hicache-cp` with SGLang's radix-cache registry (idempotent).

    The entry point of SGLang's plug-in group `sglang.srt.plugins`."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from hicache_cp.integrations.sglang.drafts import register_hook

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, build_tree_cache)
    register_hook()  # the MTP draft's pools reach the plug-in (applied by SGLang's load_plugins)


try:
    register()
except ImportError:  # SGLang is not installed: the storage backend and docs still import
    logger.debug("sglang is not importable; --radix-cache-backend %s not registered", BACKEND_NAME)
