"""hicache-cp as the host tier of vLLM 0.33.0, driven by vLLM's real `Scheduler`.

Each scenario runs requests through vLLM's scheduler (its own prefix cache,
chunked prefill, preemption, KV-load-failure recovery) and the connector it
loads by module path; `vllm_harness` plays the model runner and checks the
KV bytes every attention layer reads. After each step the comments state
what vLLM scheduled: (tokens already computed, tokens scheduled) per request.
Prompts are 85 tokens (5 pages of 16 and 5 tokens) unless said otherwise.

Skipped where vLLM is not installed (`scripts/install_vllm.sh`); CI installs it.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base", reason="vLLM not installed (scripts/install_vllm.sh)"
)

import test_vllm_bench as H  # noqa: E402

from hicache_cp import LoadState, Part  # noqa: E402
from hicache_cp.io.base import Direction  # noqa: E402

P = list(range(100, 185))  # 85 tokens: 5 whole pages


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return H.write_model_dir(tmp_path_factory.mktemp("tiny-deepseek"))


@pytest.fixture(params=H.DEVICES)
def device(request):
    return request.param


@pytest.fixture(params=[1, 2], ids=["1w", "2w"])
def workers(request):
    """vLLM workers (tensor-parallel ranks): the scheduler acts on a job once all reported it."""
    return request.param


@pytest.fixture
def new_bench(model_dir, device, workers):
    """`make_bench` on this test's device and worker count; every bench it made is shut down after the test."""
    made = []

    def make(**kw):
        kw.setdefault("workers", workers)
        made.append(H.make_bench(model_dir, device=device, **kw))
        return made[-1]

    yield make
    for b in made:
        b.close()


def settled(b: H.Bench) -> None:
    """Nothing in flight, nothing locked, the cache's invariants hold."""
    assert b.side.in_flight_jobs() == 0
    assert b.cache.in_flight() == ([], [])
    assert b.locked_nodes() == 0
    b.cache.check_invariants()


def test_vllm_miss_then_full_hit_from_l2(new_bench):
    b = new_bench()
    b.add(P)
    (s1,) = b.run()
    assert s1.scheduled == {"r1": (0, 85)}  # a miss: vLLM computes the whole prompt
    assert s1.loads == [] and s1.saves == [("r1", 0, 5)]  # write-through of the 5 whole pages
    assert b.cache.metrics.backups_committed == 1  # every worker reported: visible now
    b.drop_vllm_prefix_cache()  # vLLM's L1 forgets: only L2 has the prefix
    b.add(P)
    (s2,) = b.run()
    assert s2.scheduled == {"r2": (80, 5)}  # full hit: 5 pages loaded, the partial page computed
    assert s2.loads == [("r2", 0, 5)] and s2.saves == []
    assert b.side.stats.loads_done == 1 and b.side.stats.offered_tokens == 80
    assert b.mismatches == []  # every loaded byte was the one computed by r1
    settled(b)


def test_vllm_a_prompt_of_whole_pages_all_in_l2_still_computes_its_last_page(new_bench):
    b = new_bench()
    b.add(P[:80])  # exactly 5 whole pages
    b.run()
    b.drop_vllm_prefix_cache()
    b.add(P[:80])
    (s,) = b.run()
    # vLLM needs a token to compute (its logits): L2 offers 4 of the 5 pages, never all.
    assert s.scheduled == {"r2": (64, 16)}
    assert s.loads == [("r2", 0, 4)] and b.side.stats.offered_tokens == 64
    assert b.mismatches == []
    settled(b)


def test_vllm_salted_requests_never_touch_l2(new_bench):
    """A cache salt makes equal tokens different KV to vLLM (its block hashes take the
    salt); the tree's keys are tokens alone, so salted requests neither load nor save."""
    b = new_bench()
    b.add(P, cache_salt="tenant-a")
    (s,) = b.run()
    assert s.scheduled == {"r1": (0, 85)} and s.saves == []
    b.add(P)  # unsalted: a miss in vLLM's cache, and nothing of r1 in L2
    (s,) = b.run()
    assert s.scheduled == {"r2": (0, 85)} and s.saves == [("r2", 0, 5)]
    b.drop_vllm_prefix_cache()
    b.add(P, cache_salt="tenant-b")
    (s,) = b.run()
    assert s.scheduled == {"r3": (0, 85)} and s.loads == []  # r2's pages in L2 are not offered
    assert b.side.stats.lookups == 1  # r2's only
    settled(b)


