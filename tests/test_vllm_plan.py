"""The vLLM connector's mapping of vLLM's KV cache onto the logical object, and its worker's waits.

DeepSeek-V3.2 in vLLM: per layer an MLA cache and an indexer cache (spec role
INDEXER) in one KV cache group, plus an MTP draft layer numbered after the
target's. Skipped where vLLM is not installed.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.kv_cache_interface", reason="vLLM not installed (scripts/install_vllm.sh)")

from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)

import test_vllm_bench as H  # noqa: E402

from hicache_cp import LoadState, Part  # noqa: E402
from hicache_cp.errors import ConfigError  # noqa: E402
from hicache_cp.integrations.vllm.metadata import CopyJob, HiCacheMetadata  # noqa: E402
from hicache_cp.integrations.vllm.plan import KVPlan, LayerSlot, page_major  # noqa: E402
from hicache_cp.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from hicache_cp.integrations.vllm.worker import WorkerSide  # noqa: E402
from hicache_cp.io.base import Direction, TicketState  # noqa: E402

BS, BLOCKS = 16, 10


def v32_config(target_layers: int = 3) -> KVCacheConfig:
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=48, dtype=torch.float32)
    idx = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=132, dtype=torch.uint8,
                           cache_role=SparseCacheRole.INDEXER)
    specs = {}
    for i in range(target_layers + 1):  # the last one is the MTP draft layer
        specs[f"model.layers.{i}.self_attn.attn"] = mla
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = idx
    group = KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs=specs))
    tensors = [KVCacheTensor(size=BLOCKS * s.page_size_bytes, layers=[n], layer_stride=BLOCKS * s.page_size_bytes,
                             block_stride=s.page_size_bytes) for n, s in specs.items()]
    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=[group])


def test_vllm_plan_maps_mla_indexer_and_mtp_layers():
    plan = KVPlan.from_kv_cache_config(v32_config(), num_hidden_layers=3)
    assert plan.layout.describe() == (
        "page_size=16; target_kv: 3 layers x 3072 B/page; target_state: 3 layers x 2112 B/page; "
        "draft_kv: 1 layers x 3072 B/page; draft_state: 1 layers x 2112 B/page"
    )
    assert plan.slot("model.layers.1.self_attn.indexer.k_cache") == LayerSlot(Part.TARGET_STATE, 1)
    assert plan.slot("model.layers.3.self_attn.attn") == LayerSlot(Part.DRAFT_KV, 0)
    with pytest.raises(ValueError, match="not in the KV cache config"):
        plan.slot("model.layers.9.self_attn.attn")
    config = ConnectorSettings.from_extra_config({"host_budget_gib": 0.01}).cache_config(plan.layout)
    assert config.layout() == plan.layout
    assert plan.replicated  # MLA: vLLM keeps the same KV on every TP rank


def test_vllm_plan_refuses_several_kv_cache_groups_saying_what_to_pass():
    """With the hybrid KV cache manager on, a sliding-window model has two groups."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32, sliding_window=64)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], full),
              KVCacheGroupSpec(["model.layers.1.self_attn.attn"], swa)]
    cfg = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
    with pytest.raises(ValueError, match="--disable-hybrid-kv-cache-manager") as e:
        KVPlan.from_kv_cache_config(cfg, num_hidden_layers=2)
    assert "SlidingWindowSpec" in str(e.value)
    one = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups[:1])
    assert not KVPlan.from_kv_cache_config(one, num_hidden_layers=1).replicated  # dense: a shard per rank


def test_vllm_plan_is_the_same_from_the_schedulers_copy_of_the_config():
    """vLLM hands the scheduler a copy of the config with one spec per group
    (the MLA one or the indexer one): the plan must still be the workers'."""
    workers = KVPlan.from_kv_cache_config(v32_config(), num_hidden_layers=3)
    sched_cfg = generate_scheduler_kv_cache_config([v32_config()])
    assert not getattr(sched_cfg.kv_cache_groups[0].kv_cache_spec, "kv_cache_specs", None)  # collapsed by vLLM
    assert KVPlan.from_kv_cache_config(sched_cfg, num_hidden_layers=3) == workers
    sched_cfg.kv_cache_tensors = []
    with pytest.raises(ValueError, match="cannot tell each layer's bytes"):
        KVPlan.from_kv_cache_config(sched_cfg, num_hidden_layers=3)


def test_vllm_worker_refuses_a_scheduler_layout_that_differs():
    plan = KVPlan.from_kv_cache_config(v32_config(), num_hidden_layers=3)
    w = WorkerSide(plan, ConnectorSettings.from_extra_config(
        {"host_budget_bytes": 1 << 20, "io_backend": "cpu", "pin_host": False}))
    w.register_kv_caches({n: torch.zeros(BLOCKS, BS, 132 if "indexer" in n else 48,
                                         dtype=torch.uint8 if "indexer" in n else torch.float32) for n in plan.slots})
    other = KVPlan.from_kv_cache_config(v32_config(target_layers=2), num_hidden_layers=2).layout.describe()
    meta = HiCacheMetadata(w.host_pool.physical_pages, other, loads=[CopyJob(1, "r", np.array([5]), np.array([3]), 0)])
    with pytest.raises(ValueError, match="differs from this worker's"):
        w.start_load_kv(meta)
    w.close()


