"""Honest numbers (issue 48, item 7): every result file under bench/results says
where it came from: the commit, the machine and the command that wrote it
(`hicache_cp.harness.provenance`), as non-empty strings at the top level.

Nothing is skipped: a file without them is either fixed (the run is known)
or archived out of bench/results.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
PROVENANCE = ("commit", "machine", "command")
FILES = sorted(RESULTS.rglob("*.json"))


def test_there_are_results_to_check() -> None:
    assert len(FILES) > 10, f"bench/results has {len(FILES)} JSON files; the glob is wrong"


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(RESULTS)) for p in FILES])
def test_every_result_carries_its_commit_machine_and_command(path: Path) -> None:
    data = json.loads(path.read_text())
    assert isinstance(data, dict), f"{path.name}: a JSON {type(data).__name__}, not an object with its provenance"
    missing = [k for k in PROVENANCE if not (isinstance(data.get(k), str) and data[k].strip())]
    assert not missing, f"{path.relative_to(RESULTS)} lacks {', '.join(missing)} (see harness/provenance.py)"
