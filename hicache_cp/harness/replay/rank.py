"""One rank's replay: every request through the reference server and the cache."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from hicache_cp.cache import HiCache
from hicache_cp.config import Config
from hicache_cp.cp.agreement import Agreement
from hicache_cp.harness.engines.synthetic import ReferenceServer, RequestSink
from hicache_cp.harness.provenance import command_line, git_commit, machine
from hicache_cp.harness.replay.setup import size, tokens_per_block
from hicache_cp.harness.trace import TraceRequest, request_tokens

REPORT_KEYS = (
    "requests", "prompt_tokens", "l1_hit_tokens", "l2_hit_tokens", "miss_tokens", "hit_rate",
    "bytes_d2h", "bytes_h2d", "backups_committed", "backups_aborted", "evictions_l1", "evictions_l2",
    "integrity_checked_pages", "integrity_checked_units", "integrity_expected_units", "integrity_mismatches",
    "wall_s",
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
) -> dict[str, Any]:
    """Replay every request on this rank; return this rank's report.

    `sink_factory` builds the request sink (the PD sender) once the cache and
    its pools exist; its `totals.as_dict()` joins the report.
    """
    device = _device(args.device)
    tpb = tokens_per_block(args, config)
    t0 = time.perf_counter()
    samples: list[dict[str, Any]] = []
    with HiCache(config, rank=rank, agreement=agreement, device=device) as cache:
        sink = sink_factory(cache) if sink_factory is not None else None
        server = ReferenceServer(cache, verify=not args.no_verify, sink=sink)
        every = max(1, len(requests) // 200)
        for i, req in enumerate(_progress(requests, progress and rank == 0)):
            server.serve(req.index, request_tokens(req, tpb))
            if i % every == 0 or i == len(requests) - 1:
                samples.append(_sample(i, cache))
        cache.drain()
        cache.check_invariants()
        stats = cache.stats()
        if sink is not None:
            stats.update(sink.totals.as_dict())  # type: ignore[attr-defined]
            sink.close()  # type: ignore[attr-defined]
    wall = time.perf_counter() - t0
    report = {k: stats[k] for k in REPORT_KEYS if k in stats}
    report.update({k: v for k, v in stats.items() if k.startswith("pd_")})
    report.update(
        requests=len(requests),
        integrity_checked_pages=server.integrity.checked_pages,
        integrity_checked_units=server.integrity.checked_units,
        integrity_expected_units=server.integrity.expected_units,
        integrity_mismatches=server.integrity.mismatches,
        mismatch_examples=[str(m) for m in server.integrity.examples[:10]],
        rejected_requests=server.rejected,
        wall_s=round(wall, 3),
        l1_capacity_pages=stats["l1_capacity_pages"],
        l2_capacity_pages=stats["l2_capacity_pages"],
        l2_used_pages=stats["l2_capacity_pages"] - stats["l2_free_pages"],
        host_bytes=cache.host_pool.split.used_bytes,
        stats=stats,
        samples=samples,
        **_run_info(args, config, requests, tpb),
    )
    if args.plot and rank == 0 and args.cp_size == 1:
        from hicache_cp.harness.plot import plot_replay

        plot_replay(samples, args.plot)
    return report


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


def _progress(requests: list[TraceRequest], show: bool) -> Any:
    if not show:
        return requests
    from tqdm import tqdm

    return tqdm(requests, desc="replay", unit="req", mininterval=1.0, file=sys.stderr)


def _device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _run_info(args: argparse.Namespace, config: Config, requests: list[TraceRequest], tpb: int) -> dict[str, Any]:
    sizing = size(args, config, requests)
    return {
        "model": config.model,
        "policy": config.eviction_policy,
        "write_policy": config.write_policy.value,
        "cp_size": config.cp_size,
        "tokens_per_block": tpb,
        "page_size": config.page_size,
        "footprint_pages": sizing.footprint_pages,
        "l1_logical_pages": sizing.l1_logical_pages,
        "l2_logical_pages": sizing.l2_logical_pages,
        "trace": str(args.trace) if args.trace else "embedded",
        "commit": git_commit(),
        "machine": machine(),
        "command": command_line("replay"),
    }
