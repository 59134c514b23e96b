"""bench/results/INDEX.md stays complete and true: every result file is indexed with its
bench, provenance (commit, machine, command), a headline and who cites it, and every JSON
carries its own commit, machine and command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import results_index as R  # noqa: E402

sys.path.remove(str(ROOT / "tools"))


def test_every_result_file_is_indexed_with_provenance_and_a_headline() -> None:
    assert not R.problems(), "\n".join(R.problems())


def test_every_json_result_carries_its_commit_machine_and_command() -> None:
    """Numbers are comparable only with numbers of the same code on the same hardware."""
    bad = {}
    for path in sorted(R.RESULTS.rglob("*.json")):
        if path.name in R.OWN:
            continue
        data = json.loads(path.read_text())
        missing = [k for k in ("commit", "machine", "command") if not (isinstance(data, dict) and data.get(k))]
        if missing:
            bad[str(path.relative_to(R.RESULTS))] = missing
    assert not bad, bad


def test_the_index_page_is_up_to_date() -> None:
    assert R.INDEX_MD.read_text() == R.render(), "run: python tools/results_index.py"


def test_current_results_are_apart_from_superseded_rounds() -> None:
    """Archived files live under archive/ and name what superseded them where one exists;
    nothing current names a successor."""
    for e in R.entries():
        if e.superseded_by is not None:
            assert e.archived, e.path
            assert not e.superseded_by.startswith("archive/"), e.path


def test_a_file_without_an_entry_or_provenance_is_reported(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "archive").mkdir()
    (tmp_path / "new-cpu.json").write_text(json.dumps({"hit_rate": 0.5}))
    (tmp_path / "old.log").write_text("no header\n")
    (tmp_path / "index.json").write_text(json.dumps({"entries": {"old.log": {"bench": "x"}, "gone.json": {"bench": "y"}}}))
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    monkeypatch.setattr(R, "INDEX_JSON", tmp_path / "index.json")
    found = "\n".join(R.problems())
    assert "new-cpu.json: no entry" in found
    assert "new-cpu.json: the JSON lacks commit, machine, command" in found
    assert "gone.json: in results_index.json but not in bench/results" in found
    assert "old.log: no commit, machine or command" in found and "old.log: no headline" in found


@pytest.mark.parametrize("name", ["io-h200.json", "overhead-h200.json", "replay-h200-cp1.json"])
def test_headlines_of_known_benches_come_from_their_numbers(name: str) -> None:
    headline = R.derived_headline(name)
    data = json.loads((R.RESULTS / name).read_text())
    key = {"io-h200.json": "exposed_load_fraction", "overhead-h200.json": "layer_hook_us_p50",
           "replay-h200-cp1.json": "hit_rate"}[name]  # fmt: skip
    digits = {"io-h200.json": 3, "overhead-h200.json": 1, "replay-h200-cp1.json": 4}[name]
    assert headline is not None and f"{data[key]:.{digits}f}" in headline
