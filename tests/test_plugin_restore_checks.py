"""Verified restores inside both engines' plug-ins (issue 44), on their real classes, on CPU
(and the vLLM case on CUDA too, a GPU test).

* SGLang 0.5.23 (`--radix-cache-backend hicache-cp`): a flipped bit in an L2 copy
  fails the load's check; the plug-in fails that request (its output is not kept),
  the bad copy is dropped, and the next request computes the prefix: nothing
  corrupt is served again.
* vLLM 0.33.0 (the KV connector): the same flip fails the worker's load; vLLM gets
  the blocks as load errors and recomputes them; the scheduler's agreed abort
  drops the copy, so a later request computes instead of loading it.

Both are skipped where the engine is not installed.
"""

from __future__ import annotations

import numpy as np
import pytest

from hicache_cp import Part


# ---- SGLang ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_sglang_a_flipped_bit_in_l2_fails_the_request_and_is_never_served_again(tmp_path) -> None:
    pytest.importorskip("sglang", reason="sglang not installed (scripts/install_sglang.sh)")
    from test_sglang_radix import PAGE, budget, clean, in_l2_only, serve

    from hicache_harness.sglang.server import SGLangPrefillServer, ServerSpec

    env = {"HICACHE_HOST_BUDGET_BYTES": str(budget(64)), "HICACHE_IO_BACKEND": "cpu", "HICACHE_DEBUG_CHECKS": "true",
           "HICACHE_PIN_HOST": "false", "HICACHE_L2_FREE_ROOM": "0"}  # fmt: skip
    s = SGLangPrefillServer(ServerSpec(), tmp_path / "s", tree_cache_kwargs={"env": env})
    try:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        a = in_l2_only(s, 11)
        cache = s.tree_cache.cache
        host = np.concatenate([n.host_pages for n in cache.tree.match(np.asarray(a[: 5 * PAGE], dtype=np.int64))])
        cache.host_pool.layer_view(Part.DRAFT_STATE, 0)[host[1], 40] ^= 0x02
        r = serve(s, a)
        assert isinstance(r.finished_reason, FINISH_ABORT)  # the request that read it is failed
        report = s.forward.report  # its forward read the bad byte; SGLang discards that output
        assert report.mismatched_bytes == 1 and report.mismatches[0].startswith("r2: draft index layer 0")
        report.mismatched_bytes, report.mismatches = 0, []
        stats = cache.stats()
        assert stats["verify_failures_l2_draft_state"] == 1 and stats["integrity_dropped_pages"] == 5
        r2 = serve(s, a)
        assert r2.host_hit_length == 0 and not isinstance(r2.finished_reason, FINISH_ABORT)  # computed, not loaded
        assert cache.stats()["verify_failures"] == 1
        clean(s)
    finally:
        s.close()


# ---- vLLM -----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_vllm_a_flipped_bit_in_l2_takes_vllms_recompute_path_and_the_copy_is_dropped(tmp_path, device) -> None:
    """On CUDA the worker's engine checksums on the GPU (`io.checked`) what the CPU engine checks on the host."""
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="vLLM not installed")
    import test_vllm_bench as H

    if device == "cuda" and not H.cuda_available():
        pytest.skip("needs CUDA (bench/device/vllm_race.sh runs it)")
    b = H.make_bench(H.write_model_dir(tmp_path / "m"), device=device, workers=1)
    try:
        prompt = list(range(100, 185))  # 5 whole pages
        b.add(prompt)
        b.run()
        node = next(iter(b.cache.tree.root.children.values()))
        host = b.worker.worker_side.host_pool
        host.layer_view(Part.TARGET_KV, 1)[node.host_pages[3], 9] ^= np.uint8(0x10)
        b.drop_vllm_prefix_cache()
        b.add(prompt)
        s = b.step()
        assert s.loads == [("r2", 0, 5)]
        blocks = set(b.sched.kv_cache_manager.get_block_ids("r2")[0][:5])
        assert s.invalid_blocks == blocks  # the check failed the load: vLLM's load-error path
        b.mismatches.clear()  # that step's forward read the bad block; vLLM discards its output
        steps = b.run()
        assert steps[0].scheduled == {"r2": (0, 85)} and steps[0].loads == []  # recomputed
        assert b.mismatches == []
        assert b.cache.metrics.loads_aborted == 1 and b.cache.metrics.integrity_dropped_pages == 5
        assert b.worker.worker_side.engine.integrity.snapshot()[1] == {("l2", "target_kv"): 1}
        b.drop_vllm_prefix_cache()
        b.add(prompt)
        (s3,) = b.run()
        # The dropped copy is never loaded again (r2's recompute backed the pages up afresh).
        assert b.mismatches == [] and b.worker.worker_side.engine.integrity.snapshot()[1] == {("l2", "target_kv"): 1}
        assert s3.loads in ([], [("r3", 0, 5)])
    finally:
        b.close()
