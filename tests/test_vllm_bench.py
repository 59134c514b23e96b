"""Test bench (no tests) for the vLLM connector: vLLM's real `Scheduler` and a fake model runner.

vLLM 0.33.0's own `Scheduler` (prefix caching, chunked prefill, preemption,
its KV-connector calls) runs with a tiny DeepSeek-V3 config written to a
temporary folder (offline: no hub, no tokenizer). The connector is loaded the
way a server loads it, by `kv_connector_module_path`, once per role: the
scheduler builds its own, the bench builds each worker's through vLLM's
`KVConnectorFactory`, and their reports are merged by vLLM's own
`KVOutputAggregator`, as its multiprocess executor does.

Device: `device="cpu"` (CI) keeps vLLM's KV tensors on the CPU with the CPU
copy engine; `device="cuda"` (the GPU run, bench/device/vllm.sh) puts them on
the GPU in vLLM's MLA layout ([num_blocks, block_size, head_size] per layer),
with L2 pinned host memory and the copy engine the connector picks by
default on CUDA (`io_backend="auto"`).

KV shapes: `shape="v3"` is two MLA layers. `shape="v32"` is DeepSeek-V3.2's:
per layer an MLA cache and the indexer's key cache (spec role INDEXER, uint8,
132 B per token) in one KV cache group, plus an MTP draft layer numbered
after the target's. `shape="llama"` is two dense GQA layers whose KV cache
config comes from vLLM's own planner and whose tensors are vLLM's own
allocation (`allocate_kv_cache`: per-layer [B, H, N, C] views of one buffer,
C = K then V of a head) under the KV cache `layout` (LBNHC: FlashAttention's
and Triton's; LBHNC: FlashInfer's and the OffloadingConnector's).

The fake model runner stands in for vLLM's GPU model runner and nothing
else: per step it binds the metadata on every worker, starts the loads, and
per model layer runs the indexer (V3.2: reads its cache, no connector call
before it, as in vLLM) and then the attention layer (waits for the layer's
load, checks, writes, calls the save hook). Before writing, it checks that
every token the request has already computed holds the right bytes in every
worker's tensors; then `wait_for_save` and the reports go back through
`KVOutputAggregator` to `Scheduler.update_from_output`, as in vLLM's
`KVConnectorModelRunnerMixin`. A token's KV is a function of its prefix and
the layer, so a wrong byte anywhere (a bad load, a load that landed in the
wrong block, a stale page) shows up as a mismatch.

Faults: `inject_fault(engine, hook)` calls `hook(direction, part, layer)`
before each copy of the worker's real copy engine; a hook that raises fails
that copy (the CPU engine's own hook; on CUDA a test double that hands back a
failed ticket and skips the copy, so the bytes are stale as after a real
failed copy).
"""

from __future__ import annotations

import json
import os
import time
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
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata  # noqa: E402
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult  # noqa: E402
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402

from hicache_cp.io.base import CopyFailed, CopyTicket, Direction, TicketState  # noqa: E402
from hicache_cp.io.cpu import CpuCopyEngine  # noqa: E402

BLOCK = 16
#: Wall time of a step that schedules nothing (`Bench.run`): a real engine loop spends some, and
#: without it fifty idle steps can spin by before the cpu engine's copy threads finish a save.
IDLE_STEP_S = 0.002
HEAD = 48  # MLA latent (32) + rope (16): one vector per token, float32
INDEX_HEAD = 132  # V3.2 indexer key: 128 fp8 bytes + a 4-byte scale, per token
TARGET_LAYERS = 2
SAMPLED = 7  # every sampled token
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(TARGET_LAYERS)]  # the v3 shape's layers
PAGE_BYTES = BLOCK * HEAD * 4  # one MLA layer of one block
DENSE_HEADS, DENSE_HEAD_SIZE = 2, 8  # the llama shape: 2 KV heads of 8 (float32), K and V


def cuda_available() -> bool:
    return torch.cuda.is_available()


#: The devices every bench test runs on; CUDA ones are GPU tests, skipped without CUDA.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (bench/device/vllm.sh runs these on the H200)")])]

