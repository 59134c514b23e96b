"""Tests for the bench-alloc microbenchmark on a tiny pool."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hicache_cp.harness.bench import alloc as bench


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_tiny_pool_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "res" / "alloc.json"
    args = parse(["--pool-gib", "0.05", "--ops", "400", "--seed", "3", "--json", str(out)])
    assert bench.run(args) == 0
    result = json.loads(out.read_text())
    for key in (
        "pool_gib", "page_kib", "pages", "free_extents", "fragmentation", "allocators",
        "speedup_vs_naive_scan", "speedup_vs_slot_list", "commit", "machine", "command",
    ):
        assert key in result, key
    assert result["pages"] == int(0.05 * 2**30) // (41 * 1024)
    allocators = result["allocators"]
    assert set(allocators) == {"ours", "naive_scan", "slot_list"}
    fields = {"ops", "reserve_p50_us", "reserve_p99_us", "free_p50_us", "free_p99_us", "runs_per_reserve_mean"}
    for stats in allocators.values():
        assert fields <= set(stats)
        assert stats["ops"] == 400
    served = {name: stats["pages_reserved"] for name, stats in allocators.items()}
    assert len(set(served.values())) == 1 and served["ours"] > 0  # same ops, same pages served
    table = capsys.readouterr().out
    assert "naive_scan" in table and "slot_list" in table


def test_baselines_replay_a_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["--pool-gib", "0.05", "--ops", "300", "--naive-ops", "50", "--slot-ops", "100"])
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "naive_scan replayed the first 50 of the 300 ops" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--pool-gib", "0"],
        ["--pool-gib", "-1"],
        ["--pool-gib", "0.00001"],  # smaller than one page
        ["--page-kib", "0"],
        ["--page-kib", "0.0048828125"],  # 5 bytes: not a multiple of 8
        ["--page-kib", "0.001"],  # not a whole number of bytes
        ["--ops", "0"],
        ["--ops", "-5"],
        ["--reserve-pages", "0"],
    ],
)
def test_bad_input_exits_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(parse(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "error:" in err and "Traceback" not in err


def test_module_entry_point(tmp_path: Path) -> None:
    assert bench.main(["--pool-gib", "0.02", "--ops", "50", "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["allocators"]["ours"]["ops"] == 50
