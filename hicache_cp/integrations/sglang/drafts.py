"""The MTP draft's KV pools, handed to the plug-in under speculative decoding.

SGLang 0.5.23 gives a tree cache the draft's device pools
(`CacheInitParams.mtp_draft_device_pools`) only when its own HiCache is on:
`BaseSpecWorker._build_hicache_draft_plan` fills the target model runner's
`mtp_draft_device_pools` for MTP (NextN) drafts when
`--enable-hierarchical-cache` is set, and returns early otherwise. Without
them, a host hit would load the target's KV but leave the draft's slots
with whatever they held: a stale draft, collapsing speculative acceptance.

The narrowest route SGLang offers is its own plug-in hook registry
(`sglang.srt.plugins.hook_registry`): `register_hook` adds an AFTER hook on
that method, applied by SGLang's plug-in loader in every scheduler process
before the workers are built. When `--radix-cache-backend hicache-cp` is
selected and SGLang built no draft plan, the hook does what SGLang does for
its own HiCache, and nothing else:

    MTP (NextN) draft (SGLang's `_can_pack_hicache_mtp`)  mtp_draft_device_pools = the draft runners'
                                                          KV pools (they share the target's slots)
    a draft with its own KV of another kind               ValueError naming --speculative-algorithm
                                                          (its KV would be stale on every host hit)
    no draft KV (NGRAM, frozen-KV MTP)                    nothing to hand

and marks the target runner checked, so the factory can refuse a
speculative server the hook never ran in (`require_draft_pools`).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.speculative.base_spec_worker.BaseSpecWorker._build_hicache_draft_plan"
CHECKED = "_hicache_cp_drafts_checked"  # set on the target model runner by the hook

_registered = False


def register_hook() -> None:
    """Register the AFTER hook with SGLang's hook registry (idempotent; applied by
    SGLang's `load_plugins`)."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, hand_draft_pools, HookType.AFTER)
    _registered = True


def hand_draft_pools(plan: Any, worker: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `_build_hicache_draft_plan(worker)`: hand the MTP draft's pools over (see the
    module docstring). Returns None (the plan SGLang built stays as it is)."""
    from sglang.srt.runtime_context import get_memory
    from sglang.srt.speculative.base_spec_worker import HiCacheDraftMode, _can_pack_hicache_mtp

    from hicache_cp.integrations.sglang.modes import BACKEND_FLAG

    if get_memory().radix_cache_backend != "hicache-cp":
        return None
    runner = worker.target_worker.model_runner
    setattr(runner, CHECKED, True)
    if plan.mode is not HiCacheDraftMode.NONE or runner.mtp_draft_device_pools:
        return None
    drafts = tuple(worker._draft_model_runners())
    if not drafts:
        return None
    if not _can_pack_hicache_mtp(runner.spec_algorithm, drafts):
        raise ValueError(
            f"{BACKEND_FLAG} keeps a speculative draft's KV only for MTP (NextN) drafts, whose pools share the "
            f"target's token slots; --speculative-algorithm {runner.spec_algorithm.name} has a draft with KV of its "
            "own that a host hit would leave stale"
        )
    runner.mtp_draft_device_pools = tuple(r.token_to_kv_pool for r in drafts)
    logger.info("hicache-cp: %d MTP draft pool(s) handed to the plug-in", len(drafts))
    return None


def require_draft_pools(server_args: Any, tp_worker: Any) -> None:
    """Refuse a speculative server whose draft pools never reached the plug-in (the hook
    did not run: hicache-cp was not loaded through SGLang's plug-in loader)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from hicache_cp.integrations.sglang.modes import BACKEND_FLAG

    spec = SpeculativeAlgorithm.from_string(getattr(server_args, "speculative_algorithm", None))
    if spec.is_none() or spec.is_ngram():
        return
    runner = getattr(tp_worker, "model_runner", None)
    if runner is None or not getattr(runner, CHECKED, False):
        raise ValueError(
            f"{BACKEND_FLAG} with --speculative-algorithm {spec.name}: the draft's KV pools did not reach the "
            "plug-in (its hook runs only when SGLang loads hicache-cp through its plug-in entry point, "
            "sglang.srt.plugins); a host hit would leave the draft's KV stale"
        )
