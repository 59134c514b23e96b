"""The deliberate-fault list of `tools/mutate.py` stays true as the code moves.

Each fault names one snippet of one file that must occur exactly once (the
tool refuses a fault that no longer applies, but only when someone runs it),
and the tests that must catch it must exist."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("mutate", ROOT / "tools" / "mutate.py")
mutate = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["mutate"] = mutate  # its dataclasses look their module up
_spec.loader.exec_module(mutate)  # type: ignore[union-attr]


@pytest.mark.parametrize("fault", mutate.FAULTS, ids=lambda f: f.name)
def test_every_fault_applies_to_todays_code(fault) -> None:
    text = (ROOT / fault.file).read_text()
    assert text.count(fault.old) == 1, f"{fault.name}: its snippet occurs {text.count(fault.old)} times in {fault.file}"
    assert fault.old != fault.new
    for test in fault.tests:
        assert (ROOT / test.split("::")[0]).exists(), f"{fault.name}: no test file {test}"


def test_fault_names_are_unique() -> None:
    names = [f.name for f in mutate.FAULTS]
    assert len(names) == len(set(names))