def test_vllm_partial_hit_continues_vllm_prefix_cache(new_bench):
    b = new_bench()
    b.add(P)
    b.run()
    b.drop_vllm_prefix_cache()
    b.add(P[:37])  # 2 whole pages + 5 tokens
    (s,) = b.run()
    assert s.scheduled == {"r2": (32, 5)} and s.loads == [("r2", 0, 2)]  # L2 hit of 2 pages
    # vLLM now caches pages 0-1 itself; L2 holds 0-4. A longer request sharing
    # 5 pages gets 0-1 from vLLM and only the continuation 2-4 from L2.
    tail = list(range(700, 730))
    b.add(P[:80] + tail)  # 110 tokens: 6 whole pages
    (s,) = b.run()
    assert s.scheduled == {"r3": (80, 30)}
    assert s.loads == [("r3", 2, 3)]  # pages [2, 5) into the blocks vLLM allocated for them
    assert s.saves == [("r3", 5, 1)]  # the new whole page; 0-4 are in L2 already
    assert b.mismatches == []
    settled(b)


def test_vllm_l2_eviction_between_two_requests(new_bench):
    b = new_bench(host_pages=8)  # 7 usable pages: one 5-page prompt at a time
    b.add(P)
    b.run()
    b.add(list(range(300, 385)))  # another 5 pages: L2 evicts r1's (LRU) to make room
    (s,) = b.run()
    assert s.saves == [("r2", 0, 5)]
    assert b.cache.metrics.evictions_l2 == 5
    b.drop_vllm_prefix_cache()
    b.add(P)
    (s,) = b.run()
    assert s.scheduled == {"r3": (0, 85)} and s.loads == []  # evicted: a miss, recomputed
    assert s.saves == [("r3", 0, 5)]  # and backed up again (evicting r2's pages)
    assert b.mismatches == []
    settled(b)


def test_vllm_a_hit_vllm_cannot_place_keeps_no_lock_between_steps(new_bench):
    """vLLM looks a waiting request up, then finds no blocks for it: the match's lock
    is dropped at the step's metadata (L2 may evict that path until the next lookup),
    and the request loads its pages once blocks are free."""
    b = new_bench(num_blocks=9)  # 8 usable blocks
    b.add(P)
    b.run()  # r1: its 5 pages in L2
    b.drop_vllm_prefix_cache()
    b.add(list(range(300, 396)), max_tokens=20)  # r2: 6 blocks now, 7 once it decodes
    b.step()  # r2 prefills; (0, 96)
    b.add(P)  # r3: 5 pages in L2, needs 6 blocks, 1 or 2 are free
    s = b.step()
    assert "r3" not in s.scheduled and s.loads == []  # looked up, not placed: it waits
    assert b.side.stats.lookups >= 3 and b.locked_nodes() == 0  # r3's L2 path is not held
    steps = b.run()
    assert [(r, first, n) for st in steps for r, first, n in st.loads] == [("r3", 0, 5)]  # placed once r2 finished
    assert b.mismatches == []
    settled(b)


def test_vllm_request_aborted_while_its_load_is_in_flight(new_bench):
    b = new_bench()
    b.add(P)
    b.run()
    b.drop_vllm_prefix_cache()
    free_before = b.sched.kv_cache_manager.block_pool.get_num_free_blocks()
    b.add(P)
    s = b.step(abort_before_forward=["r2"])  # scheduled with its load, aborted before the forward ran
    assert s.loads == [("r2", 0, 5)] and s.scheduled == {"r2": (None, 5)}  # vLLM dropped it
    assert "r2" not in b.sched.requests  # no delayed free: the step's copies landed within the step
    assert b.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    assert b.side.stats.loads_done == 1  # the load was decided on the workers' report, then released
    settled(b)
    b.add(P)  # vLLM cached the blocks the load filled: a local hit, on bytes that landed whole
    (s,) = b.run()
    assert s.scheduled == {"r3": (80, 5)} and s.loads == []
    b.drop_vllm_prefix_cache()
    b.add(P)  # the L2 copy is intact and unlocked: the next request loads it
    (s,) = b.run()
    assert s.scheduled == {"r4": (80, 5)} and s.loads == [("r4", 0, 5)]
    assert b.mismatches == []


