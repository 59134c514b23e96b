"""`bench/engines/sglang_engine.py`'s own logic on CPU (the engine itself runs on the device only):
the prompt stream, the per-mode summary and the greedy comparison against the run without a host tier."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("sglang_engine_tool", ROOT / "bench" / "engines" / "sglang_engine.py")
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


# ---- the engine's arguments, checked by SGLang 0.5.23 itself (no engine starts) ------------------


def _check_args(model: str) -> list[dict]:
    import json
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "engines" / "sglang_engine.py"), "--check-args", "--model", model],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and len(rows) == 3, (out.stdout[-3000:], out.stderr[-3000:])
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("model", ["deepseek", "llama"])
def test_every_modes_arguments_pass_sglangs_own_server_args(model: str) -> None:
    """Each mode's `sglang.Engine` arguments go through SGLang's `ServerArgs` and its
    resolution (the plug-in registered through its entry point), with CUDA claimed here:
    a misspelt or refused argument fails here, not in a device call."""
    pytest.importorskip("sglang", reason="sglang not installed (scripts/install_sglang.sh)")
    rows = {r["mode"]: r["resolved"] for r in _check_args(model)}
    for mode, resolved in rows.items():
        assert resolved["page_size"] == 64 and resolved["attention_backend"] == "triton", mode
        assert resolved["sampling_backend"] == "pytorch" and resolved["disable_cuda_graph"] is True, mode
    assert rows["hicache-cp"]["radix_cache_backend"] == "hicache-cp"
    assert rows["hicache-cp"]["enable_hierarchical_cache"] is False
    assert rows["sglang-hicache"]["enable_hierarchical_cache"] is True and rows["sglang-hicache"]["hicache_ratio"] == 4.0
    assert rows["sglang-hicache"]["hicache_io_backend"] == "kernel" and rows["sglang-hicache"]["radix_cache_backend"] is None
    assert rows["none"]["radix_cache_backend"] is None and rows["none"]["enable_hierarchical_cache"] is False


@pytest.mark.slow
def test_a_value_sglangs_command_line_refuses_is_named() -> None:
    pytest.importorskip("sglang", reason="sglang not installed (scripts/install_sglang.sh)")
    from hicache_harness.sglang.env import import_sglang

    import_sglang()
    tool.check_cli_values({"page_size": 64, "attention_backend": "triton", "disable_cuda_graph": True})
    with pytest.raises(ValueError, match=r"--hicache-write-policy 'write_thru': SGLang accepts \['write_back'"):
        tool.check_cli_values({"hicache_write_policy": "write_thru"})
    with pytest.raises(ValueError, match="--page-size 'sixty-four'"):
        tool.check_cli_values({"page_size": "sixty-four"})


def test_the_warmup_prompt_shares_no_page_with_any_timed_prompt() -> None:
    """The untimed warm-up must not seed a prefix the timed prompts then hit."""
    args = tool.argparse.Namespace(seed=0, groups=2, rounds=2, prefix_tokens=256, suffix_tokens=64)
    warm = tool.warmup_prompt(args)
    assert len(warm) >= tool.PAGE
    first_pages = {tuple(ids[: tool.PAGE]) for _, _, ids in tool.prompts(args)}
    assert tuple(warm[: tool.PAGE]) not in first_pages
    assert min(min(ids) for _, _, ids in tool.prompts(args)) > max(warm)


def test_a_mode_child_gets_the_parents_arguments_but_no_priming_or_output_flags() -> None:
    argv = ["--model", "llama", "--no-prime", "--modes", "hicache-cp", "none", "--json", "out.json", "--quick"]
    assert tool._without(argv, "--json", "--modes", "--no-prime") == ["--model", "llama", "--quick"]



def test_the_restore_checks_come_from_the_plugins_own_metrics_endpoint() -> None:
    """What the bench scrapes is what `hicache_cp.prometheus` serves under SGLang's names: a
    real exporter over a cache whose checks counted pages and failures."""
    pytest.importorskip("prometheus_client")
    from hicache_cp import HiCache
    from hicache_cp.prometheus import start_exporter
    from conftest import tiny_config

    cache = HiCache(tiny_config(l1_pages=16, host_pages=32, debug_checks=False))
    stats = cache.stats
    integrity = {"checked_pages": {"l2": 12, "l3": 0}, "failures": {"l2": {"target_kv": 2}}, "dropped_pages": 1}
    cache.stats = lambda: {**stats(), "integrity": integrity}  # type: ignore[method-assign]
    exporter = start_exporter(cache, port=tool.free_port(), naming="sglang")
    try:
        got = tool.scrape_restore_checks(exporter.port)
    finally:
        exporter.stop()
        cache.close()
    assert got == {"checked_pages": {"l2": 12, "l3": 0}, "failures": {"l2": {"target_kv": 2}}}
    assert tool._checks_cell(got) == "12 / 2"


def test_a_scrape_that_fails_is_recorded_not_raised() -> None:
    got = tool.scrape_restore_checks(tool.free_port())  # nothing listens there
    assert set(got) == {"error"} and "not scraped" in tool._checks_cell(got)