def test_vllm_page_major_views_and_refusals():
    mla = torch.zeros(BLOCKS, BS, 48)
    assert page_major(mla, BLOCKS, BS * 48 * 4).data_ptr() == mla.data_ptr()  # a view, no copy
    split = torch.zeros(BLOCKS * 2, BS // 2, 48)  # kernel blocks of 8 inside blocks of 16
    assert page_major(split, BLOCKS, BS * 48 * 4).shape == (BLOCKS, BS * 48 * 4)
    nhd = torch.zeros(BLOCKS, 4, BS, 8).permute(0, 2, 1, 3)  # blocks outermost, heads inside: still page-major
    assert page_major(nhd, BLOCKS, BS * 4 * 8 * 4).shape == (BLOCKS, BS * 4 * 8 * 4)
    with pytest.raises(ValueError, match="not a multiple"):
        page_major(torch.zeros(2, BLOCKS, BS, 8), BLOCKS, 2 * BS * 8 * 4)  # a K/V-outermost split (older vLLM)
    with pytest.raises(ValueError, match="not outermost"):
        page_major(torch.zeros(4, BLOCKS, BS, 8).permute(1, 0, 2, 3), BLOCKS, 4 * BS * 8 * 4)
    with pytest.raises(ValueError, match="not dense"):
        page_major(torch.zeros(BLOCKS, 2 * BS, 8)[:, :BS], BLOCKS, BS * 8 * 4)  # block-outermost packing


def test_vllm_settings_are_checked():
    with pytest.raises(ConfigError, match="exactly one of"):
        ConnectorSettings.from_extra_config({})
    with pytest.raises(ConfigError, match="unknown key"):
        ConnectorSettings.from_extra_config({"host_budget_gib": 1, "host_budget": 3})
    with pytest.raises(ConfigError, match="positive"):
        ConnectorSettings.from_extra_config({"host_budget_gib": -1})


@pytest.mark.parametrize("device", H.DEVICES)
def test_vllm_worker_waits_for_indexer_state_one_layer_ahead(device):
    """Layer l's indexer reads its cache before layer l's attention hook: the
    worker waits for it at layer l-1's hook (layer 0's at start_load_kv).
    The copy of layer 1's indexer cache is made slow (CPU: the engine's thread
    sleeps; CUDA: the H2D stream spins first), so reading it on the compute
    side right after layer 0's hook sees the loaded bytes only if that hook waited."""
    plan = KVPlan.from_kv_cache_config(v32_config(), num_hidden_layers=3)
    # Host bytes are written here, not backed up: no stored checksums to check them against.
    extra = {"host_budget_bytes": 1 << 20, "verify_restores": "off"}
    if device == "cpu":
        extra.update(io_backend="cpu", pin_host=False)
    w = WorkerSide(plan, ConnectorSettings.from_extra_config(extra))
    kv = {name: torch.zeros(BLOCKS, BS, 132 if "indexer" in name else 48,
                            dtype=torch.uint8 if "indexer" in name else torch.float32, device=device)
          for name in plan.slots}
    w.register_kv_caches(kv)
    host = w.host_pool.layer_view(Part.TARGET_STATE, w.layout.part(Part.TARGET_STATE).slot(1))
    host[[3, 4]] = 7  # the indexer keys of layer 1 for host pages 3, 4

    def slow_state(direction, part, layer):  # test double: the copy of layer 1's state is slow
        if direction is Direction.H2D and part is Part.TARGET_STATE and layer == 1:
            if device == "cpu":
                time.sleep(0.2)
            else:
                with torch.cuda.stream(w.engine.stream(Direction.H2D)):
                    torch.cuda._sleep(400_000_000)  # about 0.2 s of spinning before the copy

    H.inject_fault(w.engine, slow_state)
    meta = HiCacheMetadata(w.host_pool.physical_pages, w.layout.describe(),
                           loads=[CopyJob(1, "r", np.array([5, 6]), np.array([3, 4]), 0)])
    w.start_load_kv(meta)
    (_, op), = w._loads
    w.wait_for_layer_load("model.layers.0.self_attn.attn")
    assert (kv["model.layers.1.self_attn.indexer.k_cache"][[5, 6]] == 7).all()  # read in compute order
    if device == "cpu":
        assert op.by_layer[(Part.TARGET_STATE, 1)][0].query() is TicketState.DONE
    w.wait_for_save(meta)
    assert op.state is LoadState.LOADING and w.block_ids_with_load_errors() == set()
    assert w.worker_meta().results == {1: (1, None)}
    w.close()