def test_vllm_failed_load_takes_vllms_recompute_path(new_bench):
    b = new_bench()
    b.add(P)
    b.run()
    b.drop_vllm_prefix_cache()

    def fault(direction, part, layer):  # test double on the worker's real copy engine
        if direction is Direction.H2D and layer == 1:
            raise RuntimeError("injected H2D fault")

    b.set_fault(fault)
    b.add(P + list(range(500, 540)))  # 125 tokens: 7 whole pages
    s = b.step()
    assert s.scheduled == {"r2": (80, 45)} and s.loads == [("r2", 0, 5)]
    assert s.saves == [("r2", 5, 2)]  # computed on the failing load: must never commit
    blocks = set(b.sched.kv_cache_manager.get_block_ids("r2")[0][:5])
    assert s.invalid_blocks == blocks  # vLLM's load-error path, not a hit
    assert {(r, layer) for r, layer, _ in b.mismatches} == {("r2", "model.layers.1.self_attn.attn")}
    b.mismatches.clear()
    b.set_fault(None)
    assert b.sched.requests["r2"].num_computed_tokens == 0  # vLLM truncated at the first bad block
    load = b.cache.metrics.loads_aborted, b.cache.metrics.backups_aborted
    assert load == (1, 1)  # the load aborted, and the backup computed on it with it
    steps = b.run()
    assert steps[0].scheduled == {"r2": (0, 125)}  # recomputed from scratch
    assert steps[0].loads == [] and steps[0].saves == [("r2", 5, 2)]  # 0-4 still in L2, 5-6 again
    assert b.side.stats.loads_failed == 1 and b.mismatches == []
    settled(b)
    b.drop_vllm_prefix_cache()
    b.add(P + list(range(500, 540)))
    (s,) = b.run()
    assert s.scheduled == {"r3": (112, 13)} and s.loads == [("r3", 0, 7)]
    assert b.mismatches == []


def test_vllm_preempted_request_resumes_from_l2(new_bench):
    b = new_bench(num_blocks=12)  # 11 usable blocks: two growing requests do not fit
    b.add(list(range(1, 65)), max_tokens=40)
    b.add(list(range(201, 265)), max_tokens=40)
    steps = b.run(200)
    (pre,) = [i for i, s in enumerate(steps) if s.preempted]
    assert steps[pre].preempted == {"r2"} and steps[pre].scheduled == {"r1": (80, 1)}
    resumed = next(s for s in steps[pre:] if "r2" in s.scheduled)
    before, n = resumed.scheduled["r2"]
    # r2 had 80 tokens (64 prompt + 16 decoded) when preempted; vLLM still
    # caches 4 of its pages, L2 holds the 5th (decoded tokens) too.
    assert (before, n) == (80, 1)
    assert resumed.loads == [("r2", 4, 1)]
    assert b.side.stats.loads_done == 1 and b.mismatches == []
    settled(b)


