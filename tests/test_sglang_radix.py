"""`--radix-cache-backend hicache-cp` against SGLang 0.5.23's real classes, on CPU and CUDA.

SGLang's own request objects, request-to-token pool, paged allocator, KV
pools (DSA: target with index skip and MTP draft; MHA: K and V per layer,
GQA heads), registry and scheduling functions (`PrefillAdder`,
`ScheduleBatch.prepare_for_extend`, `checkpoint_kv_cache`,
`release_kv_cache`, `release_req`) drive the plug-in in the scheduler's
order (`hicache_harness.sglang.server`). A stand-in forward writes each
new token's deterministic bytes and checks every byte of every prefix token
each layer reads (MLA latent, indexer keys, K and V, draft), so a wrong
load, a late wait or a partial hit shows as mismatched bytes.

Every scenario whose faults need no CPU copy-engine hook runs twice: with
SGLang's pools on the CPU, and (marked `gpu`) on CUDA, where the copy
engine is the CUDA default and every byte is compared on the GPU.

DSA pools, per token and layer: 160 latent bytes (kv_lora 64 + rope 16,
bf16) and, on target layers 0 and 2 and the draft layer, 132 indexer bytes:
1,196 bytes a token in all, 76,544 a 64-token page. MHA pools: 2 KV heads
of 32 (bf16) for K and for V, 256 bytes a token and layer, 1,280 a token.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("sglang", reason="sglang not installed (scripts/install_sglang.sh)")

from hicache_cp import ConsistencyError, Model, Part  # noqa: E402
from hicache_harness.sglang.env import import_sglang  # noqa: E402
from hicache_harness.sglang.server import SGLangPrefillServer, ServerSpec  # noqa: E402

import_sglang()  # SGLang's configs package on a CPU torch (see hicache_harness.sglang.env)
from hicache_cp.io.base import CopyFailed, Direction  # noqa: E402

pytestmark = pytest.mark.slow  # importing SGLang costs ~10 s once per process

PAGE = 64
TOKEN_BYTES = ServerSpec().token_bytes  # DSA pools: what one prefix token costs the checks
HAS_CUDA = torch.cuda.is_available()
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")])


def budget(pages: int, token_bytes: int = TOKEN_BYTES) -> int:
    return (pages + 1) * token_bytes * PAGE


def server_env(l2_pages: int, spec: ServerSpec) -> dict[str, str]:
    """The plug-in's settings: L2 of `l2_pages` pages, invariant checks on; the CPU copy
    engine on CPU pools, the CUDA default (pinned host memory) on CUDA ones."""
    env = {"HICACHE_HOST_BUDGET_BYTES": str(budget(l2_pages, spec.token_bytes)), "HICACHE_DEBUG_CHECKS": "true",
           "HICACHE_L2_FREE_ROOM": "0"}  # fmt: skip
    if spec.device == "cpu":
        env.update({"HICACHE_IO_BACKEND": "cpu", "HICACHE_PIN_HOST": "false"})
    return env


def _servers(tmp_path: Path, device: str):
    """Yield a server factory for pools on `device`; close every server made afterwards."""
    made: list[SGLangPrefillServer] = []

    def factory(l2_pages: int = 64, env: dict[str, str] | None = None, **fields: object) -> SGLangPrefillServer:
        """`env`: more of hicache-cp's settings (HICACHE_<FIELD> variables)."""
        spec = ServerSpec(**{"device": device, **fields})  # type: ignore[arg-type]
        env = {**server_env(l2_pages, spec), **(env or {})}
        server = SGLangPrefillServer(spec, tmp_path / f"s{len(made)}", tree_cache_kwargs={"env": env})
        made.append(server)
        return server

    yield factory
    for s in made:
        s.close()


@pytest.fixture(params=["cpu", CUDA])
def make_server(request: pytest.FixtureRequest, tmp_path: Path):
    """Servers with SGLang's pools on the CPU, and (marked gpu) on CUDA."""
    yield from _servers(tmp_path, request.param)


@pytest.fixture
def make_cuda_server(tmp_path: Path):
    """Servers on CUDA only (tests marked gpu)."""
    yield from _servers(tmp_path, "cuda")


@pytest.fixture
def make_cpu_server(tmp_path: Path):
    """Servers on the CPU only: the scenarios whose faults need the CPU copy engine's hook."""
    yield from _servers(tmp_path, "cpu")


