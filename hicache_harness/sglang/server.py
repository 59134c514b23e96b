"""An SGLang 0.5.23 prefill server: its real scheduler functions, a stand-in forward.

What is SGLang's own here: the request objects (`Req`), the request-to-token
pool, the paged token-to-KV allocator, the KV pools (the DSA pool, MLA
latent plus the indexer's key-with-scale buffer with index skip, or the MHA
pool, K and V per layer, for the target and for the MTP draft), the tree
cache chosen by name through SGLang's registry (`--radix-cache-backend
hicache-cp` builds ours; `radix` is SGLang's plain `RadixCache`), and the
scheduling functions, called in the order of
`Scheduler.get_new_batch_prefill` / `event_loop_normal`:

    stash the chunked request (checkpoint_kv_cache)
    PrefillAdder: add_chunked_req, then for each waiting request
        init_next_round_input (match_prefix) and add_one_req (init_load_back)
    ScheduleBatch.init_new + prepare_for_extend (allocation, maybe_hand_to_session)
    the TP worker's set_hicache_consumer, then the forward
    results: release_kv_cache (finished) or the chunk stays for the next step
    flush_pending_backups

The pools live on `ServerSpec.device`: "cpu", or "cuda" (SGLang's allocator
then runs its Triton kernels, and every byte is checked on the GPU). On CUDA
the streams are SGLang's: the scheduler works on a schedule stream (here the
default stream), and the forward runs on the model runner's forward stream (under `overlap`, after
the forward stream waited for the schedule stream, as `run_batch` does;
otherwise on the schedule stream, as `event_loop_normal` does). The TP
worker stand-in exposes that forward stream to the tree-cache factory as
SGLang's `tp_worker.model_runner.forward_stream`. The forward itself is
`forward.KVForward`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hicache_harness.sglang.env import TINY_LLAMA, TINY_MODEL, publish_server_args
from hicache_harness.sglang.forward import INDEX_BYTES, ForwardReport, KVForward  # noqa: F401 - re-exported


@dataclass(frozen=True)
class ServerSpec:
    """The pools and scheduling knobs of one harness server."""

    backend: str = "hicache-cp"  # a registered --radix-cache-backend name, or "radix"
    device: str = "cpu"  # where SGLang's pools live: "cpu" or "cuda"
    attention: str = "dsa"  # the pools' kind: "dsa" (MLA latent + indexer keys) or "mha" (K and V)
    page_size: int = 64
    device_pages: int = 64  # KV pool capacity in pages (page 0 is SGLang's padding)
    layers: int = 4
    skip_topk: tuple[bool, ...] = (False, True, False, True)  # DSA index skip: layers without index keys
    draft_layers: int = 1  # MTP layers (0: no draft)
    kv_lora_rank: int = 64
    rope_dim: int = 16
    kv_heads: int = 2  # MHA/GQA: the KV heads the pool keeps
    head_dim: int = 32
    v_head_dim: int | None = None  # MHA: V's head dim when it differs from K's (two allocations)
    max_prefill_tokens: int = 16384
    chunk_tokens: int | None = None  # SGLang's --chunked-prefill-size
    max_requests: int = 32
    context_len: int = 16384
    check_bytes: bool = True
    schedule_policy: str = "lpm"  # SGLang's --schedule-policy (lpm matches every waiting request first)
    overlap: bool = False  # event_loop_overlap's order (results of batch N after batch N+1's forward)
    kv_events: bool = False  # SGLang's enable_kv_cache_events: its radix cache records KV events (take_events)
    forward_delay_cycles: int = 0  # CUDA: each forward first keeps its stream busy this long
    full_graph: bool = False  # forwards replay as a full prefill CUDA graph (forward.KVForward)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token over every layer of every part of the pools."""
        if self.attention == "mha":
            per_layer = 2 * self.kv_heads * (self.head_dim + (self.v_head_dim or self.head_dim))
            return per_layer * (self.layers + self.draft_layers)
        latent = 2 * (self.kv_lora_rank + self.rope_dim)
        index = INDEX_BYTES * (sum(not s for s in self.skip_topk) + self.draft_layers)
        return latent * (self.layers + self.draft_layers) + index


class TpWorkerHooks:
    """What SGLang's TpModelWorker offers the tree cache: the counter registered with it,
    `set_hicache_consumer` at each forward's start, and its model runner's forward stream."""

    def __init__(self, forward_stream: Any = None) -> None:
        self.hicache_layer_transfer_counter: Any = None
        self.model_runner = _ModelRunnerStreams(forward_stream)

    def register_hicache_layer_transfer_counter(self, counter: Any) -> None:
        self.hicache_layer_transfer_counter = counter

    def set_hicache_consumer(self, consumer_index: int) -> None:
        if self.hicache_layer_transfer_counter is not None:
            self.hicache_layer_transfer_counter.set_consumer(consumer_index)


