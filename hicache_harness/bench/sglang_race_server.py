"""One SGLang prefill server of the race: SGLang's pools on a device, one tree cache, its scheduler's calls.

`RaceServer` is `hicache_harness.sglang.server.SGLangPrefillServer` (SGLang's request
objects, `PrefillAdder`, `ScheduleBatch.prepare_for_extend`,
`release_kv_cache`, in `event_loop_normal`'s order) with what the race
changes:

- the pools: SGLang's `MLATokenToKVPool` or `DSATokenToKVPool` (the indexer
  on every layer) at DeepSeek-V3 widths, or `MHATokenToKVPool` (K and V, a
  Llama's widths), on the race's device, no draft;
- the tree cache, built the way SGLang builds it:
      radix           SGLang's `RadixCache` (device tier only)
      hicache-cp      `--radix-cache-backend hicache-cp`: SGLang's registry factory
      sglang-hicache  `--enable-hierarchical-cache`: `create_unified_radix_cache` (its
                      `UnifiedRadixCache`, `HybridCacheController`, host pools and JIT
                      kernels, with `--hicache-io-backend`/`--hicache-mem-layout`), its
                      controller's load and write fences on the forward stream as
                      SGLang's scheduler sets them, and its tree core chosen per
                      instance (`CacheInitParams.tree_core_backend`);
- the scheduler's calls SGLang makes only for its own HiCache:
  `check_hicache_events()` at the start of every scheduling round and
  `batch.hicache_consumer_index = ready_to_load_host_cache()` before
  `prepare_for_extend` (`Scheduler.get_next_batch_to_run`);
- a round that admits nothing while requests wait: SGLang 0.5.23's scheduler
  then calls nothing of a registered tree cache (`check_hicache_events` only
  for its own HiCache, `flush_pending_backups` only after a batch), and the
  race calls nothing either; it counts such rounds (`idle_rounds`). Without
  a batch in flight nothing changes between them for `radix` or hicache-cp
  (its undecided backups never hold device pages: `radix_cache`), so for
  those one such round is a server stalled for good, and the race fails it
  at once (`Stalled`); SGLang's HiCache may make progress in one (its
  events are checked each round);
- the forward: `sglang_race_forward.RaceForward` (bytes made and checked on
  the device, a compute-bound stand-in for the model);
- the clock: `SchedulerClock` times, on the scheduler thread, every call the
  scheduler makes into the tree cache (`TREE_CALLS`) and into its layer
  counter from the forward (`HOOK_CALLS`), outermost calls only, the same
  way for every backend; with `breakdown`, the calls inside them too
  (`INNER_CALLS`: each backend's copy engine or controller, its poll, its hooks).

Host bytes: SGLang sizes its host pool as `--hicache-ratio` x the device
pool's tokens (plus one padding page); `host_bytes` computes the same and
hicache-cp gets that budget, so both hold the same bytes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hicache_harness.bench.sglang_race_forward import INDEX_KEY_BYTES, INDEX_SCALE_BYTES, RaceForward
from hicache_harness.sglang.env import import_sglang, publish_server_args
from hicache_harness.sglang.server import Pools, ServerSpec, SGLangPrefillServer, TpWorkerHooks

BACKENDS = ("radix", "hicache-cp", "sglang-hicache")
POOLS = ("mla", "dsa", "mha")

#: What SGLang's scheduler (and the functions it calls) call on a tree cache, per request or round.
TREE_CALLS = (
    "match_prefix", "init_load_back", "prefix_device_indices", "maybe_hand_to_session", "checkpoint",
    "cache_finished_req", "cache_unfinished_req", "flush_pending_backups", "check_hicache_events",
    "ready_to_load_host_cache", "evict", "evict_for_alloc", "free_kv_row", "on_release", "finish", "lock", "unlock",
    "inc_lock_ref", "dec_lock_ref", "release_aborted_request", "load_back_is_cache_owned",
)  # fmt: skip
#: What the forward calls on the layer counter (the pools' get_key_buffer; the TP worker at forward start).
HOOK_CALLS = ("wait_until", "set_consumer")
#: `--breakdown`: per backend, (attribute path from the tree cache, methods) timed at any depth
#: on the scheduler thread: where the tree cache's and the hooks' time goes.
INNER_CALLS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "hicache-cp": (
        ("copies", ("begin", "finish", "prepare", "reached")),
        ("cache", ("poll", "match_prefix", "reserve_host_copy", "on_layers_end", "insert", "loads_read",
                   "ensure_free", "load_into", "release")),
        ("cache.engine", ("plan", "submit_layers", "submit_layer", "pin_checks_order")),
    ),
    "sglang-hicache": (
        ("", ("insert", "_evict", "load_back", "_execute_kv_backup", "_drain_device_frees", "_drain_host_frees",
              "writing_check", "loading_check")),
        ("cache_controller", ("write", "load", "start_writing", "start_loading", "move_hybrid_indices",
                              "allocate_host_transfers", "append_host_mem_release")),
    ),
}  # fmt: skip


class Stalled(RuntimeError):
    """A scheduling round of `radix` or hicache-cp admitted nothing while requests waited."""


@dataclass(frozen=True)
class RaceSpec:
    """One server of the race."""

    backend: str
    pools: str = "mla"  # "mla", "dsa" (the DSA indexer's keys on every layer) or "mha" (K and V, Llama)
    device: str = "cuda"
    page_size: int = 64
    device_pages: int = 256  # the KV pool in pages (page 0 is SGLang's padding)
    layers: int = 61
    kv_lora_rank: int = 512
    rope_dim: int = 64
    kv_heads: int = 8  # MHA: key/value heads and head dim (Llama-3-8B's)
    head_dim: int = 128
    host_ratio: float = 2.0  # SGLang's --hicache-ratio; hicache-cp gets the same bytes
    sglang_io_backend: str = "kernel"
    sglang_layout: str = "page_first"
    tree_core: str = "rust"  # SGLang's tree core for sglang-hicache ("python" or "rust")
    matmuls: int = 2  # per layer, of [dim, dim]
    dim: int = 4096
    chunk_tokens: int = 4096
    max_prefill_tokens: int = 16384
    context_len: int = 65536
    check_bytes: bool = True
    breakdown: bool = False  # time the calls inside the tree cache too (INNER_CALLS)
    settings: tuple[tuple[str, str], ...] = ()  # hicache-cp's Config fields set for the run (HICACHE_<FIELD>)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r}: one of {', '.join(BACKENDS)}")
        if self.pools not in POOLS:
            raise ValueError(f"pools {self.pools!r}: one of {', '.join(POOLS)}")

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token over every layer (the DSA indexer's included)."""
        if self.pools == "mha":
            return self.layers * 2 * self.kv_heads * self.head_dim * 2
        per_layer = (self.kv_lora_rank + self.rope_dim) * 2
        if self.pools == "dsa":
            per_layer += INDEX_KEY_BYTES + INDEX_SCALE_BYTES
        return self.layers * per_layer

    @property
    def host_bytes(self) -> int:
        """SGLang's host pool for this device pool (`HostKVCache`'s sizing): hicache-cp's budget."""
        tokens = (self.device_pages - 1) * self.page_size
        pages = int(tokens * self.host_ratio) // self.page_size + 1
        return pages * self.page_size * self.token_bytes