TINY_DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": TARGET_LAYERS,
    "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": TARGET_LAYERS, "kv_lora_rank": 32, "q_lora_rank": None,
    "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "vocab_size": 1000,
    "max_position_embeddings": 16384, "torch_dtype": "float32", "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
}


def write_model_dir(path: Path, layers: int = TARGET_LAYERS) -> Path:
    """The tiny model's config in `path`, with `layers` target layers (benchmarks take more)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**TINY_DEEPSEEK, "num_hidden_layers": layers,
                                                  "first_k_dense_replace": layers}))
    return path


def model_layers(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])


@dataclass(frozen=True)
class LayerSpec:
    """One vLLM KV layer: its name, what it is, and its per-token row."""

    name: str
    salt: int  # makes each layer's bytes distinct
    indexer: bool  # the V3.2 indexer's key cache (uint8) rather than an MLA cache (float32)
    layer: int  # the model layer it belongs to (MTP: the number of target layers)
    dense: bool = False  # a dense (GQA) layer: vLLM's [B, H, N, C] view, C = K then V of a head

    @property
    def width(self) -> int:
        if self.dense:
            return DENSE_HEADS * 2 * DENSE_HEAD_SIZE
        return INDEX_HEAD if self.indexer else HEAD

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8 if self.indexer else torch.float32

    @property
    def page_bytes(self) -> int:
        return BLOCK * self.width * (1 if self.indexer else 4)


def layer_specs(shape: str, layers: int = TARGET_LAYERS) -> list[LayerSpec]:
    """The KV layers in forward order (per model layer: indexer, then attention)."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    if shape == "v3":
        return [LayerSpec(name, i, False, i) for i, name in enumerate(names)]
    if shape == "llama":
        return [LayerSpec(name, i, False, i, dense=True) for i, name in enumerate(names)]
    if shape != "v32":
        raise ValueError(f"unknown bench shape {shape!r}")
    out = []
    for i in range(layers + 1):  # the last one is the MTP draft layer
        out.append(LayerSpec(f"model.layers.{i}.self_attn.indexer.k_cache", 100 + i, True, i))
        out.append(LayerSpec(f"model.layers.{i}.self_attn.attn", i, False, i))
    return out


def kv_cache_config(specs: list[LayerSpec], num_blocks: int) -> KVCacheConfig:
    """The workers' KV cache config; the scheduler gets vLLM's own copy of it
    (`generate_scheduler_kv_cache_config`: one spec per group, as in EngineCore)."""
    mla = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=HEAD, dtype=torch.float32)
    if not any(s.indexer for s in specs):
        group = KVCacheGroupSpec([s.name for s in specs], mla)
    else:
        idx = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=INDEX_HEAD, dtype=torch.uint8,
                               cache_role=SparseCacheRole.INDEXER)
        per = {s.name: idx if s.indexer else mla for s in specs}
        group = KVCacheGroupSpec(list(per), UniformTypeKVCacheSpecs(block_size=BLOCK, kv_cache_specs=per))
    tensors = [KVCacheTensor(size=num_blocks * s.page_bytes, layers=[s.name], layer_stride=num_blocks * s.page_bytes,
                             block_stride=s.page_bytes) for s in specs]  # layer-outermost: one tensor per layer
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=[group])


def dense_kv_cache_config(vc: VllmConfig, specs: list[LayerSpec], num_blocks: int, layout: str) -> KVCacheConfig:
    """A dense model's KV cache config from vLLM's own planner (`get_kv_cache_groups`,
    `get_kv_cache_config_from_groups`) under the KV cache `layout` vLLM resolved."""
    vc.cache_config.kv_cache_layout = layout
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=DENSE_HEADS, head_size=DENSE_HEAD_SIZE,
                             dtype=torch.float32)
    groups = get_kv_cache_groups(vc, {s.name: spec for s in specs})
    kvc = get_kv_cache_config_from_groups(vc, groups, num_blocks * spec.page_size_bytes * len(specs))
    assert kvc.num_blocks == num_blocks, (kvc.num_blocks, num_blocks)
    return kvc