def prompt(seed: int, pages: int, tail: int = 9) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(1, 900, pages * PAGE + tail)]


def serve(server: SGLangPrefillServer, tokens: list[int]):
    """One request to completion, then its copies decided (the next batch's flush, after they landed)."""
    req = server.submit(tokens)
    server.run_until_idle()
    server.settle()
    return req


def in_l2_only(server: SGLangPrefillServer, seed: int, pages: int = 5) -> list[int]:
    """A prompt served once (its whole pages now in L2), then gone from SGLang's device tree."""
    tokens = prompt(seed, pages)
    serve(server, tokens)
    evict_device(server)
    return tokens


def evict_device(server: SGLangPrefillServer) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    server.tree_cache.evict(EvictParams(num_tokens=10**9))
    assert server.tree_cache.evictable_size() == 0


def clean(server: SGLangPrefillServer) -> None:
    """Once every copy is decided: no mismatch anywhere, the cache's invariants hold,
    nothing of ours is left held."""
    server.settle()
    report = server.forward.report
    assert report.mismatched_bytes == 0, report.mismatches
    server.tree_cache.cache.check_invariants()
    assert not server.tree_cache._flows, server.tree_cache._flows
    assert server.tree_cache.protected_size() == 0


# ---- scenarios -------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["dsa", "mha"])
def test_miss_backs_up_every_whole_page_and_a_repeat_is_a_device_hit(make_server, attention: str) -> None:
    s = make_server(attention=attention)
    tb = s.spec.token_bytes
    a = prompt(1, 5)
    r1 = serve(s, a)
    # A miss: all 329 tokens computed; the 5 whole pages reserved at the forward's start, committed after.
    assert r1.prefix_len == 0 or r1.host_hit_length == 0
    assert s.forward.report.computed_tokens == len(a) and s.forward.report.checked_bytes == 0
    assert s.tree_cache.stats.reserved_pages == 5
    stats = s.tree_cache.cache.stats()
    assert stats["backups_committed"] == 1 and stats["bytes_d2h"] == 5 * PAGE * tb
    # The same prompt again: SGLang's own device tree serves it; L2 offers nothing past it.
    r2 = serve(s, a)
    assert r2.host_hit_length == 0 and s.tree_cache.stats.offered_tokens == 0
    assert s.forward.report.checked_bytes == 5 * PAGE * tb
    clean(s)


@pytest.mark.parametrize("attention", ["dsa", "mha"])
def test_l2_hit_after_device_eviction_loads_every_part(make_server, attention: str) -> None:
    s = make_server(attention=attention)
    tb = s.spec.token_bytes
    a = in_l2_only(s, 2)
    r = serve(s, a)
    # SGLang's device tree is empty: the whole-page prefix (5 pages) comes back from L2,
    # every part: DSA latent, indexer keys of layers 0 and 2, the draft's latent and keys;
    # MHA K and V of every layer, the draft's K and V.
    assert r.host_hit_length == 5 * PAGE and s.tree_cache.stats.loaded_tokens == 5 * PAGE
    assert s.tree_cache.cache.stats()["bytes_h2d"] == 5 * PAGE * tb
    assert s.forward.report.checked_bytes == 5 * PAGE * tb
    assert s.forward.report.computed_tokens == 2 * len(a) - 5 * PAGE
    clean(s)
    # The loaded pages joined SGLang's device tree at the checkpoint: a third run is a device hit.
    r3 = serve(s, a)
    assert r3.host_hit_length == 0 and s.tree_cache.stats.loaded_tokens == 5 * PAGE
    clean(s)