@dataclass
class SchedulerClock:
    """Host seconds the scheduler thread spends in named calls, outermost calls only.

    A call made from inside another timed call (the tree cache calling its own
    `lock`, a hook reached from `checkpoint`) counts in the outer one only;
    calls from other threads are not timed. `cpu_seconds` is the same calls' CPU
    time on the scheduler thread (`time.thread_time`): what a call computes, while
    its wall time also holds what it waits for (the GIL held by another thread, a
    host sync).
    """

    seconds: dict[str, list[float]] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    #: `wrap(..., inner=True)`'s calls: every call on the scheduler thread, at any depth (the parts of
    #: the outermost calls' time; never in `total`)
    inner_seconds: dict[str, list[float]] = field(default_factory=dict)
    inner_cpu_seconds: dict[str, float] = field(default_factory=dict)
    _thread: int = field(default_factory=threading.get_ident)
    _depth: int = 0

    def wrap(self, obj: Any, names: Iterable[str], group: str, inner: bool = False) -> None:
        """Time `obj`'s methods `names` (those it has) as `group.name`; `inner`: in
        `inner_seconds`, each call on the scheduler thread, nested or not (where an
        outermost call's time goes)."""
        for name in names:
            fn = getattr(obj, name, None)
            if callable(fn):
                setattr(obj, name, self._timed(f"{group}.{name}", fn, outermost=not inner))

    def _timed(self, key: str, fn: Callable[..., Any], outermost: bool) -> Callable[..., Any]:
        seconds, cpu = (self.seconds, self.cpu_seconds) if outermost else (self.inner_seconds, self.inner_cpu_seconds)
        bucket = seconds.setdefault(key, [])
        cpu.setdefault(key, 0.0)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if (outermost and self._depth) or threading.get_ident() != self._thread:
                return fn(*args, **kwargs)
            self._depth += outermost
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                bucket.append(time.perf_counter() - t0)
                cpu[key] += time.thread_time() - c0
                self._depth -= outermost

        return timed

    def total(self) -> float:
        return sum(sum(xs) for xs in self.seconds.values())


