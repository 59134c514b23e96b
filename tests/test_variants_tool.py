"""`bench/device/variants.py`: the race's variants as one result file with its provenance."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("variants_tool", ROOT / "bench" / "device" / "variants.py")
assert _spec is not None and _spec.loader is not None
tool = importlib.util.module_from_spec(_spec)
sys.modules["variants_tool"] = tool
_spec.loader.exec_module(tool)

RUN = {"commit": "abc1234", "machine": "H100 host", "command": "hicache-cp bench-sglang", "workloads": {}}


def test_the_variants_share_their_runs_provenance_under_the_scripts_command() -> None:
    out = tool.merge({"base": RUN, "gil": dict(RUN)}, "bash bench/device/sglang_variants.sh")
    assert (out["commit"], out["machine"], out["command"]) == ("abc1234", "H100 host", "bash bench/device/sglang_variants.sh")
    assert list(out["variants"]) == ["base", "gil"]


@pytest.mark.parametrize("other", [{**RUN, "commit": "fff0000"}, {**RUN, "machine": "H200 host"}, {"workloads": {}}])
def test_variants_of_different_code_or_machines_are_refused(other: dict) -> None:
    with pytest.raises(ValueError, match="do not share one"):
        tool.merge({"base": RUN, "other": other}, "cmd")


def test_a_file_of_the_earlier_shape_is_rewrapped_with_its_logs_command(tmp_path: Path) -> None:
    old, log = tmp_path / "v.json", tmp_path / "v.log"
    old.write_text(json.dumps({"base": RUN}))
    log.write_text("# commit abc1234; machine 1 NVIDIA H100, 16 cpus; command: VARIANTS=<base||> bash x.sh\n=== more\n")
    assert tool.main(["--rewrap", str(old), "--log", str(log)]) == 0
    new = json.loads(old.read_text())
    assert new["command"] == "VARIANTS=<base||> bash x.sh" and new["variants"] == {"base": RUN}
    with pytest.raises(ValueError, match="current shape"):
        tool.main(["--rewrap", str(old), "--log", str(log)])