def test_parts_read_before_their_layers_hook_are_waited_for_earlier(make_cpu_server) -> None:
    """The indexer reads layer l's keys before layer l's attention runs the hook, and the
    MTP draft reads its own keys before its hook: a slow copy of those parts is waited
    for at the hook before (layer l-1's, the last target layer's), never read early."""
    slow = {(Direction.H2D, Part.TARGET_STATE, 2), (Direction.H2D, Part.DRAFT_STATE, 0)}

    def slow_copy(direction, part, layer) -> None:  # type: ignore[no-untyped-def]
        if (direction, part, layer) in slow:
            time.sleep(0.2)

    s = make_cpu_server()
    a = in_l2_only(s, 14)
    for pool in (s.target, *s.drafts):  # what L1 held is gone: only the load brings the bytes back
        for buf in (*pool.kv_buffer, *getattr(pool, "index_k_with_scale_buffer", ())):
            buf.view(torch.uint8).fill_(0x5A)
    s.tree_cache.cache.engine.fault = slow_copy
    try:
        r = serve(s, a)
    finally:
        s.tree_cache.cache.engine.fault = None
    assert r.host_hit_length == 5 * PAGE
    assert s.forward.report.checked_bytes == 5 * PAGE * TOKEN_BYTES
    clean(s)  # no byte mismatched: every part was loaded before it was read


@pytest.mark.parametrize("attention", ["dsa", "mha"])
def test_partial_hit_continues_sglangs_device_prefix(make_server, attention: str) -> None:
    s = make_server(attention=attention)
    a = prompt(3, 5)
    serve(s, a)
    evict_device(s)
    serve(s, a[: 2 * PAGE] + [7, 7, 7])  # loads pages 0-1 from L2; they join the device tree
    loaded_before = s.tree_cache.stats.loaded_tokens
    assert loaded_before == 2 * PAGE
    r = serve(s, a)
    # Device prefix 2 pages (SGLang's tree), then pages 2-4 from L2 continuing it.
    assert r.host_hit_length == 3 * PAGE
    assert s.tree_cache.stats.loaded_tokens - loaded_before == 3 * PAGE
    clean(s)


def test_l2_eviction_between_two_requests(make_server) -> None:
    s = make_server(l2_pages=6)
    a, b = prompt(4, 5), prompt(5, 5)
    serve(s, a)
    serve(s, b)  # L2 holds 6 pages: b's backup evicts a's (LRU, all parts together)
    stats = s.tree_cache.cache.stats()
    assert stats["evictions_l2"] >= 1 and stats["backups_committed"] == 2
    evict_device(s)
    rb = serve(s, b)
    assert rb.host_hit_length == 5 * PAGE  # b is whole in L2
    r = serve(s, a)
    assert r.host_hit_length < 5 * PAGE  # what L2 lost of a is recomputed, never half-served
    clean(s)


def test_abort_while_the_load_is_in_flight_frees_slots_only_after_it_returned(make_cpu_server) -> None:
    from conftest import Faults

    s = make_cpu_server()
    a = in_l2_only(s, 6)
    faults = Faults()
    s.tree_cache.cache.engine.fault = faults
    faults.hold()  # every copy waits at the gate: the load stays in flight
    s.submit(a)
    reqs = s.prepare_batch()
    assert len(reqs) == 1 and reqs[0].host_hit_length == 5 * PAGE
    s.worker.set_hicache_consumer(-1)  # the forward's start submits the staged load
    free_before = s.allocator.available_size()
    aborter = threading.Thread(target=s.abort, args=(reqs[0],))
    aborter.start()
    try:
        time.sleep(0.3)
        # The abort waits for the H2D still writing the request's slots: nothing is freed yet.
        assert aborter.is_alive() and s.allocator.available_size() == free_before
    finally:
        faults.open()  # a failure above must not leave every later copy at the gate
    aborter.join(timeout=10)
    assert not aborter.is_alive()
    assert s.allocator.available_size() > free_before
    s.tree_cache.flush_pending_backups()
    s.tree_cache.cache.engine.fault = None
    # The host copy is intact: the next request for the prompt is a verified L2 hit.
    r = serve(s, a)
    assert r.host_hit_length == 5 * PAGE and r.finished_reason is not None
    assert s.forward.report.checked_bytes == 5 * PAGE * TOKEN_BYTES
    clean(s)


def test_a_request_aborted_before_its_forward_gives_its_host_reservation_back(make_server) -> None:
    s = make_server()
    cache = s.tree_cache.cache
    free_before = cache.host_pool.allocator.free_pages
    tokens = prompt(13, 5)
    req = s.submit(tokens)
    assert s.prepare_batch() == [req]
    assert cache.host_pool.allocator.free_pages == free_before  # staged for the forward's start
    with s.scheduling():
        s.worker.set_hicache_consumer(-1)  # the forward's start: write-through reserved, PENDING
    assert cache.host_pool.allocator.free_pages == free_before - 5
    s.abort(req)  # before any layer: no layer of the reserved copy was ever written
    s.tree_cache.flush_pending_backups()  # the after-batch flush decides it
    assert cache.metrics.backups_aborted == 1
    assert cache.host_pool.allocator.free_pages == free_before
    assert not s.tree_cache._flows
    r = serve(s, tokens)  # nothing of it was committed: a miss, computed and backed up anew
    assert r.host_hit_length == 0 and cache.metrics.backups_committed == 1
    clean(s)


