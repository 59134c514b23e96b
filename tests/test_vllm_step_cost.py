"""bench/engines/vllm_step_cost.py: the connector's methods timed as vLLM's real Scheduler calls them.

A small version of the race's workload (CPU, a few seconds). What must hold
whatever the numbers: every document of pass 2 and of the batch is served from
host (vLLM's GPU prefix cache has evicted it), every KV byte the fake model
runner reads is right, each method vLLM calls is timed and, with `--profile`,
counted in Python calls; the JSON names commit, machine and command.
Skipped where vLLM is not installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base",
                    reason="vLLM not installed (scripts/install_vllm.sh)")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "engines"))

import vllm_step_cost  # noqa: E402


def test_vllm_step_cost_times_every_method_of_the_race_workload(tmp_path, capsys):
    out = tmp_path / "cost.json"
    # 3 documents of 4 pages: 3 x 5 blocks fit in 12 GPU blocks one at a time, not all three
    args = ["--json", str(out), "--docs", "3", "--doc-len", "64", "--suffix-len", "5", "--gen", "2", "--layers", "2",
            "--gpu-blocks", "12", "--max-batched", "256", "--host-bytes", str(1 << 20), "--profile", "5"]
    assert vllm_step_cost.main(args) == 0
    report = json.loads(out.read_text())
    assert report["commit"] and report["machine"] and report["command"].startswith("bench/engines/vllm_step_cost.py")
    r = report["result"]
    assert r["mismatches"] == 0
    assert r["host_tokens"] >= 3 * 64  # pass 2 loads every document (the GPU evicted them)
    methods = r["by_method"]
    for name in ("get_num_new_matched_tokens", "build_connector_meta", "update_connector_output", "start_load_kv",
                 "wait_for_layer_load", "save_kv_layer", "get_block_ids_with_load_errors",
                 "build_connector_worker_meta"):
        assert methods[name]["calls"] > 0 and methods[name]["python_calls"] > 0 and methods[name]["p50_us"] > 0, name
    steps = sum(r["steps"].values())
    assert r["scheduler"]["steps"] == r["worker"]["steps"] == steps
    printed = capsys.readouterr().out
    assert f"| save_kv_layer | {methods['save_kv_layer']['calls']} |" in printed  # the table, per method
    assert "Ordered by: cumulative time" in printed  # and the profile's costliest functions
