"""One rank's replay: every request through a prefill engine and the cache.

The engine (`hicache_harness.engines`, `--engine`) serves the requests;
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
from hicache_harness import lifetime
from hicache_harness.engines import RunOptions, make_engine
from hicache_harness.engines.synthetic import RequestSink
from hicache_harness.provenance import command_line, git_commit, machine
from hicache_harness.replay.setup import tokens_per_block
from hicache_harness.trace import TraceRequest

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
    crash_at: int | None = None,
    report_from: int | None = None,
) -> dict[str, Any]:
    """Replay every request on this rank through the engine `--engine` names
    (the synthetic reference server by default); return this rank's report.

    `sink_factory` builds the request sink (the PD sender) once the cache and
    its pools exist; its `totals.as_dict()` joins the report. `device`: this
    rank's device (a CP rank's own GPU); default `--device`. `crash_at`: the
    request at which the process kills itself mid-backup (`--restart-at`).
    `report_from` (`--report-from K`): the report's `continuation` holds the
    hits of requests K.. of `requests` alone.
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
        publisher = _start_events(args, cache, rank)
        if publisher is not None:
            stops.callback(publisher.close)
        every = max(1, len(requests) // 200)
        before: dict[str, Any] = cache.stats() if report_from == 0 else {}

        def on_request(i: int) -> None:
            if publisher is not None:
                publisher.flush()  # this request's events, one batch
            lifetime.raise_if_interrupted()  # a signal whose exception was swallowed stops the run here
            if i % every == 0 or i == len(requests) - 1:
                samples.append(_sample(i, cache))
            if report_from is not None and i == report_from - 1:
                before.update(cache.stats())

        opts = RunOptions(tpb, sink, verify=not args.no_verify, progress=progress and rank == 0, on_request=on_request,
                          crash_at=crash_at)  # fmt: skip
        run = engine.run(cache, requests, opts)
        cache.drain()
        cache.check_invariants()
        stats = cache.stats()
        events = _events_report(publisher, cache) if publisher is not None else None
        pss = cache.host_pool.pss_bytes()  # while every rank still maps a shared segment:
        if cache.agreement.world_size > 1:
            cache.agreement.min_int(0)  # nobody closes before every rank measured
        if sink is not None:
            stats.update(sink.totals.as_dict())  # type: ignore[attr-defined]
    wall = time.perf_counter() - t0
    report = {k: stats[k] for k in REPORT_KEYS if k in stats}
    report.update({k: v for k, v in stats.items() if k.startswith(("pd_", "verified_", "verify_"))})
    report["integrity_dropped_pages"] = stats.get("integrity_dropped_pages", 0)
    report["loads_aborted"] = stats.get("loads_aborted", 0)
    report["verify_restores"] = config.verify_restores.value
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
        host_bytes=_host_bytes(cache, stats),
        host_pss_bytes=pss,
        stats=stats,
        samples=samples,
        **_run_info(args, config, tpb),
    )
    report.update(run.extra)
    if events is not None:
        events["fraction_of_wall"] = round(events["publish_s"] / max(wall, 1e-9), 5)
        report["kv_events"] = events
    if before:
        report["continuation"] = continuation(before, stats, report_from or 0)
    if args.plot and rank == 0 and config.cp_size == 1:
        from hicache_harness.plot import plot_replay

        plot_replay(samples, args.plot)
    return report


def _host_bytes(cache: HiCache, stats: dict[str, Any]) -> int:
    """This rank's host bytes for L2: its private pool, or its share of the node segment's copies."""
    if "node_copy_bytes" in stats:
        return int(stats["node_copy_bytes"]) * int(stats["node_copies"]) // int(stats["node_ranks"])
    return cache.host_pool.split.used_bytes


def continuation(before: dict[str, Any], after: dict[str, Any], start: int) -> dict[str, Any]:
    """The hits of the requests after a snapshot (`before`) to the end (`after`)."""
    diff = {k: int(after[k]) - int(before.get(k, 0))
            for k in ("requests", "prompt_tokens", "l1_hit_tokens", "l2_hit_tokens", "miss_tokens")}  # fmt: skip
    hits = diff["l1_hit_tokens"] + diff["l2_hit_tokens"]
    return {"from_request": start, **diff, "hit_rate": round(hits / diff["prompt_tokens"], 6) if diff["prompt_tokens"] else 0.0}


def _start_metrics(args: argparse.Namespace, cache: HiCache, rank: int) -> Any:
    """The Prometheus endpoint of this rank, when `--metrics-port` asks for one."""
    if args.metrics_port is None:
        return None
    from hicache_cp.prometheus import start_exporter

    return start_exporter(cache, args.metrics_port + rank, args.metrics_addr)


def _start_events(args: argparse.Namespace, cache: HiCache, rank: int) -> Any:
    """The KV event publisher, when `--kv-events` asks for one (rank 0: every CP rank's tree is the same)."""
    if getattr(args, "kv_events", None) is None or rank != 0:
        return None
    from hicache_cp.events import EventLog
    from hicache_harness.kv_events import KVEventPublisher, engine_format

    fmt = engine_format(args.kv_events_format or "sglang")
    log = EventLog(fmt.keyer)
    cache.attach_events(log)
    return KVEventPublisher(args.kv_events, fmt, log)


def _events_report(publisher: Any, cache: HiCache) -> dict[str, Any]:
    """What was published and what the cache holds at the end (per medium: blocks and a digest of
    their sorted wire keys, keyed from the tree: a subscriber's rebuilt sets must match)."""
    from hicache_harness.kv_events import digest, residency

    publisher.flush()
    held = residency(cache, publisher.fmt)
    return {
        "endpoint": publisher.endpoint, "format": publisher.fmt.name, "batches": publisher.stats.batches,
        "events": publisher.stats.events, "publish_s": round(publisher.stats.seconds + publisher.log.seconds, 4),
        "emit_s": round(publisher.log.seconds, 4), "encode_send_s": round(publisher.stats.seconds, 4),
        "resident": {m: {"blocks": len(keys), "digest": digest(keys)} for m, keys in held.items()},
    }  # fmt: skip


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