def _prefix_hashes(tokens: list[int]) -> np.ndarray:
    h = np.zeros(len(tokens), dtype=np.uint64)
    acc = 1469598103934665603
    for i, t in enumerate(tokens):
        acc = (acc * 1099511628211 + int(t) + 1) % (1 << 61)
        h[i] = acc
    return h


def kv_rows(tokens: list[int], positions: np.ndarray, spec: LayerSpec) -> torch.Tensor:
    """The KV rows of `positions` for one layer: a function of each token's prefix and the layer (exact)."""
    h = _prefix_hashes(tokens)[positions]
    if spec.indexer:
        rows = (h[:, None] + np.uint64(31 * spec.salt) + np.arange(spec.width, dtype=np.uint64)[None, :]) % 251
        return torch.from_numpy(rows.astype(np.uint8))
    base = (h % np.uint64(65536)).astype(np.float32) + np.float32(0.25 * spec.salt)
    return torch.from_numpy(base[:, None] + np.arange(spec.width, dtype=np.float32)[None, :] / 1024)


# ---- fault injection on a worker's real copy engine ---------------------------------------


class FailedTicket(CopyTicket):
    """Test double: the ticket of a copy that failed at submission (nothing was copied)."""

    def __init__(self, direction: Direction, part, layer: int, nbytes: int, error: BaseException) -> None:
        super().__init__(direction, part, layer, nbytes)
        self._error = error

    def query(self) -> TicketState:
        return TicketState.FAILED

    def wait(self) -> None:
        raise CopyFailed(f"{self.describe()}: {self._error}") from self._error

    def make_compute_wait(self) -> None:
        self.wait()

    @property
    def error(self) -> BaseException | None:
        return self._error


def inject_fault(engine, hook) -> None:
    """Call `hook(direction, part, layer)` before every copy of `engine`; None removes it.

    The CPU engine has its own hook (run on its worker thread: the copy then
    fails asynchronously). Other engines get a test double around their real
    planned submissions (the worker's path): each part of a layer is submitted
    on its own, and a part whose hook raises is skipped and gets a failed ticket."""
    if isinstance(engine, CpuCopyEngine):
        engine.fault = hook
        return
    for name in ("submit_layer", "submit_layers"):  # back to the class's real submissions
        engine.__dict__.pop(name, None)
    if hook is None:
        return
    real = engine.submit_layer

    def submit_layer(plan, parts, layer):
        out = []
        for part in parts:
            try:
                hook(plan.direction, part, layer)
            except Exception as exc:  # noqa: BLE001 - the test's injected fault
                nbytes = plan.num_pages * engine.layout.part(part).page_bytes
                out.append(FailedTicket(plan.direction, part, layer, nbytes, exc))
                continue
            out += real(plan, (part,), layer)
        return out

    engine.submit_layer = submit_layer
    engine.submit_layers = lambda plan, jobs: [submit_layer(plan, parts, layer) for parts, layer in jobs]


# ---- vLLM's OffloadingConnector with a host-copy worker (its CUDA copy path stood in) -------------


class HostCopyOffloadingWorker(OffloadingWorker):
    """Test double for vLLM's `CPUOffloadingWorker`, the one part of vLLM's
    OffloadingConnector that needs CUDA (its swap kernels and streams). It
    copies the same canonical block tensors vLLM's connector worker hands it,
    with torch, between the KV tensors and host buffers of `num_chunks` chunks,
    synchronously (every job finished when it is submitted: the best case for
    vLLM's scheduler). `fail_loads` makes every load report failure, as a
    failed copy would."""

    def __init__(self, kv_caches, num_chunks: int, blocks_per_chunk: int) -> None:
        assert blocks_per_chunk == 1, "the double copies one block per chunk"
        self.tensors = [t.tensor for t in kv_caches.tensors]
        self.host = [torch.zeros((num_chunks, t.shape[1]), dtype=t.dtype) for t in self.tensors]
        self.finished: list[TransferResult] = []
        self.fail_loads = False

    def _copy(self, job_id: int, gpu, cpu, store: bool, ok: bool = True) -> bool:
        blocks = torch.from_numpy(gpu.block_ids.astype(np.int64))
        chunks = torch.from_numpy(cpu.block_ids.astype(np.int64))
        nbytes = 0
        if ok:
            for t, h in zip(self.tensors, self.host):
                if store:
                    h[chunks] = t[blocks].to("cpu")
                else:
                    t[blocks] = h[chunks].to(t.device)
                nbytes += len(blocks) * t.shape[1]
        self.finished.append(TransferResult(job_id, ok, nbytes, 0.0))
        return True

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id, src_spec, dst_spec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False, ok=not self.fail_loads)

    def get_finished(self) -> list[TransferResult]:
        done, self.finished = self.finished, []
        return done

    def wait(self, job_ids) -> None:
        pass  # every job finished at submission


class HostCopyOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec (its scheduler-side manager, sizes, LRU),
    with `HostCopyOffloadingWorker` as the worker. Loaded by vLLM's
    `OffloadingSpecFactory` from `spec_module_path`."""

    def get_worker(self, kv_caches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = HostCopyOffloadingWorker(kv_caches, self.num_chunks, self.blocks_per_chunk)
        return self._worker


def offloading_worker(connector) -> HostCopyOffloadingWorker:
    return connector.connector_worker.worker


# ---- the bench ------------------------------------------------------------------------------


class _HookedContext:
    """The forward context `start_load_kv` sees in an eager or piecewise step: attention
    metadata present, no full-graph replay (vLLM then calls the per-layer hooks)."""

    attn_metadata: dict = {"bench": None}
    cudagraph_runtime_mode = None


class _GraphContext:
    """The forward context `start_load_kv` sees before a full CUDA-graph replay (vLLM's V2
    runner starts the loads outside the forward's context) and after a forward."""

    attn_metadata = None
    cudagraph_runtime_mode = None


def wait_worker_saves(connector) -> None:
    """Test double for "the device finished the step's copies before the host asked":
    wait for every save copy the worker has in flight, so the step's report holds
    their verdicts (the connector itself never waits for a save)."""
    side = getattr(connector, "worker_side", None)
    for saves in list(side._saves) if side is not None else ():
        for t in saves.op.inflight:
            try:
                t.wait()
            except Exception:  # noqa: BLE001 - a failed copy: its verdict reports it
                pass


def copy_jobs(meta) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]:
    """(loads, saves) of one step's connector metadata, each (req id, first page, pages)."""
    if isinstance(meta, OffloadingConnectorMetadata):
        def gpu(job, spec):
            first = int(spec.block_indices[0]) if getattr(spec, "block_indices", None) is not None else -1
            return job.req_id, first, len(spec.block_ids)

        return ([gpu(j, j.dst_spec) for j in meta.load_jobs.values()],
                [gpu(j, j.src_spec) for j in meta.store_jobs.values()])
    return ([(j.req_id, j.first_position, len(j.device_pages)) for j in meta.loads],
            [(j.req_id, j.first_position, len(j.device_pages)) for j in meta.saves])


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
    workers: list  # the worker-role HiCacheConnectors, one per (TP) worker
    kv: list[dict[str, torch.Tensor]]  # per worker: vLLM's KV tensors by layer name
    specs: list[LayerSpec]
    hasher: object
    device: str
    aggregator: KVOutputAggregator = None  # type: ignore[assignment]
    mismatches: list[tuple[str, str, int]] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    held: dict[int, list[KVConnectorOutput]] = field(default_factory=dict)  # worker -> reports not yet delivered
    settle_saves: bool = True  # the GPU finished the step's saves before the host reports (deterministic)
    defer_finalize: bool = False  # vLLM's step order with a speculative draft model
    target_layers: int = TARGET_LAYERS
    _n: int = 0

    def __post_init__(self) -> None:
        self.aggregator = KVOutputAggregator(len(self.workers))

    @property
    def worker(self):  # worker 0
        return self.workers[0]

    @property
    def connector(self):  # the scheduler-role HiCacheConnector vLLM built
        return self.sched.connector

    @property
    def side(self):
        return self.connector.scheduler_side

    @property
    def cache(self):
        return self.side.cache

    def engines(self) -> list:
        return [w.worker_side.engine for w in self.workers]

    def set_fault(self, hook, worker: int | None = None) -> None:
        """Inject `hook` into one worker's copy engine (every worker's when None)."""
        for i, engine in enumerate(self.engines()):
            if worker is None or i == worker:
                inject_fault(engine, hook)

    def add(
        self, prompt: list[int], max_tokens: int = 1, req_id: str | None = None, cache_salt: str | None = None,
        lora=None,
    ) -> str:
        self._n += 1
        rid = req_id or f"r{self._n}"
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(rid, list(prompt), params, None, block_hasher=self.hasher, cache_salt=cache_salt,
                          lora_request=lora)
        self.sched.add_request(request)
        return rid

    def step(
        self, *, abort_before_forward: list[str] = (), hold: set[int] = frozenset(), full_graph: bool = False
    ) -> StepRecord:
        """One engine step. `hold`: workers whose report is held back, delivered with the next
        step's. `full_graph`: the forward is a full CUDA-graph replay (vLLM calls no layer hook)."""
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        for rid in abort_before_forward:
            self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        loads, saves = copy_jobs(meta)
        rec = StepRecord({}, loads, saves, set(), set(so.preempted_req_ids))
        work = []  # (req id, tokens, blocks, computed before, scheduled)
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests.get(rid)
            before = req.num_computed_tokens - n if req is not None else None
            rec.scheduled[rid] = (before, n)
            if req is not None and not req.is_finished():
                work.append((rid, list(req.all_token_ids), self.sched.kv_cache_manager.get_block_ids(rid)[0], before, n))
        ids = list(so.num_scheduled_tokens)
        outputs = [self._forward(w, kv, meta, so, work, ids, full_graph) for w, kv in zip(self.workers, self.kv)]
        for i, out in enumerate(outputs):
            rec.invalid_blocks |= out.kv_connector_output.invalid_block_ids
            if i in hold:  # this worker's report arrives late: the scheduler sees an empty one now
                self.held.setdefault(i, []).append(out.kv_connector_output)
                out.kv_connector_output = KVConnectorOutput(
                    finished_sending=set(), finished_recving=set(), invalid_block_ids=set(),
                    kv_connector_worker_meta=None)
            elif i in self.held:
                late = self.held.pop(i)
                merged = late[0].kv_connector_worker_meta
                for o in [*late[1:], out.kv_connector_output]:
                    if o.kv_connector_worker_meta is not None:
                        merged = o.kv_connector_worker_meta if merged is None else merged.aggregate(
                            o.kv_connector_worker_meta)
                out.kv_connector_output.kv_connector_worker_meta = merged
        mro = self.aggregator.aggregate(outputs)
        self.sched.update_from_output(so, mro)
        self.steps.append(rec)
        return rec

    def _forward(self, w, kv, meta, so, work, ids, full_graph: bool = False) -> ModelRunnerOutput:
        """One worker's forward, as vLLM 0.33's V2 model runner calls the connector
        (`vllm/v1/worker/gpu/kv_connector.py`): handle_preemptions and bind before the
        forward, sync loads started before it, the per-layer hooks inside it, then
        `post_forward`. With `defer_finalize` (a speculative model), `post_forward`
        reports before the draft (MTP) layers run and `wait_for_save` comes after them."""
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        context = _GraphContext() if full_graph else _HookedContext()
        if so.has_sync_kv_loads:
            w.start_load_kv(context)
        draft = [s for s in self.specs if s.layer >= self.target_layers]
        target = [s for s in self.specs if s.layer < self.target_layers]
        self._layers(w, kv, target, work, hooks=not full_graph)
        if not so.has_sync_kv_loads:
            w.start_load_kv(_GraphContext())  # after the forward, outside its context
        if self.defer_finalize:
            out = self._post_forward(w, so)
            self._layers(w, kv, draft, work, hooks=not full_graph)
            w.wait_for_save()
        else:
            self._layers(w, kv, draft, work, hooks=not full_graph)
            w.wait_for_save()
            if self.settle_saves:
                wait_worker_saves(w)
            out = self._post_forward(w, so)
        w.clear_connector_metadata()
        sampled = []
        for rid in ids:
            req = self.sched.requests.get(rid)
            done_prefill = req is not None and req.num_computed_tokens >= req.num_tokens
            sampled.append([SAMPLED] if done_prefill else [])
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled, kv_connector_output=out)

    def _layers(self, w, kv, specs, work, hooks: bool = True) -> None:
        """Run `specs` in forward order: check what each reads, write, call the hooks."""
        for spec in specs:
            if hooks and not spec.indexer:
                w.wait_for_layer_load(spec.name)  # vLLM's attention wrapper; the indexer runs before it, unwaited
            t = kv[spec.name]
            for rid, tokens, blocks, before, n in work:
                self._check(rid, spec, t, tokens, blocks, np.arange(before))
                pos = np.arange(before, min(before + n, len(tokens)))
                if len(pos):
                    self._write(spec, t, blocks, pos, tokens)
            if hooks and not spec.indexer:
                w.save_kv_layer(spec.name, t, None)

    @staticmethod
    def _post_forward(w, so) -> KVConnectorOutput:
        results = w.get_transfer_results(so.finished_req_ids)
        return KVConnectorOutput(
            finished_sending=results.finished_sending, finished_recving=results.finished_recving,
            failed_recving=results.failed_recving, invalid_block_ids=set(w.get_block_ids_with_load_errors()),
            kv_connector_stats=w.get_kv_connector_stats(), kv_connector_worker_meta=w.build_connector_worker_meta(),
        )

    def run(self, max_steps: int = 50) -> list[StepRecord]:
        """Step until every request finished and vLLM freed its blocks; returns the steps
        that scheduled tokens (a step that only carries reports is in `steps` alone)."""
        records = []
        for _ in range(max_steps):
            if not self.sched.requests:
                return records
            rec = self.step()
            if rec.scheduled:
                records.append(rec)
            else:  # an engine's idle step takes time too: the copy threads (GIL-bound on CPU) get to run
                time.sleep(IDLE_STEP_S)
        raise AssertionError(f"requests still unfinished after {max_steps} steps: {list(self.sched.requests)}")

    def _index(self, blocks, pos: np.ndarray):
        b = torch.from_numpy(np.asarray(blocks)[pos // BLOCK]).to(self.device)
        return b, torch.from_numpy(pos % BLOCK).to(self.device)

    def _write(self, spec: LayerSpec, t, blocks, pos, tokens) -> None:
        b, slot = self._index(blocks, pos)
        rows = kv_rows(tokens, pos, spec).to(t.device)
        if spec.dense:  # vLLM's [B, H, N, C] view: a token's row is [H, C]
            t[b, :, slot, :] = rows.view(len(pos), DENSE_HEADS, -1)
        else:
            t[b, slot] = rows

    def _read(self, spec: LayerSpec, t, blocks, pos):
        b, slot = self._index(blocks, pos)
        return t[b, :, slot, :].reshape(len(pos), -1) if spec.dense else t[b, slot]

    def _check(self, rid, spec: LayerSpec, t, tokens, blocks, pos) -> None:
        if not len(pos):
            return
        want = kv_rows(tokens, pos, spec).to(t.device)
        bad = (self._read(spec, t, blocks, pos) != want).any(dim=1).nonzero().flatten().cpu()
        for i in bad.tolist()[:4]:
            self.mismatches.append((rid, spec.name, int(pos[i])))

    def drop_vllm_prefix_cache(self) -> None:
        """Evict vLLM's own prefix cache (its L1), as memory pressure would."""
        assert self.sched.reset_prefix_cache(), "vLLM refused to reset its prefix cache"

    def locked_nodes(self) -> int:
        return sum(1 for n in self.cache.tree.nodes() if n.lock_ref)

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.connector.shutdown()


def vllm_config(model_dir: Path, kv_transfer: KVTransferConfig | None, *, device: str = "cpu", workers: int = 1,
                max_batched: int = 256, max_seqs: int = 8, max_model_len: int = 1024) -> VllmConfig:
    """vLLM's config for the tiny model: prefix caching, chunked prefill, `workers` TP ranks."""
    vc = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                                 max_model_len=max_model_len),
        scheduler_config=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_batched,
                                         max_model_len=max_model_len, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        # the executor named: vLLM's own pick refuses more TP ranks than GPUs, and the bench's workers share one
        parallel_config=ParallelConfig(tensor_parallel_size=workers,
                                       distributed_executor_backend="mp" if workers > 1 else None),
        kv_transfer_config=kv_transfer,
        device_config=DeviceConfig(device),
    )
    assert vc.cache_config.block_size == BLOCK, f"vLLM changed the block size to {vc.cache_config.block_size}"
    assert vc.parallel_config.world_size == workers
    return vc


