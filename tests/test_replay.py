"""The main job: replay through the reference server, integrity on.

Covers the embedded workload, the first requests of the public trace, a
host page corrupted on purpose (the mismatch must be caught and named),
write policies, and bad input (exit code 2, one line, nothing written).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pytest

from hicache_harness.replay import command as R
from hicache_harness.replay.rank import REPORT_KEYS
from hicache_cp.cache import HiCache
from hicache_harness.cli import main
from hicache_cp.config import Config
from hicache_cp.io.base import Direction
from hicache_cp.radix import HostState
from hicache_harness.engines.synthetic import ReferenceServer, RequestResult
from hicache_harness.trace import request_tokens
from hicache_harness.workload import default_workload

SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    R.add_arguments(p)
    return p.parse_args(list(argv))


def test_embedded_workload_replays_with_zero_mismatches(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main(["replay", "--limit", "120", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for key in REPORT_KEYS:
        assert key in report, key
    assert report["requests"] == 120
    assert report["integrity_checked_pages"] > 0
    assert report["integrity_mismatches"] == 0
    # Both tiers served hits and the token accounting adds up.
    assert report["l1_hit_tokens"] > 0 and report["l2_hit_tokens"] > 0
    assert report["l1_hit_tokens"] + report["l2_hit_tokens"] + report["miss_tokens"] == report["prompt_tokens"]
    assert report["backups_committed"] > 0 and report["bytes_d2h"] > 0 and report["bytes_h2d"] > 0


@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason=f"public trace not found at {SHARED_TRACE}")
def test_shared_trace_prefix_replays_with_bounds(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    code = main(["replay", "--trace", str(SHARED_TRACE), "--limit", "400", "--l2-fraction", "0.1",
                 "--bounds", "--json", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    assert code == 0 and report["integrity_mismatches"] == 0
    assert report["integrity_checked_pages"] > 0
    b = report["bounds"]
    assert 0 <= b["belady_hit_rate"] <= b["infinite_capacity_hit_rate"] <= 1
    assert report["hit_rate"] <= b["infinite_capacity_hit_rate"]


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_write_policies_keep_integrity(policy: str) -> None:
    args = _args("--limit", "80", "--write-policy", policy, "--l2-fraction", "0.3")
    report = R.replay(args)
    assert report["integrity_mismatches"] == 0
    assert report["write_policy"] == policy
    assert report["integrity_checked_pages"] > 0


def test_corrupted_host_page_is_caught_and_named() -> None:
    # The harness's own byte oracle, with the library's restore checks off (they would
    # catch the page first: tests/test_restore_checks.py): the oracle stays an
    # independent second check.
    config = Config(model="tiny", l1_pages=64, host_budget_bytes=400 * Config().layout().bytes_per_page,
                    verify_restores="off")
    with HiCache(config) as cache:
        server = ReferenceServer(cache)
        tokens = np.arange(16 * 20, dtype=np.int64)
        server.serve(0, tokens)
        cache.drain()
        node = next(n for n in cache.tree.nodes() if n.host_state is HostState.COMMITTED)
        # Flip one byte of target state layer 2 (compact slot 1), page 3 of the node.
        part = cache.layout.parts[1]
        assert part.layer_ids == (0, 2)
        host_page = int(node.host_pages[3])  # type: ignore[index]
        cache.host_pool.layer_view(part.part, 1)[host_page, 5] ^= 0xFF
        # Push the node out of L1 so the next request must load it back from L2.
        filler = np.arange(10_000, 10_000 + 16 * 60, dtype=np.int64)
        server.serve(1, filler)
        cache.drain()
        assert not node.on_device
        server.serve(2, tokens)
        assert cache.metrics.l2_hit_pages > 0
    assert server.integrity.mismatches == 1
    m = server.integrity.examples[0]
    assert (m.request, m.position, m.part, m.layer) == (2, node.first_position + 3, "target_state", 2)


def _serve_embedded(delay_s: float) -> list[RequestResult]:
    """Serve the embedded workload's first requests; every D2H copy sleeps `delay_s`."""
    requests = default_workload(seed=0)[:40]
    config = Config(model="tiny", l1_pages=48, host_budget_bytes=200 * Config().layout().bytes_per_page)
    with HiCache(config) as cache:
        cache.engine.fault = lambda d, part, layer: time.sleep(delay_s) if d is Direction.D2H else None  # type: ignore[attr-defined]
        server = ReferenceServer(cache)
        results = [server.serve(r.index, request_tokens(r, config.page_size)) for r in requests]
        cache.drain()
        assert server.integrity.mismatches == 0
        assert cache.metrics.evictions_l1 > 0 and cache.metrics.l2_hit_pages > 0  # both tiers under pressure
    return results


def test_slow_backups_change_no_decision() -> None:
    """Copy timing must not change hits or reject requests (CI once saw a slow
    runner reject requests because L1 was full of backups still in flight)."""
    fast = _serve_embedded(0.0)
    slow = _serve_embedded(0.003)
    assert all(r.served for r in slow)
    assert slow == fast


def test_replay_without_verification_checks_nothing() -> None:
    report = R.replay(_args("--limit", "30", "--no-verify"))
    assert report["integrity_checked_pages"] == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--l1-pages", "0"], "--l1-pages must be > 0"),
        (["--l2-fraction", "1.5"], "--l2-fraction must be at most 1"),
        (["--tokens-per-block", "-1"], "--tokens-per-block must be > 0"),
        (["--trace", "/nonexistent/trace.jsonl"], "no such file"),
        (["--l1-pages", "5"], "cannot hold the longest request"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "never.json"
    assert main(["replay", *argv, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


@pytest.mark.parametrize(
    "content, line",
    [
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{bad json\n', 2),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1}\n', 1),
        ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}\n', 1),
        ("", 1),
    ],
)
def test_malformed_trace_names_the_line(content: str, line: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(content)
    out = tmp_path / "never.json"
    assert main(["replay", "--trace", str(trace), "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:{line}:" in err
    assert "Traceback" not in err
    assert not out.exists()


def test_a_checker_that_skips_a_part_fails_the_run(monkeypatch, tmp_path) -> None:
    """Integrity coverage is computed, not assumed: a checker that silently
    skips the draft parts covers fewer units than were reused, and the run
    exits 1 although no byte it did compare differs."""
    from hicache_harness.cli import main
    from hicache_harness.engines.synthetic import ReferenceServer
    from hicache_cp.layout import Model

    real = ReferenceServer._units
    monkeypatch.setattr(
        ReferenceServer, "_units", lambda self: [(p, ls) for p, ls in real(self) if p.part.model is Model.TARGET]
    )
    out = tmp_path / "r.json"
    assert main(["replay", "--limit", "40", "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["integrity_mismatches"] == 0
    assert 0 < report["integrity_checked_units"] < report["integrity_expected_units"]
    assert any("covered" in f for f in report["integrity_failures"])


def test_checked_units_equal_expected_units(tmp_path) -> None:
    from hicache_harness.cli import main

    out = tmp_path / "r.json"
    assert main(["replay", "--limit", "60", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["integrity_expected_units"] > 0
    assert report["integrity_checked_units"] == report["integrity_expected_units"]
    assert report["integrity_failures"] == []
