"""The README's protocol sketch is runnable code: keep it true."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_protocol_sketch_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python block"
    scope: dict[str, object] = {}
    exec(compile(blocks[0], str(README), "exec"), scope)  # noqa: S102 - our own README
    cache = scope["cache"]
    # The sketch's request went through: its pages are cached and nothing is in flight.
    assert cache.in_flight() == ([], [])  # type: ignore[attr-defined]
    assert cache.metrics.backups_committed == 1  # type: ignore[attr-defined]
