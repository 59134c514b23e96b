"""One rank's replay: every request through a prefill engine and the cache.

The engine (`hicache_cp.harness.engines`, `--engine`) serves the requests;
this module builds the cache it asks for, collects the cache's counters and
the engine's byte checks into the rank's report, and adds the engine's own
keys (`EngineRun.extra`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from hicache_cp.cache import HiCache
from hicache_cp.config import Config
from hicache_cp.cp.agreement import Agreement
from hicache_cp.harness import lifetime
from hicache_cp.harness.engines import RunOptions, make_engine
from hicache_cp.harness.engines.synthetic import RequestSink
from hicache_cp.harness.provenance import command_line, git_commit, machine
from hicache_cp.harness.replay.setup import tokens_per_block
from hicache_cp.harness.trace import TraceRequest

REPORT_KEYS = (
    "requests", "prompt_tokens", "l1_hit_tokens", "l2_hit_tokens", "miss_tokens", "hit_rate",
    "bytes_d2h", "bytes_h2d", "backups_committed", "backups_aborted", "evictions_l1", "evictions_l2",
    "integrity_checked_pages", "integrity_checked_units", "integrity_expected_units", "integrity_mismatches",
    "wall_s", "backup_pages_wanted", "backup_pages_skipped",
    "backup_pages_dropped", "backup_pages_trimmed",
)  # fmt: skip


def replay_rank(
    args: argparse.Namespace,
    config: Config,
    requests: list[TraceRequest],
    *,
    rank: int = 0,
    agreement: Agreement | None = None,
    sink_factory: Callable[[HiCache], RequestSink] | None = None,
    progress: bool = True,
    device: str | None = None,
) -> dict[str, Any]:
    """Replay every request on this rank through the engine `--engine` names
    (the synthetic reference server by default); return this rank's report.

    `sink_factory` builds the request sink (the PD sender) once the cache and
    its pools exist; its `totals.as_dict()` joins the report. `device`: this
    rank's device (a CP rank's own GPU); default `--device`.
    """
    engine = make_engine(args)
    config = engine.configure(args, config, requests)
    device = device or args.device  # checked and resolved by setup.check_args
    tpb = tokens_per_block(args, config)
    t0 = time.perf_counter()
    samples: list[dict[str, Any]] = []
    with engine.open_cache(config, rank=rank, agreement=agreement, device=device) as cache, ExitStack() as stops:
        # Stopped before the cache closes, on every path (an interrupt too): the
        # sink's open rooms are aborted and drained while their pages still exist.
        sink = sink_factory(cache) if sink_factory is not None else None
        if sink is not None:
            stops.callback(sink.close)  # type: ignore[attr-defined]
        exporter = _start_metrics(args, cache, rank)
        if exporter is not None:
            stops.callback(exporter.stop)
        every = max(1, len(requests) // 200)

        def on_request(i: int) -> None:
            lifetime.raise_if_interrupted()  # a signal whose exception was swallowed stops the run here
            if i % every == 0 or i == len(requests) - 1:
                samples.append(_sample(i, cache))

        opts = RunOptions(tpb, sink, verify=not args.no_verify, progress=progress and rank == 0, on_request=on_request)
        run = engine.run(cache, requests, opts)
        cache.drain()
        cache.check_invariants()
        stats = cache.stats()
        if sink is not None:
            stats.update(sink.totals.as_dict())  # type: ignore[attr-defined]
    wall = time.perf_counter() - t0
    report = {k: stats[k] for k in REPORT_KEYS if k in stats}
    report.update({k: v for k, v in stats.items() if k.startswith("pd_")})
    report.update(
        requests=len(requests),
        integrity_checked_pages=run.checked_pages,
        integrity_checked_units=run.checked_units,
        integrity_expected_units=run.expected_units,
        integrity_mismatches=run.mismatches,
        mismatch_examples=run.examples,
        rejected_requests=run.rejected,
        wall_s=round(wall, 3),
        l1_capacity_pages=stats["l1_capacity_pages"],
        l2_capacity_pages=stats["l2_capacity_pages"],
        l2_used_pages=stats["l2_capacity_pages"] - stats["l2_free_pages"],
        host_bytes=cache.host_pool.split.used_bytes,
        stats=stats,
        samples=samples,
        **_run_info(args, config, tpb),
    )
    report.update(run.extra)
    if args.plot and rank == 0 and config.cp_size == 1:
        from hicache_cp.harness.plot import plot_replay

        plot_replay(samples, args.plot)
    return report


def _start_metrics(args: argparse.Namespace, cache: HiCache, rank: int) -> Any:
    """The Prometheus endpoint of this rank, when `--metrics-port` asks for one."""
    if args.metrics_port is None:
        return None
    from hicache_cp.prometheus import start_exporter

    return start_exporter(cache, args.metrics_port + rank, args.metrics_addr)


def _sample(i: int, cache: HiCache) -> dict[str, Any]:
    s = cache.stats()
    return {
        "request": i,
        "hit_rate": s["hit_rate"],
        "l1_used_pages": s["l1_capacity_pages"] - s["l1_free_pages"],
        "l1_capacity": s["l1_capacity_pages"],
        "l2_used_pages": s["l2_capacity_pages"] - s["l2_free_pages"],
        "l2_capacity": s["l2_capacity_pages"],
    }


def _run_info(args: argparse.Namespace, config: Config, tpb: int) -> dict[str, Any]:
    return {
        "model": config.model,
        "policy": config.eviction_policy,
        "write_policy": config.write_policy.value,
        "cp_size": config.cp_size,
        "tokens_per_block": tpb,
        "page_size": config.page_size,
        "trace": str(args.trace) if args.trace else "embedded",
        "commit": git_commit(),
        "machine": machine(),
        "command": command_line("replay"),
    }