def test_a_load_that_fails_in_flight_fails_its_request_and_caches_nothing(make_cpu_server) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from conftest import Faults

    s = make_cpu_server()
    a = in_l2_only(s, 7)
    faults = Faults()
    faults.fail_on.add((Direction.H2D, Part.TARGET_KV, 2))
    s.tree_cache.cache.engine.fault = faults
    r = serve(s, a)
    # Its forward read layer 2 while the copy failed (whatever the slots held): that request is
    # failed, loudly, with nothing of it in SGLang's tree or in L2.
    assert isinstance(r.finished_reason, FINISH_ABORT) and "failed" in str(r.finished_reason.message)
    assert s.tree_cache.stats.failed_loads == 1
    assert s.tree_cache.evictable_size() == 0  # nothing entered the device tree
    s.tree_cache.cache.engine.fault = None
    # The host copy was never touched: the next request loads it again and verifies.
    r2 = serve(s, a)
    assert r2.host_hit_length == 5 * PAGE and not isinstance(r2.finished_reason, FINISH_ABORT)
    clean(s)


def test_a_load_the_copy_engine_refuses_at_the_forwards_start_fails_its_request(make_cpu_server) -> None:
    """The load is submitted at the forward's start, after SGLang built the batch with the
    host tokens as its prefix: a refusal then is a failed load. The request fails loudly,
    nothing of it is cached (no reservation either: its forward computes on pages that
    never landed), and the host copy serves the next request."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    s = make_cpu_server()
    a = in_l2_only(s, 8)
    engine = s.tree_cache.cache.engine
    real, loads = engine.submit_layer, []

    def refusing(plan, parts, layer):
        if plan.direction is Direction.H2D:
            loads.append(layer)
            if len(loads) == 3:  # two layers are already in flight: they must return first
                raise CopyFailed("injected: the copy engine refused a submission")
        return real(plan, parts, layer)

    engine.submit_layer = refusing
    reserved = s.tree_cache.stats.reserved_pages
    r = serve(s, a)
    engine.submit_layer = real
    assert isinstance(r.finished_reason, FINISH_ABORT) and "refused" in str(r.finished_reason.message)
    assert s.tree_cache.stats.failed_loads == 1 and s.tree_cache.stats.loaded_tokens == 0
    assert s.tree_cache.stats.reserved_pages == reserved and s.tree_cache.evictable_size() == 0
    s.forward.report.mismatched_bytes = 0  # that forward read pages that never landed, and failed
    s.forward.report.mismatches.clear()
    r2 = serve(s, a)
    assert r2.host_hit_length == 5 * PAGE and not isinstance(r2.finished_reason, FINISH_ABORT)
    clean(s)


@pytest.mark.parametrize("attention", ["dsa", "mha"])
def test_chunked_prefill_backs_up_each_chunk_and_a_later_hit_verifies(make_server, attention: str) -> None:
    s = make_server(chunk_tokens=2 * PAGE, attention=attention)
    a = prompt(9, 5)
    serve(s, a)
    assert s.forward.report.forwards == 3  # 128 + 128 + 73 tokens
    assert s.tree_cache.stats.reserved_pages == 5
    assert s.tree_cache.cache.stats()["backups_committed"] == 3
    evict_device(s)
    r = serve(s, a)
    assert r.host_hit_length == 5 * PAGE
    clean(s)


def test_a_retracted_request_comes_back_from_l2(make_server) -> None:
    s = make_server(chunk_tokens=2 * PAGE)
    a = prompt(10, 5)
    req = s.submit(a)
    s.step()
    s.step()  # two chunks computed; the first stashed (checkpointed) at the second step
    s.retract(req)  # SGLang's release_req: released without caching, back to the queue
    assert req.is_retracted and req in s.waiting
    # Its chunks' backups had every layer submitted: they still commit.
    s.settle()
    evict_device(s)
    s.run_until_idle()
    # The committed chunks (pages 0-3 reserved by the two forwards) come back from L2.
    assert req.host_hit_length == 4 * PAGE and req.finished_reason is not None
    # Read and checked: chunk 0 by the second forward, then the 4 loaded pages.
    assert s.forward.report.checked_bytes == (2 + 4) * PAGE * s.spec.token_bytes
    clean(s)


def test_a_draft_part_missing_in_l2_is_refused_loudly(make_server) -> None:
    s = make_server()
    a = in_l2_only(s, 11)
    cache = s.tree_cache.cache
    node = next(n for n in cache.tree.nodes() if n.host_pages is not None)
    cache.config.debug_checks = False  # the corruption would trip the invariant check first
    node.host_parts = node.host_parts - {Part.DRAFT_KV}
    s.submit(a)
    with pytest.raises(ConsistencyError) as info:
        s.step()
    assert info.value.part == "draft_kv" and info.value.node == node.id
    assert s.tree_cache.stats.offered_tokens == 0  # never a target-only offer
    assert s.forward.report.forwards == 1


def _record_backups_and_attention(s: SGLangPrefillServer) -> list[str]:
    """The order of the forward's attention fetches and its backup submissions."""
    events: list[str] = []
    cache = s.tree_cache.cache
    real = cache.on_layers_end

    def on_layers_end(model, layers, backups):
        events.append(f"backup {model.value} {','.join(map(str, layers))}")
        return real(model, layers, backups)

    cache.on_layers_end = on_layers_end
    pool = s.target
    real_get = pool.get_key_buffer

    def get_key_buffer(layer):
        events.append(f"attention target {layer}")
        return real_get(layer)

    pool.get_key_buffer = get_key_buffer
    return events


