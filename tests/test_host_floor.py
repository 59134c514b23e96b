"""`bench/scripts/host_floor.py` keeps working as the engine moves (CPU).

The tool builds the `direct` engine field by field around a driver double
(the real constructor needs CUDA), so a new engine field would break it only
when someone runs it. This runs its bench-overhead replay on a few requests
and checks what it is for: every request's calls are timed, and the hook's
path follows `hook_worker_above` (0, the default: every backup layer of a hook
goes to the issue worker; 16: none of these small layers does)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("host_floor", ROOT / "bench" / "scripts" / "host_floor.py")
host_floor = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["host_floor"] = host_floor
_spec.loader.exec_module(host_floor)  # type: ignore[union-attr]

ARGS = ["--limit", "40", "--l2-gib", "0.25"]


@pytest.mark.parametrize("hook_worker_above", [0, 16])
def test_the_replay_floor_times_every_call_and_follows_the_hook_option(hook_worker_above: int) -> None:
    floor = host_floor.replay_floor(ARGS, {"hook_worker_above": hook_worker_above})
    calls = floor["calls"]
    assert floor["requests"] == 40
    assert all(calls[name]["count"] == 40 for name in ("match", "load_back", "poll", "own_per_request"))
    hooks = calls["layer_hook"]["count"]
    assert hooks == 40 * 62  # DeepSeek-V3.2: 61 target layers and one MTP layer a request
    loaded_layers = 62 * floor["loads"]
    if hook_worker_above == 0:
        assert floor["deferred"] > loaded_layers  # backup layers went to the worker too
    else:
        assert floor["deferred"] <= loaded_layers  # only loads: the hook issued its small layers itself
    assert calls["layer_hook"]["cpu_p50"] > 0 and calls["match"]["cpu_p50"] > 0