@dataclass
class _ModelRunnerStreams:
    """The one attribute of SGLang's ModelRunner the tree-cache factory reads."""

    forward_stream: Any


@dataclass(frozen=True)
class Pools:
    """SGLang's pools of one server: the target and draft KV pools and the cache params."""

    target: Any
    drafts: tuple[Any, ...]
    params: Any  # CacheInitParams: request-to-token pool, paged allocator, page size, draft pools


def build_pools(spec: ServerSpec) -> Pools:
    """SGLang's request-to-token pool, paged allocator and KV pools on `spec.device` (its
    runtime context must be published: `env.publish_server_args`)."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MHATokenToKVPool, ReqToTokenPool

    ps, device = spec.page_size, spec.device
    size = (spec.device_pages - 1) * ps

    def pool(layers: int, skip: tuple[bool, ...]) -> Any:
        if spec.attention == "mha":
            return MHATokenToKVPool(
                size=size, page_size=ps, dtype=torch.bfloat16, head_num=spec.kv_heads, head_dim=spec.head_dim,
                layer_num=layers, device=device, enable_memory_saver=False, v_head_dim=spec.v_head_dim,
            )  # fmt: skip
        if spec.attention != "dsa":
            raise ValueError(f"attention {spec.attention!r}: the harness builds 'dsa' or 'mha' pools")
        return DSATokenToKVPool(
            size=size, page_size=ps, kv_lora_rank=spec.kv_lora_rank, dtype=torch.bfloat16,
            qk_rope_head_dim=spec.rope_dim, layer_num=layers, device=device, index_head_dim=128,
            enable_memory_saver=False, kv_cache_dim=spec.kv_lora_rank + spec.rope_dim, skip_topk_layers=list(skip),
        )  # fmt: skip

    target = pool(spec.layers, spec.skip_topk)
    drafts = (pool(spec.draft_layers, (False,) * spec.draft_layers),) if spec.draft_layers else ()
    req_to_token = ReqToTokenPool(size=spec.max_requests, max_context_len=spec.context_len, device=device,
                                  enable_memory_saver=False)  # fmt: skip
    allocator = PagedTokenToKVPoolAllocator(size, ps, torch.bfloat16, device, target, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_to_token, token_to_kv_pool_allocator=allocator,
                             page_size=ps, mtp_draft_device_pools=drafts, enable_kv_cache_events=spec.kv_events)  # fmt: skip
    return Pools(target, drafts, params)


def _scheduler_thread(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a server method on the scheduler thread's stream (`SGLangPrefillServer.scheduling`)."""

    @functools.wraps(fn)
    def wrapper(self: SGLangPrefillServer, *args: Any, **kwargs: Any) -> Any:
        with self.scheduling():
            return fn(self, *args, **kwargs)

    return wrapper


@dataclass
class CallTimes:
    """Host seconds the scheduler thread spent in the tree cache, by call."""

    seconds: dict[str, list[float]] = field(default_factory=dict)

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        bucket = self.seconds.setdefault(name, [])

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                bucket.append(time.perf_counter() - t0)

        return wrapper


TIMED_CALLS = ("match_prefix", "init_load_back", "maybe_hand_to_session", "checkpoint", "flush_pending_backups",
               "evict", "free_kv_row", "prefix_device_indices")  # fmt: skip


