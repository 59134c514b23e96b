"""bench/scripts/engine_runs.py: several engine runs pooled, per mode."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("engine_runs", ROOT / "bench" / "scripts" / "engine_runs.py")
assert _spec is not None and _spec.loader is not None
engine_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine_runs)


def _mode(ttfts: list[float], p50: float, identical: bool | None) -> dict[str, Any]:
    # one cold request (nothing from host) and the rest with 4,096 of 4,352 tokens from host
    reqs = [{"ttft_ms": 90.0, "host_tokens": 0, "prompt_tokens": 4352}]
    reqs += [{"ttft_ms": t, "host_tokens": 4096, "prompt_tokens": 4352} for t in ttfts]
    return {"requests": reqs, "half_from_host_ttft_p50_ms": p50, "greedy_identical_to_none": identical}


def _run(ours: list[float], theirs: list[float], identical: bool | None = True) -> dict[str, Any]:
    return {"commit": "c", "machine": "m", "modes": {
        "hicache-cp": _mode(ours, sorted(ours)[len(ours) // 2], identical),
        "sglang-hicache": _mode(theirs, sorted(theirs)[len(theirs) // 2], identical)}}  # fmt: skip


def test_runs_pool_their_host_hits_and_count_the_runs_each_side_won() -> None:
    won, lost = _run([30.0, 31.0, 32.0], [40.0, 41.0, 42.0]), _run([36.0, 37.0, 38.0], [31.0, 32.0, 33.0], None)
    summary = engine_runs.pool([won, lost])
    ours = summary["hicache-cp"]
    assert ours["half_from_host_requests_pooled"] == 6  # the cold requests left out
    assert ours["half_from_host_ttft_p50_ms_pooled"] == pytest.approx((32.0 + 36.0) / 2)
    assert ours["half_from_host_ttft_p50_ms_by_run"] == [31.0, 37.0]
    assert ours["greedy_identical_to_none_by_run"] == [True, None]
    assert engine_runs.runs_at_most_sglang(summary) == 1


def test_runs_of_different_commits_do_not_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _run([30.0], [31.0]), {**_run([30.0], [31.0]), "commit": "other"}
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, run in zip(paths, (a, b)):
        path.write_text(json.dumps(run))
    assert engine_runs.main([str(p) for p in paths]) == 2
    assert "different commits" in capsys.readouterr().err
