"""The node tier under vLLM 0.33.0's real scheduler: one copy for the workers, kept across
an engine restart (the bench of tests/test_vllm_bench.py plays the model runner and checks
every byte each attention layer reads, in every worker).

Skipped where vLLM is not installed (`scripts/install_vllm.sh`); CI installs it.
"""

from __future__ import annotations


import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base", reason="vLLM not installed (scripts/install_vllm.sh)"
)

import test_vllm_bench as H  # noqa: E402

from hostmem.segment import find_segment  # noqa: E402

P = list(range(100, 185))  # 85 tokens: 5 whole pages of 16



def test_two_workers_share_one_copy_and_a_restarted_engine_serves_it(tmp_path, seg_name: str) -> None:
    model = H.write_model_dir(tmp_path / "tiny-deepseek")
    b = H.make_bench(model, workers=2, extra_config={"node_segment": seg_name})
    try:
        b.add(P)
        b.run()
        assert b.cache.metrics.backups_committed == 1 and b.mismatches == []
        pools = [w.worker_side.host_pool for w in b.workers]
        assert all(p.shared for p in pools) and pools[0].arenas[pools[0].layout.parts[0].part].ptr != 0
        assert b.cache.stats()["node_journal_commits"] == 5
    finally:
        b.close()
    again = H.make_bench(model, workers=2, extra_config={"node_segment": seg_name, "node_drop_on_close": True})
    try:
        s = again.cache.stats()
        assert s["node_adopted"] and s["node_adopted_pages"] == 5
        again.add(P)  # an engine that never computed P: its 5 pages come from the adopted copy
        (step,) = again.run()
        assert step.loads and step.loads[0][2] == 5 and again.mismatches == []  # checked in both workers
        assert again.cache.stats()["node_verified_pages"] == 5
        units = sum(p.num_slots for p in again.cache.layout.parts)
        for w in again.workers:  # each worker's restore checks, against the segment's one checksum table
            assert w.worker_side.engine.integrity.snapshot()[0]["l2"] == 5 * units
        assert again.sched.reset_prefix_cache(reset_connector=True)  # a reset: the journal forgets the copy
        assert not again.cache.tree.root.children and again.cache.stats()["node_adopted_pages"] == 0
        assert again.cache._node.journal.committed_pages().size == 0  # nothing for a later engine to adopt
    finally:
        again.close()
    assert find_segment(seg_name) is None