def test_backups_are_submitted_per_layer_inside_the_forward(make_server) -> None:
    s = make_server()
    events = _record_backups_and_attention(s)
    serve(s, prompt(12, 5))
    # Layer l's D2H goes out when layer l+1's attention fetches its KV (overlapped with
    # layer l+1); the last target layer and the (single) draft layer after the forward.
    assert events == [
        "attention target 0", "attention target 1", "backup target 0", "attention target 2", "backup target 1",
        "attention target 3", "backup target 2", "backup target 3", "backup draft 0",
    ]  # fmt: skip
    clean(s)


@pytest.mark.parametrize("submits", [None, 2], ids=["default", "two-submits"])
def test_a_deep_models_backup_layers_go_out_in_groups_inside_the_forward(make_server, submits: int | None) -> None:
    """20 layers: the hook submits them in groups of `backup_layer_group(20, submits)`
    (3 at the default of 8 submits a forward, 10 at `backup_submits_per_forward = 2`),
    each as soon as it is written (overlapped with the next layers), the rest after the
    forward; every layer exactly once, in order, and the copy commits whole."""
    from hicache_cp import BACKUP_SUBMITS_PER_FORWARD, backup_layer_group

    group = 3 if submits is None else 10
    assert backup_layer_group(20, submits or BACKUP_SUBMITS_PER_FORWARD) == group
    assert backup_layer_group(4, BACKUP_SUBMITS_PER_FORWARD) == 1
    env = {} if submits is None else {"HICACHE_BACKUP_SUBMITS_PER_FORWARD": str(submits)}
    s = make_server(layers=20, skip_topk=(False, True) * 10, env=env)
    events = _record_backups_and_attention(s)
    serve(s, prompt(13, 5))
    expected: list[str] = []
    for layer in range(20):
        expected.append(f"attention target {layer}")
        if layer >= group and layer % group == 0:
            expected.append("backup target " + ",".join(str(x) for x in range(layer - group, layer)))
    last = 20 - (20 % group or group)
    expected += ["backup target " + ",".join(str(x) for x in range(last, 20)), "backup draft 0"]
    assert events == expected
    evict_device(s)
    req = serve(s, prompt(13, 5))  # all 5 pages from L2: the grouped copy committed whole
    assert req.host_hit_length == 5 * PAGE
    clean(s)