def make_scheduler(vc: VllmConfig, kvc: KVCacheConfig) -> Scheduler:
    vc.cache_config.num_gpu_blocks = kvc.num_blocks
    return Scheduler(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
                     block_size=BLOCK, log_stats=True)


def block_hasher():
    init_none_hash(sha256)
    return get_request_block_hasher(BLOCK, sha256)


def make_bench(model_dir: Path, *, device: str = "cpu", shape: str = "v3", workers: int = 1, num_blocks: int = 64,
               host_pages: int = 64, max_batched: int = 256, policy: str = "recompute",
               connector: str = "hicache", debug_checks: bool = True, max_model_len: int = 1024,
               layout: str = "LBNHC", extra_config: dict | None = None) -> Bench:
    """The bench with `connector` "hicache" (ours) or "offloading" (vLLM's
    OffloadingConnector with `HostCopyOffloadingWorker`), at the same host bytes.
    `extra_config`: more of our connector's settings (e.g. the node tier's)."""
    layers = model_layers(model_dir)
    specs = layer_specs(shape, layers)
    host_bytes = host_pages * sum(s.page_bytes for s in specs)
    if connector == "hicache":
        extra = {"host_budget_bytes": host_bytes, "debug_checks": debug_checks, **(extra_config or {})}
        if device == "cpu":
            extra.update(io_backend="cpu", pin_host=False)  # on CUDA: the connector's defaults (auto, pinned)
        kt = KVTransferConfig(
            kv_connector="HiCacheConnector", kv_connector_module_path="hicache_cp.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy=policy, kv_connector_extra_config=extra,
        )
    elif connector == "offloading":
        extra = {"cpu_bytes_to_use": host_bytes, "spec_name": "HostCopyOffloadingSpec",
                 "spec_module_path": __name__}
        kt = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                              kv_load_failure_policy=policy, kv_connector_extra_config=extra)
    else:
        raise ValueError(f"unknown connector {connector!r}")
    vc = vllm_config(model_dir, kt, device=device, workers=workers, max_batched=max_batched,
                     max_model_len=max_model_len)
    if shape == "llama":
        kvc = dense_kv_cache_config(vc, specs, num_blocks, layout)
    else:
        kvc = kv_cache_config(specs, num_blocks)
    sched = make_scheduler(vc, generate_scheduler_kv_cache_config([kvc]))
    conns, kvs = [], []
    for _ in range(workers):
        conn = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kvc)
        if shape == "llama":  # vLLM's own allocation: one backing buffer, per-layer [B, H, N, C] views
            kv = allocate_kv_cache(kvc, torch.device(device), KVCacheLayout[layout])
            for t in kv.values():
                t.fill_(-1)
        else:
            kv = {s.name: torch.full((num_blocks, BLOCK, s.width), 255 if s.indexer else -1, dtype=s.dtype,
                                     device=device) for s in specs}
        conn.register_kv_caches(kv)
        if connector == "hicache" and device == "cuda":  # the CUDA default engine over pinned L2, not the CPU one
            side = conn.worker_side
            assert not isinstance(side.engine, CpuCopyEngine) and side.host_pool.pinned, (side.engine.name,)
        conns.append(conn)
        kvs.append(kv)
    return Bench(sched, conns, kvs, specs, block_hasher(), device, target_layers=layers)