class SGLangPrefillServer:
    """SGLang's pools, tree cache and scheduling functions, driven in the scheduler's order."""

    def __init__(
        self,
        spec: ServerSpec,
        workdir: Path,
        *,
        tree_cache_kwargs: dict[str, Any] | None = None,
        groups: tuple[Any, Any] | None = None,
    ) -> None:
        """`groups`: (SGLang's TP group coordinator, its DP-aware cache group) of this rank,
        for multi-rank harnesses; one rank without."""
        self.spec = spec
        self.groups = groups
        model = TINY_LLAMA if spec.attention == "mha" else TINY_MODEL
        self.server_args = publish_server_args(workdir, model=model, page_size=spec.page_size)
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.managers.schedule_policy import SchedulePolicy

        cuda = spec.device == "cuda"
        # The scheduler's stream is the process's default one, so whatever a test calls
        # outside the server's methods (an eviction, a flush) runs on it too.
        self.schedule_stream = torch.cuda.default_stream() if cuda else None
        self.forward_stream = torch.cuda.Stream() if cuda else None
        self.pools = build_pools(spec)
        if groups is not None:
            self.pools = dataclasses.replace(
                self.pools, params=dataclasses.replace(self.pools.params, tp_cache_group=groups[1])
            )
        self.target, self.drafts, self.params = self.pools.target, self.pools.drafts, self.pools.params
        self.req_to_token_pool, self.allocator = self.params.req_to_token_pool, self.params.token_to_kv_pool_allocator
        self.model_config = ModelConfig.from_server_args(self.server_args)
        self.worker = TpWorkerHooks(self.forward_stream)
        self.tree_cache = self._tree_cache(tree_cache_kwargs or {})
        self.forward = KVForward(self.target, self.drafts, self.req_to_token_pool.req_to_token, spec.check_bytes,
                                 spec.forward_delay_cycles, spec.full_graph)  # fmt: skip
        self.times = CallTimes()
        for name in TIMED_CALLS:
            setattr(self.tree_cache, name, self.times.timed(name, getattr(self.tree_cache, name)))
        self.policy = SchedulePolicy(spec.schedule_policy, self.tree_cache, False, False, False)
        self.waiting: list[Any] = []
        self.chunked_req: Any = None
        self.finished: list[Any] = []
        self._rid = 0
        self._batch: Any = None
        self.admissions: dict[str, tuple[int, int]] = {}  # rid -> (device-hit tokens, L2-loaded tokens)

    def _tree_cache(self, kwargs: dict[str, Any]) -> Any:
        if self.spec.backend == "radix":
            from sglang.srt.mem_cache.radix_cache import RadixCache

            return RadixCache(self.params)
        import hicache_cp.integrations.sglang  # noqa: F401 - registers the backend, as SGLang's plug-in loader does
        from sglang.srt.mem_cache.registry import TreeCacheBuildContext, get_radix_cache_factory

        factory = get_radix_cache_factory(self.spec.backend)
        if factory is None:
            raise ValueError(f"radix-cache backend {self.spec.backend!r} is not registered")
        ctx = TreeCacheBuildContext(
            server_args=self.server_args, params=self.params, is_hybrid_swa=False, is_hybrid_ssm=False,
            enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=self.worker,
            model_config=self.model_config, tp_size=self._tp_size(), tp_rank=0,
            tp_group=self.groups[0] if self.groups else None, is_dsa=self.spec.attention == "dsa",
        )  # fmt: skip
        return factory(ctx, **kwargs)  # kwargs (env, agreement): what SGLang's call leaves to the process

    def _tp_size(self) -> int:
        if self.groups is None:
            return 1
        import torch.distributed as dist

        return dist.get_world_size(self.groups[0].cpu_group)

    # ---- requests -----------------------------------------------------------------------

    def submit(self, tokens: Sequence[int], rid: str | None = None, *, lora_id: str | None = None,
               extra_key: str | None = None) -> Any:  # fmt: skip
        """Queue a request (`lora_id`, `extra_key`: SGLang's; both key its device prefix)."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        self._rid += 1
        params = SamplingParams(max_new_tokens=1)
        params.normalize(None)  # what the tokenizer manager does: stop strings resolved (none here)
        req = Req(rid or f"r{self._rid}", "", array("q", tokens), params, lora_id=lora_id, extra_key=extra_key)
        self.waiting.append(req)
        return req

    @contextlib.contextmanager
    def scheduling(self) -> Iterator[None]:
        """The scheduler thread's stream (CUDA: the schedule stream) for what runs inside."""
        if self.schedule_stream is None:
            yield
        else:
            with torch.cuda.stream(self.schedule_stream):
                yield

    @_scheduler_thread
    def run_until_idle(self, max_steps: int = 10_000) -> None:
        """Serve until no request waits: `event_loop_normal`'s order, or with `spec.overlap`
        `event_loop_overlap`'s (batch N+1 is scheduled and its forward launched before the
        results of batch N are processed)."""
        pending: list[Any] = []
        for _ in range(max_steps):
            if not self.waiting and self.chunked_req is None and not pending:
                return
            if not self.spec.overlap:
                self.step()
                continue
            reqs = self.prepare_batch()
            if reqs:
                self.run_forward(reqs)
            if pending:
                self.process_results(pending)
                self.tree_cache.flush_pending_backups()
            pending = reqs
        raise RuntimeError(f"requests still waiting after {max_steps} steps")

    def settle(self) -> None:
        """Wait for every copy in flight, then the after-batch flush: what landed is decided,
        so hits do not depend on copy timing (tests, benchmarks; a server calls
        flush_pending_backups after every batch and never waits)."""
        settle = getattr(getattr(self.tree_cache, "cache", None), "settle", None)
        if settle is not None:
            with self.scheduling():
                settle()
                self.tree_cache.flush_pending_backups()

    @_scheduler_thread
    def step(self) -> list[Any]:
        """One scheduler iteration: schedule, allocate, forward, process results."""
        reqs = self.prepare_batch()
        if reqs:
            self.run_batch(reqs)
        return reqs

    @_scheduler_thread
    def prepare_batch(self) -> list[Any]:
        """Stash the chunked request, schedule (match, admission, load-back) and allocate."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.mem_cache.common import checkpoint_kv_cache
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        if self.chunked_req is not None and self.chunked_req.extend_end > self.chunked_req.prefix_len:
            checkpoint_kv_cache(self.chunked_req, self.tree_cache)  # stash_chunked_request
        reqs = self._schedule()
        if not reqs:
            return []
        if self.chunked_req is not None:  # it runs a middle chunk in this batch (as the scheduler counts)
            self.chunked_req.inflight_middle_chunks += 1
        self._batch = ScheduleBatch.init_new(
            reqs, self.req_to_token_pool, self.allocator, self.tree_cache, self.model_config, False,
            SpeculativeAlgorithm.NONE, chunked_req=self.chunked_req,
        )  # fmt: skip
        self._batch.prepare_for_extend()
        return reqs

    @_scheduler_thread
    def run_batch(self, reqs: list[Any], results_order: Sequence[Any] | None = None) -> None:
        """The forward of the prepared batch, its results (in `results_order`, the batch's
        by default) and the after-batch flush."""
        self.run_forward(reqs)
        self.process_results(list(results_order) if results_order is not None else reqs)
        self.tree_cache.flush_pending_backups()

    @_scheduler_thread
    def run_forward(self, reqs: list[Any]) -> None:
        """The TP worker's forward: set_hicache_consumer at its start, then the layers; under
        overlap on the forward stream after it waited for the schedule stream (run_batch)."""
        stream = self.forward_stream if self.spec.overlap else None
        if stream is None:
            self.worker.set_hicache_consumer(self._batch.hicache_consumer_index)
            self.forward.run(reqs)
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.worker.set_hicache_consumer(self._batch.hicache_consumer_index)
            self.forward.run(reqs)

    @_scheduler_thread
    def abort(self, req: Any) -> None:
        """Abort a request as the scheduler does for a running one (release without caching)."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome
        from sglang.srt.mem_cache.common import release_kv_cache

        if req in self.waiting:
            self.waiting.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        if req.kv.holds_kv:
            release_kv_cache(req, self.tree_cache, checkpoint=False)
        self.tree_cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)

    @_scheduler_thread
    def retract(self, req: Any) -> None:
        """SGLang's retraction (`release_req`): the request goes back to the waiting queue."""
        from sglang.srt.managers.schedule_batch import release_req

        if req is self.chunked_req:
            self.chunked_req = None
        release_req(
            req=req, remaing_req_count=0, req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator, tree_cache=self.tree_cache, hisparse_coordinator=None,
        )  # fmt: skip
        self.waiting.insert(0, req)

    def _schedule(self) -> list[Any]:
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

        spec = self.spec
        running = ScheduleBatch(reqs=[], batch_is_full=False)
        self.policy.calc_priority(self.waiting, running)
        adder = PrefillAdder(spec.page_size, self.tree_cache, self.allocator, running, 0.0,
                             spec.max_prefill_tokens, spec.chunk_tokens)  # fmt: skip
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in list(self.waiting):
            if adder.budget_state() == AddReqResult.OTHER:
                break
            req.init_next_round_input(self.tree_cache)
            if adder.add_one_req(req, has_chunked_req=self.chunked_req is not None,
                                 truncation_align_size=None) != AddReqResult.CONTINUE:  # fmt: skip
                break
        for req in adder.can_run_list:  # first admission: where its prefix came from
            self.admissions.setdefault(req.rid, (req.prefix_len - req.host_loaded_length, req.host_loaded_length))
        admitted = set(map(id, adder.can_run_list))
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        return list(adder.can_run_list)

    @_scheduler_thread
    def process_results(self, reqs: list[Any]) -> None:
        from sglang.srt.mem_cache.common import release_kv_cache

        for req in reqs:
            if req.inflight_middle_chunks > 0:  # this batch ran a middle chunk: stashed at the next step
                req.inflight_middle_chunks -= 1
                continue
            aborted = req.to_finish is not None
            if not aborted:
                req.output_ids.append(1)
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, self.tree_cache, checkpoint=not aborted)
                self.finished.append(req)

    def close(self) -> None:
        close = getattr(self.tree_cache, "close", None)
        if close is not None:
            close()