def test_registered_through_sglangs_plugin_loader_and_selected_by_name(tmp_path: Path) -> None:
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends
    from sglang.srt.plugins import load_plugins

    load_plugins()  # SGLang's entry-point loader (group sglang.srt.plugins), as every server process runs it
    assert "hicache-cp" in registered_radix_cache_backends()
    from hicache_cp.integrations.sglang.radix_cache import HiCacheCpRadixCache

    server = SGLangPrefillServer(ServerSpec(), tmp_path)
    try:
        assert isinstance(server.tree_cache, HiCacheCpRadixCache)
        assert server.worker.hicache_layer_transfer_counter is server.tree_cache.hooks[Model.TARGET]
    finally:
        server.close()


def test_engine_fields_from_hicache_config_are_refused(tmp_path: Path) -> None:
    from hicache_cp import ConfigError

    with pytest.raises(ConfigError, match="page_size"):
        SGLangPrefillServer(ServerSpec(), tmp_path, tree_cache_kwargs={"env": {"HICACHE_PAGE_SIZE": "16"}})
    with pytest.raises(ConfigError, match="write_through"):
        SGLangPrefillServer(ServerSpec(), tmp_path, tree_cache_kwargs={"env": {"HICACHE_WRITE_POLICY": "write_back"}})


# ---- TP ranks --------------------------------------------------------------------------------


def _tp_rank_worker(ctx, workdir: str) -> dict:
    """One SGLang TP rank: its own pools and L2, decisions agreed over the group (gloo)."""
    from conftest import Faults
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    env = {
        "HICACHE_HOST_BUDGET_BYTES": str(budget(64)), "HICACHE_IO_BACKEND": "cpu", "HICACHE_DEBUG_CHECKS": "true",
        "HICACHE_PIN_HOST": "false", "HICACHE_L2_FREE_ROOM": "0",
    }  # fmt: skip
    s = SGLangPrefillServer(ServerSpec(), Path(workdir) / f"rank{ctx.rank}",
                            tree_cache_kwargs={"env": env, "agreement": ctx.agreement})  # fmt: skip
    try:
        a = prompt(20, 5)
        serve(s, a)
        evict_device(s)
        if ctx.rank == 1:  # only this rank's copy of layer 1 fails
            faults = Faults()
            faults.fail_on.add((Direction.H2D, Part.TARGET_KV, 1))
            s.tree_cache.cache.engine.fault = faults
        failed = serve(s, a)
        s.tree_cache.cache.engine.fault = None
        again = serve(s, a)
        clean_report = s.forward.report.mismatched_bytes
        return {
            "failed_aborted": isinstance(failed.finished_reason, FINISH_ABORT),
            "again_host_hit": again.host_hit_length,
            "again_aborted": isinstance(again.finished_reason, FINISH_ABORT),
            "stats": vars(s.tree_cache.stats),
            "committed": s.tree_cache.cache.stats()["backups_committed"],
            "device_tree_tokens": s.tree_cache.evictable_size() + s.tree_cache.protected_size(),
            "mismatched_bytes_rank0": clean_report if ctx.rank == 0 else None,
        }
    finally:
        s.close()


def test_tp_ranks_agree_a_load_that_failed_on_one_rank_fails_on_every_rank(tmp_path: Path) -> None:
    from hicache_harness.launch import spawn_ranks

    r0, r1 = spawn_ranks(_tp_rank_worker, 2, (str(tmp_path),), timeout_s=240)
    # Rank 1's copy failed; the MIN all-reduce failed the load on both ranks at the same step:
    # both requests fail, neither rank caches anything of them, both keep identical state.
    assert r0["failed_aborted"] and r1["failed_aborted"]
    assert r0["stats"] == r1["stats"] and r0["stats"]["failed_loads"] == 1
    assert r0["committed"] == r1["committed"] and r0["device_tree_tokens"] == r1["device_tree_tokens"]
    # The host copies were intact on both: the next request is an L2 hit on both ranks.
    assert r0["again_host_hit"] == r1["again_host_hit"] == 5 * PAGE
    assert not r0["again_aborted"] and not r1["again_aborted"]
    assert r0["mismatched_bytes_rank0"] == 0  # rank 0's forward only ever read landed bytes


# ---- property: random request sequences ------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("serve"), st.integers(0, 3)),
        st.tuples(st.just("evict"), st.just(0)),
        st.tuples(st.just("retract"), st.integers(0, 3)),
        st.tuples(st.just("fail_load"), st.integers(0, 3)),
        st.tuples(st.just("evict_undecided"), st.integers(0, 3)),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTIONS)