def build_race_pools(spec: RaceSpec) -> Pools:
    """SGLang's request-to-token pool, paged allocator and MLA, DSA or MHA KV pool on
    `spec.device` (SGLang's runtime context must be published: `env.publish_server_args`)."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool

    ps = spec.page_size
    size = (spec.device_pages - 1) * ps
    if spec.pools == "mha":
        target = MHATokenToKVPool(size, ps, torch.bfloat16, spec.kv_heads, spec.head_dim, spec.layers, spec.device,
                                  False, enable_alt_stream=False)  # fmt: skip
    elif spec.pools == "mla":
        target = MLATokenToKVPool(size, ps, torch.bfloat16, spec.kv_lora_rank, spec.rope_dim, spec.layers,
                                  spec.device, False)  # fmt: skip
    else:
        target = DSATokenToKVPool(
            size=size, page_size=ps, kv_lora_rank=spec.kv_lora_rank, dtype=torch.bfloat16,
            qk_rope_head_dim=spec.rope_dim, layer_num=spec.layers, device=spec.device, index_head_dim=128,
            enable_memory_saver=False, kv_cache_dim=spec.kv_lora_rank + spec.rope_dim,
        )  # fmt: skip
    req_to_token = ReqToTokenPool(size=32, max_context_len=spec.context_len, device=spec.device,
                                  enable_memory_saver=False)  # fmt: skip
    allocator = PagedTokenToKVPoolAllocator(size, ps, torch.bfloat16, spec.device, target, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_to_token, token_to_kv_pool_allocator=allocator,
                             page_size=ps)  # fmt: skip
    return Pools(target, (), params)


def hicache_cp_env(spec: RaceSpec) -> dict[str, str]:
    """hicache-cp's settings for the race: SGLang's host bytes; on CPU the cpu engine, unpinned;
    then the spec's own `settings`."""
    env = {"HICACHE_HOST_BUDGET_BYTES": str(spec.host_bytes)}
    if spec.device == "cpu":
        env.update(HICACHE_IO_BACKEND="cpu", HICACHE_PIN_HOST="false")
    env.update((f"HICACHE_{key.upper()}", value) for key, value in spec.settings)
    return env


