"""The contract between the replay and a prefill engine (see `hicache_harness.engines`).

`Engine` is what the replay's rank loop calls; `EngineRun` is what it gets
back: the engine's byte checks in the replay report's terms, its rejected
requests, and its own report keys.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hicache_cp.cache import HiCache
from hicache_cp.config import Config
from hicache_cp.cp.agreement import Agreement
from hicache_harness.trace import TraceRequest


@dataclass(frozen=True)
class RunOptions:
    """How the replay asks an engine to serve its requests."""

    tokens_per_block: int
    sink: Any = None  # the PD sender, or None
    verify: bool = True
    progress: bool = False
    on_request: Callable[[int], None] = lambda i: None  # after the i-th request finished
    crash_at: int | None = None  # the i-th request kills its process with SIGKILL mid-backup (`replay --restart-at`)


@dataclass
class EngineRun:
    """What an engine's run measured, in the terms of the replay report."""

    checked_pages: int
    checked_units: int
    expected_units: int
    mismatches: int
    examples: list[str]
    rejected: int
    extra: dict[str, Any] = field(default_factory=dict)  # engine-specific report keys


class Engine(Protocol):
    name: str

    def configure(self, args: argparse.Namespace, config: Config, requests: list[TraceRequest]) -> Config:
        """The config this engine runs with: `config` (resolved with `config_overrides`
        and sized by the replay's setup), checked; raises if it does not fit."""

    def open_cache(self, config: Config, *, rank: int, agreement: Agreement | None, device: str) -> HiCache:
        """The cache, over this engine's L1 buffers."""

    def run(self, cache: HiCache, requests: list[TraceRequest], opts: RunOptions) -> EngineRun:
        """Serve every request; `opts.on_request(i)` after the i-th one finished."""


def progress_bar(items: list[Any], show: bool, desc: str = "replay") -> Any:
    """`items` wrapped in a tqdm bar on stderr when `show`."""
    if not show:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="req", mininterval=1.0, file=sys.stderr)
