"""Test bench (no tests) for the vLLM connector: vLLM's real `Scheduler` and a fake model runner.

vLLM 0.33.0's own `Scheduler` (prefix caching, chunked prefill, preemption,
its KV-connector calls) runs on the CPU device with a tiny DeepSeek-V3 config
written to a temporary folder (offline: no hub, no tokenizer). The connector
is loaded the way a server loads it, by `kv_connector_module_path`, once per
role: the scheduler builds its own, the bench builds the worker's through
vLLM's `KVConnectorFactory`.

The fake model runner stands in for vLLM's GPU model runner and nothing
else: per step it binds the metadata, starts the loads, and for each MLA
layer waits for the layer's load, checks that every token the request has
already computed holds the right KV bytes in vLLM's block tensors, writes
this step's tokens' KV, and calls the save hook; then `wait_for_save` and the
reports go back to `Scheduler.update_from_output`, as in vLLM's
`KVConnectorModelRunnerMixin`. A token's KV is a function of its prefix and
the layer, so a wrong byte anywhere (a bad load, a load that landed in the
wrong block, a stale page) shows up as a mismatch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base", reason="vLLM not installed (scripts/install_vllm.sh)"
)

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BLOCK = 16
HEAD = 48  # MLA latent (32) + rope (16): one vector per token, float32 on CPU
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
PAGE_BYTES = BLOCK * HEAD * 4  # one layer of one block
SAMPLED = 7  # every sampled token

TINY_DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": len(LAYERS),
    "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": len(LAYERS), "kv_lora_rank": 32, "q_lora_rank": None,
    "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "vocab_size": 1000,
    "max_position_embeddings": 4096, "torch_dtype": "float32", "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
}


def write_model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_DEEPSEEK))
    return path


def kv_rows(tokens: list[int], positions: np.ndarray, layer: int) -> torch.Tensor:
    """The KV vectors of `positions`: a function of each token's prefix and the layer (exact in float32)."""
    h = np.zeros(len(tokens), dtype=np.uint64)
    acc = np.uint64(1469598103934665603)
    for i, t in enumerate(tokens):
        acc = np.uint64((int(acc) * 1099511628211 + int(t) + 1) % (1 << 61))
        h[i] = acc
    base = (h[positions] % np.uint64(65536)).astype(np.float32) + np.float32(0.25 * layer)
    return torch.from_numpy(base[:, None] + np.arange(HEAD, dtype=np.float32)[None, :] / 1024)


@dataclass
class StepRecord:
    """What vLLM scheduled in one step, and what the connector was told to copy."""

    scheduled: dict[str, tuple[int, int]]  # req id -> (computed before the step, tokens scheduled)
    loads: list[tuple[str, int, int]]  # (req id, first page, pages)
    saves: list[tuple[str, int, int]]
    invalid_blocks: set[int]
    preempted: set[str]


@dataclass
class Bench:
    sched: Scheduler
    worker: object  # the worker-role HiCacheConnector
    kv: dict[str, torch.Tensor]
    hasher: object
    mismatches: list[tuple[str, str, int]] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    _n: int = 0

    @property
    def connector(self):  # the scheduler-role HiCacheConnector vLLM built
        return self.sched.connector

    @property
    def side(self):
        return self.connector.scheduler_side

    @property
    def cache(self):
        return self.side.cache

    def add(self, prompt: list[int], max_tokens: int = 1, req_id: str | None = None) -> str:
        self._n += 1
        rid = req_id or f"r{self._n}"
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.sched.add_request(Request(rid, list(prompt), params, None, block_hasher=self.hasher))
        return rid

    def step(self, *, abort_before_forward: list[str] = ()) -> StepRecord:
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        for rid in abort_before_forward:
            self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        rec = StepRecord(
            {}, [(j.req_id, j.first_position, len(j.device_pages)) for j in meta.loads],
            [(j.req_id, j.first_position, len(j.device_pages)) for j in meta.saves], set(), set(so.preempted_req_ids),
        )
        work = []  # (req id, tokens, blocks, computed before, scheduled)
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests.get(rid)
            before = req.num_computed_tokens - n if req is not None else None
            rec.scheduled[rid] = (before, n)
            if req is not None and not req.is_finished():
                work.append((rid, list(req.all_token_ids), self.sched.kv_cache_manager.get_block_ids(rid)[0], before, n))
        w = self.worker
        w.bind_connector_metadata(meta)
        if so.has_sync_kv_loads:
            w.start_load_kv(None)
        for layer, name in enumerate(LAYERS):
            w.wait_for_layer_load(name)
            t = self.kv[name]
            for rid, tokens, blocks, before, n in work:
                self._check(rid, name, t, tokens, blocks, layer, np.arange(before))
                pos = np.arange(before, min(before + n, len(tokens)))
                if len(pos):
                    idx = torch.from_numpy(np.asarray(blocks)[pos // BLOCK]), torch.from_numpy(pos % BLOCK)
                    t[idx] = kv_rows(tokens, pos, layer)
            w.save_kv_layer(name, t, None)
        if not so.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        rec.invalid_blocks = w.get_block_ids_with_load_errors()
        out = KVConnectorOutput(
            finished_sending=set(), finished_recving=set(), invalid_block_ids=set(rec.invalid_blocks),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        w.clear_connector_metadata()
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.sched.requests.get(rid)
            done_prefill = req is not None and req.num_computed_tokens >= req.num_tokens
            sampled.append([SAMPLED] if done_prefill else [])
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled, kv_connector_output=out)
        self.sched.update_from_output(so, mro)
        self.steps.append(rec)
        return rec

    def run(self, max_steps: int = 50) -> list[StepRecord]:
        """Step until every request finished."""
        records = []
        for _ in range(max_steps):
            if not self.sched.requests:
                return records
            records.append(self.step())
        raise AssertionError(f"requests still unfinished after {max_steps} steps: {list(self.sched.requests)}")

    def _check(self, rid, name, t, tokens, blocks, layer, pos) -> None:
        if not len(pos):
            return
        idx = torch.from_numpy(np.asarray(blocks)[pos // BLOCK]), torch.from_numpy(pos % BLOCK)
        bad = (t[idx] != kv_rows(tokens, pos, layer)).any(dim=1).nonzero().flatten()
        for i in bad.tolist()[:4]:
            self.mismatches.append((rid, name, int(pos[i])))

    def drop_vllm_prefix_cache(self) -> None:
        """Evict vLLM's own prefix cache (its L1), as memory pressure would."""
        assert self.sched.reset_prefix_cache(), "vLLM refused to reset its prefix cache"

    def locked_nodes(self) -> int:
        return sum(1 for n in self.cache.tree.nodes() if n.lock_ref)


def make_bench(model_dir: Path, *, num_blocks: int = 64, host_pages: int = 64, max_batched: int = 256,
               policy: str = "recompute") -> Bench:
    extra = {"host_budget_bytes": host_pages * PAGE_BYTES * len(LAYERS), "debug_checks": True, "io_backend": "cpu"}
    vc = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=1024),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched, max_model_len=1024,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HiCacheConnector", kv_connector_module_path="hicache_cp.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy=policy, kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
    )
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=HEAD, dtype=torch.float32)
    kvc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])
    vc.cache_config.num_gpu_blocks = num_blocks
    sched = Scheduler(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
                      block_size=BLOCK, log_stats=True)
    worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kvc)
    kv = {name: torch.full((num_blocks, BLOCK, HEAD), -1.0) for name in LAYERS}
    worker.register_kv_caches(kv)
    init_none_hash(sha256)
    return Bench(sched, worker, kv, get_request_block_hasher(BLOCK, sha256))