class RaceServer(SGLangPrefillServer):
    """`SGLangPrefillServer` with the race's pools, tree caches, forward and clock (module docstring)."""

    def __init__(self, spec: RaceSpec, workdir: Path) -> None:  # noqa: D107 - the base's state, set here
        self.race = spec
        self.spec = ServerSpec(backend=spec.backend, page_size=spec.page_size, device_pages=spec.device_pages,
                               layers=spec.layers, max_prefill_tokens=spec.max_prefill_tokens,
                               chunk_tokens=spec.chunk_tokens, context_len=spec.context_len,
                               check_bytes=spec.check_bytes)  # fmt: skip
        hicache = spec.backend == "sglang-hicache"
        extra = {"enable_hierarchical_cache": True, "hicache_ratio": spec.host_ratio,
                 "hicache_io_backend": spec.sglang_io_backend, "hicache_mem_layout": spec.sglang_layout,
                 "hicache_write_policy": "write_through", "disable_overlap_schedule": True} if hicache else {}  # fmt: skip
        import_sglang()
        self.server_args = publish_server_args(workdir, page_size=spec.page_size, **extra)
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.managers.schedule_policy import SchedulePolicy

        self.groups = None
        # One rank, SGLang's normal loop: the forward runs on the scheduler's stream (no overlap).
        self.schedule_stream = torch.cuda.default_stream() if spec.device != "cpu" else None
        self.forward_stream = None
        self.pools = build_race_pools(spec)
        self.target, self.drafts, self.params = self.pools.target, (), self.pools.params
        self.req_to_token_pool, self.allocator = self.params.req_to_token_pool, self.params.token_to_kv_pool_allocator
        self.model_config = ModelConfig.from_server_args(self.server_args)
        self.worker = TpWorkerHooks()
        self.forward = RaceForward(self.target, self.req_to_token_pool.req_to_token, matmuls=spec.matmuls,
                                   dim=spec.dim, check=spec.check_bytes)  # fmt: skip
        self.sglang_bytes = {"h2d": 0, "d2h": 0}
        self.tree_cache = self._build_tree_cache()
        self.clock = SchedulerClock()
        self.clock.wrap(self.tree_cache, TREE_CALLS, "tree")
        if self.target.layer_transfer_counter is not None:
            self.clock.wrap(self.target.layer_transfer_counter, HOOK_CALLS, "hook")
        if spec.breakdown:
            for path, names in INNER_CALLS.get(spec.backend, ()):
                obj = self.tree_cache
                for attr in filter(None, path.split(".")):
                    obj = getattr(obj, attr)
                self.clock.wrap(obj, names, path or "tree", inner=True)
        self.policy = SchedulePolicy(self.spec.schedule_policy, self.tree_cache, False, False, False)
        self.waiting: list[Any] = []
        self.chunked_req: Any = None
        self.finished: list[Any] = []
        self._rid = 0
        self._batch: Any = None
        self.admissions: dict[str, tuple[int, int]] = {}
        self.idle_rounds = 0

    # ---- the tree caches, as SGLang builds them -----------------------------------------------

    def _build_tree_cache(self) -> Any:
        spec = self.race
        if spec.backend == "radix":
            from sglang.srt.mem_cache.radix_cache import RadixCache

            return RadixCache(self.params)
        from sglang.srt.mem_cache.registry import TreeCacheBuildContext

        ctx = TreeCacheBuildContext(
            server_args=self.server_args, params=self.params, is_hybrid_swa=False, is_hybrid_ssm=False,
            enable_hierarchical_cache=spec.backend == "sglang-hicache", disable_radix_cache=False,
            tp_worker=self.worker, model_config=self.model_config, tp_size=1, tp_rank=0, tp_group=None,
            is_dsa=spec.pools == "dsa",
        )  # fmt: skip
        if spec.backend == "hicache-cp":
            import hicache_cp.integrations.sglang  # noqa: F401 - registers the backend, as SGLang's plug-in loader does
            from sglang.srt.mem_cache.registry import get_radix_cache_factory

            return get_radix_cache_factory("hicache-cp")(ctx, env=hicache_cp_env(spec))
        return self._sglang_hicache(ctx)

    def _sglang_hicache(self, ctx: Any) -> Any:
        from sglang.srt.mem_cache.registry import create_unified_radix_cache

        self.params.tree_core_backend = self.race.tree_core
        cache = create_unified_radix_cache(ctx)
        controller = cache.cache_controller
        if self.race.device != "cpu":  # Scheduler.__init__: fences on the model runner's forward stream
            controller.load_fence_stream = torch.cuda.current_stream()
            controller.write_fence_stream = torch.cuda.current_stream()
        self._count_bytes(controller, "start_writing", "ack_write_queue", "d2h")
        self._count_bytes(controller, "start_loading", "ack_load_queue", "h2d")
        return cache

    def _count_bytes(self, controller: Any, method: str, acks: str, direction: str) -> None:
        """Bytes each way: each submission's ack (`HiCacheAck.num_bytes`, SGLang's own count)."""
        fn = getattr(controller, method)

        def counted(*args: Any, **kwargs: Any) -> Any:
            queue = getattr(controller, acks)
            before = len(queue)
            out = fn(*args, **kwargs)
            self.sglang_bytes[direction] += sum(ack.num_bytes for ack in queue[before:])
            return out

        setattr(controller, method, counted)

    # ---- what the race reports about its tree cache -------------------------------------------

    def host_pool_bytes(self) -> int:
        """Host bytes the tree cache holds (0 without a host tier)."""
        if self.race.backend == "hicache-cp":
            return int(self.tree_cache.cache.host_pool.split.used_bytes)
        if self.race.backend == "sglang-hicache":
            host = self.tree_cache.cache_controller.mem_pool_host
            entries = [e.host_pool for e in getattr(host, "entries", [])] or [host]
            return sum(int(p.size) * int(p.size_per_token) for p in entries)
        return 0

    def tree_core(self) -> str | None:
        core = getattr(self.tree_cache, "tree_core", None)
        return None if core is None else type(core).__name__

    def bytes_moved(self) -> tuple[int, int]:
        """(host-to-device, device-to-host) bytes."""
        if self.race.backend == "hicache-cp":
            stats = self.tree_cache.cache.stats()
            return int(stats["bytes_h2d"]), int(stats["bytes_d2h"])
        return self.sglang_bytes["h2d"], self.sglang_bytes["d2h"]

    # ---- the scheduler's round, with SGLang's HiCache calls -----------------------------------

    def prepare_batch(self) -> list[Any]:
        """`SGLangPrefillServer.prepare_batch` plus what `Scheduler.get_next_batch_to_run` does
        for its own HiCache: events first, the load started before `prepare_for_extend`."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.mem_cache.common import checkpoint_kv_cache
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        hicache = self.race.backend == "sglang-hicache"
        if hicache:
            self.tree_cache.check_hicache_events()
        if self.chunked_req is not None and self.chunked_req.extend_end > self.chunked_req.prefix_len:
            checkpoint_kv_cache(self.chunked_req, self.tree_cache)
        reqs = self._schedule()
        if not reqs:
            if self.waiting:
                self.idle_rounds += 1
                if not hicache:
                    raise Stalled(f"{self.race.backend}: a round admitted none of {len(self.waiting)} waiting requests "
                                  f"(device free {self.allocator.available_size()}, evictable "
                                  f"{self.tree_cache.evictable_size()}, protected {self.tree_cache.protected_size()} "
                                  "tokens) and nothing else would ever change that")  # fmt: skip
            return []
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        self._batch = ScheduleBatch.init_new(
            reqs, self.req_to_token_pool, self.allocator, self.tree_cache, self.model_config, False,
            SpeculativeAlgorithm.NONE, chunked_req=self.chunked_req,
        )  # fmt: skip
        if hicache:
            self._batch.hicache_consumer_index = self.tree_cache.ready_to_load_host_cache()
        self._batch.prepare_for_extend()
        return reqs

    def settle(self) -> None:
        """Wait for every copy in flight and apply what landed (tests; the race does not settle)."""
        if self.race.backend == "sglang-hicache":
            if self.race.device != "cpu":
                torch.cuda.synchronize()
            self.tree_cache.check_hicache_events()
        else:
            super().settle()

    def close(self) -> None:
        if self.race.backend == "sglang-hicache":
            self.tree_cache.release_host_resources()
        else:
            super().close()