def test_random_sequences_keep_every_byte_and_every_invariant(make_cpu_server, actions) -> None:
    """Prompts 0-3 share a 2-page system prefix; L2 holds 12 pages (evictions happen), chunks of
    2 pages. After every action: the cache's invariants, no byte read that prefill did not
    compute (except the one forward a failed load fed, which is failed), SGLang's allocator
    whole (free + tree == capacity), nothing held. `evict_undecided`: a request served with
    slow D2H copies, its device pages evicted while its backup is still undecided (the
    eviction waits for the copies), then decided by the next flush."""
    from conftest import Faults
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    s = make_cpu_server(l2_pages=12, chunk_tokens=2 * PAGE)
    system = prompt(99, 2, tail=0)
    prompts = [system + prompt(100 + i, 2 + i % 2) for i in range(4)]
    capacity = s.allocator.available_size()
    for action, i in actions:
        if action == "serve":
            serve(s, prompts[i])
        elif action == "evict":
            evict_device(s)
        elif action == "evict_undecided":
            s.tree_cache.cache.engine.fault = lambda direction, part, layer: time.sleep(0.002 * (direction is Direction.D2H))
            s.submit(prompts[i])
            s.run_until_idle()  # the flush after its batch finds its copies still in flight
            evict_device(s)
            s.tree_cache.cache.engine.fault = None
            s.settle()
        elif action == "retract":
            req = s.submit(prompts[i])
            s.step()
            if not req.finished():
                s.retract(req)
            s.run_until_idle()
            s.settle()
        else:  # the next load's layer-1 copy fails: that request fails, nothing of it is kept
            faults = Faults()
            faults.fail_on.add((Direction.H2D, Part.TARGET_KV, 1))
            s.tree_cache.cache.engine.fault = faults
            evict_device(s)
            req = serve(s, prompts[i])
            s.tree_cache.cache.engine.fault = None
            if isinstance(req.finished_reason, FINISH_ABORT):
                s.forward.report.mismatched_bytes = 0  # that forward was fed a failed load, and failed
                s.forward.report.mismatches.clear()
        clean(s)
        assert s.allocator.available_size() + s.tree_cache.evictable_size() == capacity


@pytest.mark.parametrize("attention", ["dsa", "mha"])
def test_overlap_scheduling_order_keeps_every_byte(make_server, attention: str) -> None:
    """event_loop_overlap: batch N+1 is scheduled, allocated and run before batch N's results
    (checkpoints) are processed. Two prompts sharing a system prefix, chunked, with a device
    eviction in between: every read byte still verifies, and the L2 hit comes back whole.
    On CUDA the forward runs on its own stream and first sleeps, so the host is ahead of it."""
    s = make_server(chunk_tokens=2 * PAGE, overlap=True, attention=attention, forward_delay_cycles=20_000_000)
    system = prompt(30, 2, tail=0)
    a, b = system + prompt(31, 3), system + prompt(32, 3)
    s.submit(a)
    s.submit(b)
    s.run_until_idle()
    s.settle()
    assert s.forward.report.forwards >= 4 and len(s.finished) == 2
    evict_device(s)
    r = serve(s, a)
    assert r.host_hit_length == 5 * PAGE
    clean(s)


def test_two_requests_computing_one_prefix_in_one_batch(make_server) -> None:
    """Both compute the same 5 pages in one forward. The first reserves them in L2; the second's
    reservation finds them pending and takes none. At the checkpoints SGLang's insert keeps the
    first's slots and frees the second's as duplicates: no backup reads those (no wait), one
    copy stays in the device tree, one in L2, and a later L2 hit verifies."""
    s = make_server()
    a = prompt(40, 5)
    r1, r2 = s.submit(a), s.submit(a)
    s.run_until_idle()
    s.settle()
    assert r1.finished_reason is not None and r2.finished_reason is not None
    assert s.tree_cache.stats.reserved_pages == 5 and s.tree_cache.stats.duplicate_waits == 0
    assert s.tree_cache.evictable_size() == 5 * PAGE
    evict_device(s)
    assert serve(s, a).host_hit_length == 5 * PAGE
    clean(s)
