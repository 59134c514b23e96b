"""Prefill engines that drive `HiCache` as a real server would.

    synthetic   the reference server: deterministic KV bytes, one request at a time,
                the next one queued behind it (its non-waiting L3 prefetch starts
                then) (`synthetic.ReferenceServer`; the default and the fast CI path)
    hf          a real model: transformers' DeepSeek-V3.2 with seeded random weights,
                batched and chunked by a server-like scheduler (`hf`, `hf_model`,
                `hf_forward`, `hf_oracle`, `hf_timing`, `scheduler`)

The replay's rank loop (`hicache_harness.replay.rank`) talks to an engine
through the `Engine` protocol only (`base`):

    overrides = config_overrides(args)                # setup: fields the engine fixes, before sizing
    engine = make_engine(args)                        # --engine
    config = engine.configure(args, config, requests) # checks the config fits the engine
    cache = engine.open_cache(config, rank=..., agreement=..., device=...)
    run = engine.run(cache, requests, tokens_per_block=..., sink=..., verify=...,
                     progress=..., on_request=...)    # -> EngineRun

`add_engine_arguments(parser)` adds `--engine` and every engine's options;
it imports no optional dependency (transformers is imported when the hf
engine runs).
"""

from __future__ import annotations

import argparse
from typing import Any

from hicache_cp.cache import HiCache
from hicache_cp.config import Config
from hicache_cp.cp.agreement import Agreement
from hicache_harness.engines.base import Engine, EngineRun, RunOptions, progress_bar
from hicache_harness.trace import TraceRequest, request_tokens

__all__ = ["ENGINES", "Engine", "EngineRun", "RunOptions", "SyntheticEngine", "add_engine_arguments",
           "config_overrides", "make_engine", "model_bytes", "progress_bar"]  # fmt: skip

ENGINES = ("synthetic", "hf")


class SyntheticEngine:
    """The reference server (`synthetic.ReferenceServer`), one request at a time."""

    name = "synthetic"

    def configure(self, args: argparse.Namespace, config: Config, requests: list[TraceRequest]) -> Config:
        return config

    def open_cache(self, config: Config, *, rank: int, agreement: Agreement | None, device: str) -> HiCache:
        return HiCache(config, rank=rank, agreement=agreement, device=device)

    def run(self, cache: HiCache, requests: list[TraceRequest], opts: RunOptions) -> EngineRun:
        from hicache_harness.engines.synthetic import ReferenceServer

        server = ReferenceServer(cache, verify=opts.verify, sink=opts.sink)
        # The next request is queued while one is served: a non-waiting L3
        # prefetch of it overlaps this one's compute (`ReferenceServer.serve`).
        tpb = opts.tokens_per_block
        after = request_tokens(requests[0], tpb) if requests else None
        for i, req in enumerate(progress_bar(requests, opts.progress)):
            tokens, after = after, (request_tokens(requests[i + 1], tpb) if i + 1 < len(requests) else None)
            assert tokens is not None
            if i == opts.crash_at:  # every layer's backup submitted, none decided: die now
                server.before_insert = crash
            server.serve(req.index, tokens, queued=() if after is None else (after,))
            opts.on_request(i)
        t = server.integrity
        return EngineRun(
            t.checked_pages, t.checked_units, t.expected_units, t.mismatches,
            [str(m) for m in t.examples[:10]], server.rejected,
        )  # fmt: skip


def crash() -> None:
    """Die at once, as a crash would: SIGKILL to this process (no clean-up runs)."""
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def make_engine(args: argparse.Namespace) -> Engine:
    """The engine `--engine` names (synthetic when the option is absent)."""
    name = getattr(args, "engine", None) or "synthetic"
    if name == "synthetic":
        return SyntheticEngine()
    if name == "hf":
        from hicache_harness.engines.hf import HfEngine

        return HfEngine(args)
    raise ValueError(f"unknown engine {name!r}; engines: {', '.join(ENGINES)}")


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Config fields the chosen engine fixes, for the replay's config resolution
    (before sizing): the hf engine's model layout and page size; {} otherwise.
    Without --engine hf, refuses the hf engine's options (they would do nothing)."""
    if (getattr(args, "engine", None) or "synthetic") != "hf":
        import hicache_harness.engines.hf_options as hf_options

        hf_options.refuse_without_hf(args)
        return {}
    from hicache_harness.engines.hf import config_overrides as hf_overrides

    return hf_overrides(args)


def model_bytes(args: argparse.Namespace) -> int:
    """Memory the chosen engine's model takes per rank, on the rank's device (0: none)."""
    if (getattr(args, "engine", None) or "synthetic") != "hf":
        return 0
    from hicache_harness.engines.hf import model_bytes as hf_model_bytes

    return hf_model_bytes(args)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """`--engine` and the options of every engine (no optional imports)."""
    import hicache_harness.engines.hf_options as hf_options

    parser.add_argument("--engine", choices=ENGINES, default="synthetic",
                        help="prefill engine: the synthetic reference server (default) or a real model (hf)")  # fmt: skip
    hf_options.add_arguments(parser)
