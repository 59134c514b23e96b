"""`replay --engine hf --ttft-probe N` (harness.engines.hf_probe): L2-hit over L1-hit TTFT
pairs of the same prompt, and the forward's layer times with and without copies in flight.

The tiny preset on CPU: the figures are not the point here (the H200's are, in
bench/results/serve-h200.json); the pairing, the hit tiers and the arithmetic are."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers", minversion="5.20")

from hicache_cp.harness.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("probe") / "probe.json"
    assert main(["replay", "--engine", "hf", "--limit", "20", "--ttft-probe", "3", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_each_pair_is_one_prompt_hitting_in_l1_then_in_l2(probed: dict) -> None:
    pairs = probed["ttft_l2_over_l1_hit_pairs"]
    assert len(pairs) == 3 and probed["ttft_probe_valid_pairs"] == 3
    page = probed["page_size"]
    for p in pairs:
        pages = p["prefix_tokens"] // page
        assert p["prefix_tokens"] % page == 0 and 0.85 < p["prefix_tokens"] / p["prompt_tokens"] <= 0.93
        assert p["l1_hit_pages"] == [pages, 0], "the L1-hit request must hit its whole prefix in L1 only"
        assert p["l2_hit_pages"] == [0, pages], "the L2-hit request must hit its whole prefix in L2 only"
        assert p["valid"] and p["l2_load_s"] is not None and p["l2_load_s"] > 0
    assert {p["order"] for p in pairs} == {"l1-first", "l2-first"}


def test_the_ratio_is_the_median_over_the_pairs(probed: dict) -> None:
    ratios = [p["l2_ttft_s"] / p["l1_ttft_s"] for p in probed["ttft_l2_over_l1_hit_pairs"]]
    assert probed["ttft_l2_over_l1_hit"] == pytest.approx(float(np.median(ratios)))
    assert all(p["ratio"] == pytest.approx(r) for p, r in zip(probed["ttft_l2_over_l1_hit_pairs"], ratios))


def test_layer_times_cover_every_layer_with_and_without_copies(probed: dict) -> None:
    lt = probed["layer_forward_ms"]
    assert lt["alone"]["n"] == lt["with_copies"]["n"] > 0 and lt["alone"]["n"] % lt["repeats"] == 0
    assert lt["copied_bytes"] > 0 and lt["tokens"] > 0
    assert lt["ratio_p50"] == pytest.approx(lt["with_copies"]["p50"] / lt["alone"]["p50"])


@pytest.mark.parametrize("extra", [["--ttft-probe", "-1"], ["--ttft-probe", "2", "--cp-size", "2"]])
def test_bad_probe_options_are_refused_before_work(tmp_path: Path, extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.json"
    assert main(["replay", "--engine", "hf", "--limit", "3", *extra, "--json", str(out)]) == 2
    assert "--ttft-probe" in capsys.readouterr().err and not out.exists()
