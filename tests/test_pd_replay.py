"""`hicache-cp replay --pd`: a real decode peer process receives every
request's KV over Mooncake's TransferEngine (TCP on 127.0.0.1) and verifies
every byte; with CP each rank sends only the pages it owns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_cp.harness.cli import main

mooncake = pytest.importorskip("mooncake.engine", reason="Mooncake TransferEngine not importable (libibverbs1?)")
pytestmark = pytest.mark.mooncake


@pytest.mark.parametrize("cp_size", [1, 2])
def test_replay_with_pd_verifies_every_request(cp_size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")
    out = tmp_path / "pd.json"
    assert main(["replay", "--pd", "--limit", "40", "--cp-size", str(cp_size), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["integrity_mismatches"] == 0
    assert report["pd"]["decode_verified_rooms"] == 40
    assert report["pd"]["decode_open_rooms_at_exit"] == []
    ranks = report["per_rank"]
    assert len(ranks) == cp_size
    assert sum(r["pd_rooms"] for r in ranks) == 40 * cp_size
    assert all(r["pd_failed_rooms"] == 0 and r["pd_mismatches"] == 0 for r in ranks)
    # L2-resident pages were sent straight from host memory; descriptors never
    # exceed pages x layers (coalescing can only merge).
    assert sum(r["pd_pages_from_l2"] for r in ranks) > 0
    layers = 4 + 2 + 1 + 1  # tiny: target kv, target state (2 layers), draft kv, draft state
    assert 0 < sum(r["pd_descriptors"] for r in ranks) <= sum(r["pd_pages"] for r in ranks) * layers