def test_vllm_corrupted_l2_is_detected_by_the_bench(new_bench):
    """Negative control: the byte check fails when L2 holds wrong bytes."""
    b = new_bench()
    b.add(P)
    b.run()
    node = next(iter(b.cache.tree.root.children.values()))
    host = b.worker.worker_side.host_pool
    host.layer_view(Part.TARGET_KV, 0)[node.host_pages[2]] ^= np.uint8(1)
    b.drop_vllm_prefix_cache()
    b.add(P)
    b.run()
    assert {(r, pos // H.BLOCK) for r, _, pos in b.mismatches} == {("r2", 2)}


def test_vllm_layers_whose_save_hook_never_fired_are_copied_after_the_forward(new_bench, caplog):
    """A layer vLLM runs without calling save_kv_layer (a full CUDA-graph replay) is copied
    at wait_for_save, after the forward wrote it: the save still commits every layer."""
    b = new_bench()
    unhooked = H.LAYERS[-1]
    for w in b.workers:
        real = w.save_kv_layer
        w.save_kv_layer = lambda name, t, md, real=real: None if name == unhooked else real(name, t, md)
    with caplog.at_level(logging.WARNING, logger="hicache_cp.integrations.vllm.worker"):
        b.add(P)
        (s1,) = b.run()
    assert s1.saves == [("r1", 0, 5)] and b.cache.metrics.backups_committed == 1
    warned = [r for r in caplog.records if "no save_kv_layer hook" in r.getMessage()]
    assert len(warned) == len(b.workers)  # once per worker
    b.drop_vllm_prefix_cache()
    b.add(P)
    (s2,) = b.run()
    assert s2.loads == [("r2", 0, 5)] and b.mismatches == []  # the late-copied layer holds what r1 computed
    settled(b)


def test_vllm_load_waits_are_per_layer(new_bench):
    """The forward waits for a layer's load at that layer's hook, not for the whole load."""
    b = new_bench()
    b.add(P)
    b.run()
    b.drop_vllm_prefix_cache()
    b.add(P)
    so = b.sched.schedule()
    w = b.worker.worker_side
    seen = []
    b.set_fault(lambda d, part, layer: seen.append((d, layer)))  # an observer: no copy fails
    b.worker.bind_connector_metadata(so.kv_connector_metadata)
    b.worker.start_load_kv(H._HookedContext())
    (_, op), = w._loads
    assert op.state is LoadState.LOADING
    b.worker.wait_for_layer_load(H.LAYERS[0])
    if b.device == "cuda":  # the compute stream waits on layer 0's copy: once it ran, that copy landed
        torch.cuda.current_stream().synchronize()
    assert op.by_layer[(Part.TARGET_KV, 0)][0].query().value == "done"
    b.worker.wait_for_save()
    assert b.worker.get_block_ids_with_load_errors() == set()  # the step's end waits for its loads
    assert seen == [(Direction.H2D, 0), (Direction.H2D, 1)]  # layer order, one copy per layer


def test_vllm_v32_indexer_and_mtp_round_trip(new_bench):
    """DeepSeek-V3.2's KV under vLLM's scheduler: MLA + indexer caches per layer and an MTP layer.
    The fake runner reads each indexer cache before its layer's hook, so a load
    that waited only at the attention hook would show as indexer mismatches."""
    b = new_bench(shape="v32")
    assert {p.part for p in b.cache.layout.parts} == {
        Part.TARGET_KV, Part.TARGET_STATE, Part.DRAFT_KV, Part.DRAFT_STATE}
    b.add(P)
    (s1,) = b.run()
    assert s1.saves == [("r1", 0, 5)] and b.cache.metrics.backups_committed == 1
    b.drop_vllm_prefix_cache()
    b.add(P + list(range(900, 940)))  # 125 tokens: 5 pages from L2, 2 new ones
    (s2,) = b.run()
    assert s2.scheduled == {"r2": (80, 45)} and s2.loads == [("r2", 0, 5)] and s2.saves == [("r2", 5, 2)]
    assert b.mismatches == []
    settled(b)
    host = b.worker.worker_side.host_pool  # negative control: one indexer byte of the MTP layer flipped in L2
    node = next(iter(b.cache.tree.root.children.values()))
    host.layer_view(Part.DRAFT_STATE, 0)[node.host_pages[1], 5] ^= np.uint8(1)
    b.drop_vllm_prefix_cache()
    b.add(P)
    b.run()
    assert {(r, name, pos // H.BLOCK) for r, name, pos in b.mismatches} == {
        ("r3", "model.layers.2.self_attn.indexer.k_cache", 1)}


@pytest.mark.parametrize("slow_part, slow_layer", [(Part.TARGET_STATE, 1), (Part.DRAFT_STATE, 0)],
                         ids=["target-indexer", "mtp-indexer"])
def test_vllm_v32_slow_indexer_copies_are_waited_for_before_the_indexer_reads(new_bench, slow_part, slow_layer):
    """vLLM's indexer reads layer l's keys before layer l's attention wrapper waits:
    a slow copy of them is waited for at layer l-1's hook, never read early. The MTP
    draft layer's indexer (issue 48) is waited for at the last target layer's hook."""
    b = new_bench(shape="v32")
    if b.device != "cpu":
        pytest.skip("the fault hook slows a copy only on the CPU engine (on CUDA it runs at submit)")
    b.add(P)
    b.run()
    b.drop_vllm_prefix_cache()
    for kv in b.kv:  # what vLLM's blocks held is gone: only the load brings the bytes back
        for t in kv.values():
            t.view(torch.uint8).fill_(0x5A)

    def slow_copy(direction, part, layer):  # type: ignore[no-untyped-def]
        if (direction, part, layer) == (Direction.H2D, slow_part, slow_layer):
            time.sleep(0.2)

    b.set_fault(slow_copy)
    b.add(P)
    (s,) = b.run()
    assert s.loads == [("r2", 0, 5)] and b.mismatches == []
    settled(b)


def test_vllm_v32_failed_indexer_load_is_recomputed(new_bench):
    b = new_bench(shape="v32")
    b.add(P)
    b.run()
    b.drop_vllm_prefix_cache()

    def fault(direction, part, layer):
        if direction is Direction.H2D and part is Part.TARGET_STATE and layer == 1:
            raise RuntimeError("injected indexer H2D fault")

    b.set_fault(fault)
    b.add(P)
    s = b.step()
    assert s.loads == [("r2", 0, 5)] and s.invalid_blocks == set(b.sched.kv_cache_manager.get_block_ids("r2")[0][:5])
    assert {name for _, name, _ in b.mismatches} == {"model.layers.1.self_attn.indexer.k_cache"}
    b.mismatches.clear()
    b.set_fault(None)
    steps = b.run()
    assert steps[0].scheduled == {"r2": (0, 85)} and b.side.stats.loads_failed == 1 and b.mismatches == []
    settled(b)


def host_hit_pages(b: H.Bench, prompt: list[int]) -> int:
    m = b.cache.match_prefix(np.asarray(prompt, dtype=np.int64))
    b.cache.release(m.last_node)
    return m.host_len


def test_vllm_save_commits_only_once_every_worker_reported(model_dir, device):
    """Issue 29: a save that one of two workers has not reported yet is not visible;
    it commits when the late report arrives, and never if a worker failed it."""
    b = H.make_bench(model_dir, device=device, workers=2)
    try:
        b.add(P)
        s = b.step(hold={1})  # worker 1's report of r1's save comes one step late
        assert s.saves == [("r1", 0, 5)]
        assert b.cache.metrics.backups_committed == 0 and host_hit_pages(b, P) == 0
        assert b.side.in_flight_jobs() == 1  # decided by nobody yet
        b.step()  # an empty step carries worker 1's report
        assert b.cache.metrics.backups_committed == 1 and host_hit_pages(b, P) == 5
        # a save worker 0 landed but worker 1 failed: aborted, never visible
        other = list(range(300, 385))
        b.set_fault(lambda d, part, layer: (_ for _ in ()).throw(RuntimeError("worker 1 D2H")) if d is Direction.D2H
                    else None, worker=1)
        b.add(other)
        b.run()
        assert b.cache.metrics.backups_aborted == 1 and host_hit_pages(b, other) == 0
        b.set_fault(None)
        b.drop_vllm_prefix_cache()
        b.add(P)  # the committed one loads into both workers' blocks, every byte checked in both
        (s,) = b.run()
        assert s.loads == [("r3", 0, 5)] and b.mismatches == []
        settled(b)
    finally:
        b.close()


# ---- dense layouts, full CUDA graphs, asynchronous saves (issue 43) ---------------------


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_vllm_dense_layout_round_trip(new_bench, layout):
    """A dense model's KV as vLLM 0.33 lays it out for FlashAttention and Triton (LBNHC) or
    FlashInfer and the OffloadingConnector (LBHNC): vLLM's planner and allocator, K and V of
    every head and token saved and loaded whole, under vLLM's real scheduler."""
    b = new_bench(shape="llama", layout=layout)
    b.add(P)
    (s1,) = b.run()
    assert s1.saves == [("r1", 0, 5)] and b.cache.metrics.backups_committed == 1
    b.drop_vllm_prefix_cache()
    for kv in b.kv:  # only the load can bring the bytes back
        for t in kv.values():
            t.fill_(-7)
    b.add(P + list(range(900, 940)))
    (s2,) = b.run()
    assert s2.scheduled == {"r2": (80, 45)} and s2.loads == [("r2", 0, 5)] and s2.saves == [("r2", 5, 2)]
    assert b.mismatches == []
    settled(b)


def test_vllm_dense_failed_load_is_recomputed(new_bench):
    b = new_bench(shape="llama")
    b.add(P)
    b.run()
    b.drop_vllm_prefix_cache()
    b.set_fault(lambda d, part, layer: (_ for _ in ()).throw(RuntimeError("H2D")) if d is Direction.H2D else None)
    b.add(P)
    s = b.step()
    assert s.invalid_blocks == set(b.sched.kv_cache_manager.get_block_ids("r2")[0][:5])
    b.mismatches.clear()
    b.set_fault(None)
    steps = b.run()
    assert steps[0].scheduled == {"r2": (0, 85)} and b.mismatches == []
    settled(b)


def test_vllm_block_outermost_layout_is_refused_with_the_reason(model_dir):
    """BLNHC interleaves every layer's page inside a block (vLLM's block-outermost packing,
    the DeepSeek-V3.2 indexer's only layout): refused at register_kv_caches, saying why."""
    with pytest.raises(ValueError, match="block dimension is not outermost|not dense"):
        H.make_bench(model_dir, shape="llama", layout="BLNHC")


def test_vllm_full_graph_step_waits_for_loads_before_the_replay(new_bench):
    """A full CUDA-graph replay calls no layer hook: the loads are waited for before the
    forward (here: a slow copy of the last layer that a per-layer wait would miss), and
    the step's saves are submitted after it, without a warning."""
    b = new_bench()
    if b.device != "cpu":
        pytest.skip("the fault hook slows a copy only on the CPU engine")
    b.add(P)
    b.run()
    b.drop_vllm_prefix_cache()
    for kv in b.kv:
        for t in kv.values():
            t.fill_(-7)

    def slow(direction, part, layer):
        if (direction, layer) == (Direction.H2D, 1):
            time.sleep(0.2)

    b.set_fault(slow)
    b.add(P + list(range(900, 940)))
    s = b.step(full_graph=True)
    assert s.loads == [("r2", 0, 5)] and s.saves == [("r2", 5, 2)]
    assert b.mismatches == []  # every layer landed before the "replay" read it
    b.set_fault(None)
    b.run()
    assert b.cache.metrics.backups_committed == 2  # r1's, and r2's saved after the replay
    b.drop_vllm_prefix_cache()
    b.add(P + list(range(900, 940)))
    (s,) = b.run()
    assert s.loads == [("r3", 0, 7)] and b.mismatches == []


def test_vllm_connector_keeps_full_cuda_graphs_and_the_hybrid_manager():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from hicache_cp.integrations.vllm import HiCacheConnector
    from hicache_cp.integrations.vllm.connector import _layer_hooks_run
    from vllm.config import CUDAGraphMode

    assert not HiCacheConnector.requires_piecewise_for_cudagraph({})
    assert supports_hma(HiCacheConnector)

    class Ctx:
        def __init__(self, md, mode):
            self.attn_metadata, self.cudagraph_runtime_mode = md, mode

    assert _layer_hooks_run(Ctx({"l": 1}, CUDAGraphMode.NONE))
    assert _layer_hooks_run(Ctx({"l": 1}, CUDAGraphMode.PIECEWISE))
    assert not _layer_hooks_run(Ctx({"l": 1}, CUDAGraphMode.FULL))  # V1 runner's full replay
    assert not _layer_hooks_run(Ctx(None, CUDAGraphMode.NONE))  # V2 runner: loads started outside the forward
    assert not _layer_hooks_run(None)


class _Gate:
    """Test double: holds the worker's D2H copies until opened (a slow device)."""

    def __init__(self) -> None:
        import threading

        self.open = threading.Event()

    def __call__(self, direction, part, layer) -> None:
        if direction is Direction.D2H:
            self.open.wait(timeout=30)  # a guard only: the test opens it


def test_vllm_saves_never_block_the_step_and_hold_the_blocks_of_a_finished_request(model_dir):
    """wait_for_save returns with the save's copies still in flight; the request finishes
    meanwhile, and vLLM keeps its blocks (request_finished -> True) until every worker
    reports it through get_finished, after the save landed and committed."""
    b = H.make_bench(model_dir, workers=2)
    b.settle_saves = False
    try:
        gate = _Gate()
        b.set_fault(gate)
        b.add(P)
        s = b.step()  # r1 computed, sampled its only token and finished: its save is in flight
        assert s.saves == [("r1", 0, 5)] and s.scheduled == {"r1": (0, 85)}
        assert b.cache.metrics.backups_committed == 0 and b.side.in_flight_jobs() == 1
        assert "r1" in b.sched.requests  # finished, but its blocks are held for the save
        held = set(b.sched.kv_cache_manager.get_block_ids("r1")[0])
        assert held and not held & {blk.block_id for blk in b.sched.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()}
        b.step()  # the workers learn r1 is delayed; its copies still wait
        assert "r1" in b.sched.requests and b.cache.metrics.backups_committed == 0
        gate.open.set()
        for _ in range(20):
            if "r1" not in b.sched.requests:
                break
            b.step()
            time.sleep(0.01)
        assert "r1" not in b.sched.requests  # freed once both workers reported it
        assert b.cache.metrics.backups_committed == 1 and host_hit_pages(b, P) == 5
        settled(b)
    finally:
        b.close()


def test_vllm_preempted_requests_saves_are_waited_for_before_the_step(model_dir):
    """A request preempted while its save is in flight: vLLM freed its blocks, so the
    worker waits for that save (handle_preemptions) before the step's writes."""
    from hicache_cp.integrations.vllm.metadata import HiCacheMetadata

    b = H.make_bench(model_dir)
    b.settle_saves = False
    try:
        def slow(direction, part, layer):
            if direction is Direction.D2H:
                time.sleep(0.05)

        b.set_fault(slow)
        b.add(P)
        b.step()
        side = b.worker.worker_side
        assert side._saves, "the save is still in flight after the step"
        meta = HiCacheMetadata(b.cache.host_pool.physical_pages, preempted=["r1"])
        b.worker.handle_preemptions(meta)
        assert not side._saves and side._results  # waited for, verdict recorded
        (job, (count, error)), = side._results.items()
        assert count == 1 and error is None
    finally:
        b.close()


# ---- the tests issue 48 found missing -----------------------------------------------------


def test_vllm_tp_save_failed_by_the_worker_that_reports_first_still_aborts(model_dir):
    """Worker 1 fails a save and reports at once; worker 0 landed it and reports a step
    later. The job is decided on both reports together: aborted, never visible."""
    b = H.make_bench(model_dir, workers=2)
    try:
        b.set_fault(lambda d, part, layer: (_ for _ in ()).throw(RuntimeError("worker 1 D2H"))
                    if d is Direction.D2H else None, worker=1)
        b.add(P)
        s = b.step(hold={0})  # worker 1's failure arrives now, worker 0's success next step
        assert s.saves == [("r1", 0, 5)]
        assert b.side.in_flight_jobs() == 1 and b.cache.metrics.backups_aborted == 0
        b.set_fault(None)
        b.run()
        assert b.cache.metrics.backups_aborted == 1 and b.cache.metrics.backups_committed == 0
        assert host_hit_pages(b, P) == 0
        settled(b)
    finally:
        b.close()


def test_vllm_defer_finalize_reports_a_failed_load_in_its_own_step(new_bench):
    """vLLM's step order with a draft model: post_forward (load errors, reports) runs before
    the draft layers and wait_for_save. A failing load's blocks are still reported
    invalid in the step that ran it, and vLLM recomputes them."""
    b = new_bench(shape="v32")
    b.defer_finalize = True
    b.add(P)
    b.run()
    b.drop_vllm_prefix_cache()

    def fault(direction, part, layer):
        if direction is Direction.H2D and part is Part.DRAFT_KV:
            raise RuntimeError("injected draft H2D fault")

    b.set_fault(fault)
    b.add(P)
    s = b.step()
    assert s.loads == [("r2", 0, 5)]
    assert s.invalid_blocks == set(b.sched.kv_cache_manager.get_block_ids("r2")[0][:5])
    assert b.sched.requests["r2"].num_computed_tokens == 0
    b.mismatches.clear()
    b.set_fault(None)
    steps = b.run()
    assert steps[0].scheduled == {"r2": (0, 85)} and b.side.stats.loads_failed == 1 and b.mismatches == []
    settled(b)


def test_vllm_lora_and_extra_keys_make_a_request_ineligible(new_bench):
    """vLLM puts a request's LoRA adapter (and any extra key) in its block hashes: equal
    tokens, other KV. Such a request neither loads nor saves; its twin without them does."""
    from vllm.lora.request import LoRARequest

    b = new_bench()
    rid = b.add(P, lora=LoRARequest("adapter-a", 1, "/nonexistent/adapter-a"))
    (s,) = b.run()
    assert s.scheduled == {rid: (0, 85)} and s.saves == [] and b.side.stats.lookups == 0
    b.add(P)
    (s,) = b.run()
    assert s.saves == [("r2", 0, 5)]
    b.drop_vllm_prefix_cache()
    rid = b.add(P, lora=LoRARequest("adapter-a", 1, "/nonexistent/adapter-a"))
    (s,) = b.run()
    assert s.scheduled == {rid: (0, 85)} and s.loads == []  # r2's pages are not offered to it
    assert b.side.stats.lookups == 1  # r2's only
    settled(b)
