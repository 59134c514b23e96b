"""bench/engines/vllm_compare.py: hicache-cp's connector beside vLLM's OffloadingConnector, under vLLM's real Scheduler.

A small embedded workload (CPU, a few seconds); the assertions are what the
comparison must show whatever the numbers: both connectors serve every
prompt token from exactly one place (vLLM's prefix cache, host memory, or
compute) with every KV byte right, both load from host after vLLM evicted,
and a failed load is recomputed by ours while vLLM's worker raises.
Skipped where vLLM is not installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
                    reason="vLLM not installed (scripts/install_vllm.sh)")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "engines"))

import vllm_compare  # noqa: E402


@pytest.mark.slow
def test_vllm_compare_writes_both_connectors_side_by_side(tmp_path, capsys):
    out = tmp_path / "cmp.json"
    assert vllm_compare.main(["--json", str(out), "--requests", "24", "--gpu-blocks", "64", "--host-pages", "120"]) == 0
    report = json.loads(out.read_text())
    assert report["vllm"] == "0.33.0" and report["commit"] and report["command"].startswith("bench/engines/vllm_compare.py")
    ours, theirs = report["results"]
    assert ours["connector"].startswith("hicache-cp") and theirs["connector"].startswith("vLLM OffloadingConnector")
    for r in (ours, theirs):
        assert r["from_gpu_prefix_cache"] + r["from_host"] + r["computed"] == r["prompt_tokens"], r
        assert r["from_host"] > 0 and r["blocks_stored"] > 0  # vLLM evicted, and the host tier served it
        assert r["mismatches"] == 0
        assert r["sched_ms_per_step"]["total_ms"] > 0 and r["worker_ms_per_step"]["total_ms"] > 0
        assert r["by_method"]["build_connector_worker_meta"]["calls"] == r["steps"] + r["report_only_steps"]
    ok, crash = report["failed_load"]
    assert ok["outcome"] == "finished" and ok["invalid_blocks_reported"] == 5 and ok["recomputed_tokens"] == 85
    assert ok["mismatches_after_recovery"] == 0 and ok["next_request_loads_from_host"] == 80
    assert crash["outcome"] == "raised" and crash["error"].startswith("AssertionError")
    assert "offloading/worker.py" in crash["where"]
    table = capsys.readouterr().out
    assert "prompt tokens loaded from host" in table and "vLLM 0.33.0" in table


def test_vllm_compare_refuses_bad_arguments(tmp_path):
    with pytest.raises(SystemExit) as e:
        vllm_compare.main(["--json", str(tmp_path / "x.json"), "--gpu-blocks", "0"])
    assert e.value.code == 2 and not (tmp_path / "x.json").exists()
