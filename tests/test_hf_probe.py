"""`replay --engine hf --ttft-probe N` (hicache_harness.engines.hf_probe): L2-hit over L1-hit TTFT
pairs of the same prompt, and the forward's layer times with and without copies in flight.

The tiny preset on CPU: the figures are not the point here (the H200's are, in
bench/results/serve-h200.json); the pairing, the hit tiers and the arithmetic are."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers", minversion="5.20")

from hicache_harness.cli import main  # noqa: E402
from hicache_harness.engines.hf_model import layout_of  # noqa: E402
from hicache_harness.engines.hf_probe import PAIRS_PER_PROMPT  # noqa: E402


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("probe") / "probe.json"
    assert main(["replay", "--engine", "hf", "--limit", "12", "--ttft-probe", "3", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def _page_bytes(report: dict) -> int:
    """Bytes of one logical page (every layer of every part) of the replay's layout."""
    return layout_of(report["hf_preset"]).layout(report["page_size"]).bytes_per_page


def test_each_pair_is_one_prompt_hitting_in_l1_then_in_l2(probed: dict) -> None:
    pairs = probed["ttft_l2_over_l1_hit_pairs"]
    assert len(pairs) == 3 * PAIRS_PER_PROMPT == probed["ttft_probe_pairs"] == probed["ttft_probe_valid_pairs"]
    assert probed["ttft_probe_wall_s"] > 0 and "ttft_probe_error" not in probed
    page = probed["page_size"]
    for p in pairs:
        pages = p["prefix_tokens"] // page
        assert p["l1_prompt_tokens"] == p["l2_prompt_tokens"] == p["prompt_tokens"], "one prompt size per pair"
        assert p["prefix_tokens"] % page == 0 and 0.85 < p["prefix_tokens"] / p["prompt_tokens"] <= 0.93
        assert p["l1_hit_pages"] == [pages, 0], "the L1-hit request must hit its whole prefix in L1 only"
        assert p["l2_hit_pages"] == [0, pages], "the L2-hit request must hit its whole prefix in L2 only"
        assert p["valid"] and p["l2_load_s"] is not None and p["l2_load_s"] > 0
        assert p["l2_load_bytes"] == pages * _page_bytes(probed), "the L2 hit loaded its whole prefix"
    for k in range(3):  # every prompt: one pair of each order
        assert sorted(p["order"] for p in pairs if p["sample"] == k) == ["l1-first", "l2-first"]


def test_the_probe_leaves_the_replays_counters_alone(probed: dict) -> None:
    """The probe runs on a cache of its own: the replay's prompt tokens are its requests' only."""
    rows = probed["per_request"]
    assert len(rows) == probed["requests"] == 12
    assert probed["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows if r["served"])


def test_the_ratio_is_the_median_over_the_pairs(probed: dict) -> None:
    ratios = [p["l2_ttft_s"] / p["l1_ttft_s"] for p in probed["ttft_l2_over_l1_hit_pairs"]]
    assert probed["ttft_l2_over_l1_hit"] == pytest.approx(float(np.median(ratios)))
    assert all(p["ratio"] == pytest.approx(r) for p, r in zip(probed["ttft_l2_over_l1_hit_pairs"], ratios))


def test_layer_times_cover_every_layer_with_and_without_copies(probed: dict) -> None:
    lt = probed["layer_forward_ms"]
    assert lt["alone"]["n"] == lt["with_copies"]["n"] > 0 and lt["alone"]["n"] % lt["repeats"] == 0
    assert lt["copied_bytes"] > 0 and lt["tokens"] > 0
    assert lt["ratio_p50"] == pytest.approx(lt["with_copies"]["p50"] / lt["alone"]["p50"])
    layers = 4  # the tiny preset: 3 target layers and the draft layer
    assert lt["alone"]["n"] == lt["repeats"] * layers
    assert lt["copied_bytes"] == lt["repeats"] * 2 * lt["copy_pages"] * _page_bytes(probed)
    hp = lt["hit_pairs"]
    assert hp["l1_hit"]["n"] == hp["l2_hit"]["n"] > 0 and hp["l2_load_bytes"] > 0
    assert hp["ratio_p50"] == pytest.approx(hp["l2_hit"]["p50"] / hp["l1_hit"]["p50"])


@pytest.mark.parametrize("extra", [["--ttft-probe", "-1"], ["--ttft-probe", "2", "--cp-size", "2"]])
def test_bad_probe_options_are_refused_before_work(tmp_path: Path, extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.json"
    assert main(["replay", "--engine", "hf", "--limit", "3", *extra, "--json", str(out)]) == 2
    assert "--ttft-probe" in capsys.readouterr().err and not out.exists()


def test_a_failing_probe_leaves_the_replay_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe is the replay's last measurement: its failure is logged with the traceback and
    named in the report (`ttft_probe_error`), and the replay's own results are still written."""
    import hicache_harness.engines.hf_probe as hf_probe

    def broken(*args: object, **kwargs: object) -> dict:
        raise RuntimeError("the prefix did not become L2-only")

    monkeypatch.setattr(hf_probe, "ttft_pairs", broken)
    out = tmp_path / "x.json"
    assert main(["replay", "--engine", "hf", "--limit", "3", "--ttft-probe", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ttft_probe_error"] == "RuntimeError: the prefix did not become L2-only"
    assert report["served_requests"] == 3 and "ttft_l2_over_l1_hit" not in report
