"""`tools/sglang_engine.py`'s own logic on CPU (the engine itself runs on the device only):
the prompt stream, the per-mode summary and the greedy comparison against the run without a host tier."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("sglang_engine_tool", ROOT / "tools" / "sglang_engine.py")
tool = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["sglang_engine_tool"] = tool
_spec.loader.exec_module(tool)  # type: ignore[union-attr]


def test_the_prompts_share_each_groups_prefix_with_a_new_suffix_per_round() -> None:
    args = argparse.Namespace(seed=0, groups=3, rounds=2, prefix_tokens=128, suffix_tokens=16)
    ps = tool.prompts(args)
    assert [(g, r) for g, r, _ in ps] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    by = {(g, r): ids for g, r, ids in ps}
    assert by[(1, 0)][:128] == by[(1, 1)][:128] and by[(1, 0)][128:] != by[(1, 1)][128:]
    assert by[(0, 0)][:128] != by[(1, 0)][:128]
    assert all(len(ids) == 144 for _, _, ids in ps)


def _req(g: int, r: int, ttft: float, host: int, out: list[int]) -> dict:
    return {"group": g, "round": r, "prompt_tokens": 100, "ttft_ms": ttft, "device_tokens": 10, "host_tokens": host,
            "computed_tokens": 90 - host, "output_ids": out}


def test_the_summary_splits_ttft_by_host_share_and_compares_greedy_outputs() -> None:
    rows = {
        "none": {"start_s": 1.0, "requests": [_req(0, 0, 10.0, 0, [1, 2]), _req(0, 1, 12.0, 0, [3, 4])]},
        "hicache-cp": {"start_s": 1.0, "requests": [_req(0, 0, 10.0, 0, [1, 2]), _req(0, 1, 4.0, 64, [3, 4])]},
        "sglang-hicache": {"start_s": 1.0, "requests": [_req(0, 0, 10.0, 0, [1, 2]), _req(0, 1, 6.0, 50, [3, 5])]},
    }
    tool.summarise(rows)
    ours, theirs = rows["hicache-cp"], rows["sglang-hicache"]
    assert ours["half_from_host_requests"] == 1 and ours["half_from_host_ttft_p50_ms"] == 4.0
    assert theirs["half_from_host_requests"] == 1  # 50 of 100 tokens: exactly half counts
    assert rows["none"]["half_from_host_requests"] == 0 and rows["none"]["half_from_host_ttft_p50_ms"] is None
    assert ours["greedy_identical_to_none"] is True
    assert theirs["greedy_identical_to_none"] is False and theirs["greedy_differs"] == [[0, 1]]
    assert ours["host_tokens"] == 64 and ours["computed_tokens"] == 90 + 26
    assert "| sglang-hicache |" in tool.table(rows)


def test_the_child_command_drops_the_parents_own_flags() -> None:
    argv = ["--model", "llama", "--json", "out.json", "--modes", "none", "hicache-cp", "--quick"]
    assert tool._without(argv, "--json", "--modes") == ["--model", "llama", "--quick"]


def test_hicache_cp_gets_the_bytes_of_sglangs_host_pool() -> None:
    # DeepSeek: 8 layers of 512 + 64 bf16; Llama: 8 layers of K and V, 2 heads of 128, bf16
    assert tool.token_bytes(tool.MODELS["deepseek"]) == 8 * 576 * 2
    assert tool.token_bytes(tool.MODELS["llama"]) == 8 * 2 * 2 * 128 * 2
