"""`hicache-cp replay`: the main job.

Replays a Mooncake-format trace (or the embedded default workload) through
the reference prefill server with hicache-cp as its L2, verifies every
reused byte, and reports hit rates per tier, bytes moved and integrity:

    hicache-cp replay                                   # embedded workload, tiny model
    hicache-cp replay --trace t.jsonl --l2-fraction 0.1 --json out.json --bounds

Sizing: one trace block (512 tokens) becomes `--tokens-per-block` tokens
(default: one page of the model's page size), so a whole trace replays on a
CPU in minutes. `--l2-fraction F` sizes L2 to F times the trace's
unique-block footprint; `--l1-pages` is the logical L1 capacity. With
`--cp-size N` both are logical and split over N rank processes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

from hicache_cp.agreement import Agreement
from hicache_cp.cache import HiCache
from hicache_cp.config import PRESETS, Config
from hicache_cp.errors import HiCacheError
from hicache_cp.policy import policy_names
from hicache_cp.server import ReferenceServer, RequestSink
from hicache_cp.trace import TraceError, TraceRequest, load_trace, request_tokens, unique_blocks
from hostmem.provenance import command_line, git_commit, machine
from hicache_cp.workload import default_workload

logger = logging.getLogger(__name__)

REPORT_KEYS = (
    "requests", "prompt_tokens", "l1_hit_tokens", "l2_hit_tokens", "miss_tokens", "hit_rate",
    "bytes_d2h", "bytes_h2d", "backups_committed", "backups_aborted", "evictions_l1", "evictions_l2",
    "integrity_checked_pages", "integrity_mismatches", "wall_s",
)  # fmt: skip


EMBEDDED_L2_FRACTION = 0.5  # the embedded workload is small: give L2 room to matter
L2_TO_L1 = 8  # default L1 = L2 / 8


class InputError(HiCacheError):
    """Bad command-line input: reported as one line, exit code 2."""


@dataclass(frozen=True)
class Sizing:
    """Logical capacities of the run and what they became per rank."""

    footprint_pages: int
    l1_logical_pages: int
    l2_logical_pages: int
    l1_physical_pages: int  # per rank, dummy page included
    host_budget_bytes: int  # per rank


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, help="Mooncake-format JSONL trace (default: the embedded workload)")
    p.add_argument("--model", choices=sorted(PRESETS), help="model preset (default: tiny)")
    p.add_argument("--config", type=Path, help="TOML config file (see hicache_cp.config)")
    p.add_argument("--l1-pages", type=int, help="logical L1 capacity in pages (default: L2 / 8, at least 3 requests)")
    l2 = p.add_mutually_exclusive_group()
    l2.add_argument("--l2-gib", type=float, help="host budget per rank in GiB")
    l2.add_argument(
        "--l2-fraction",
        type=float,
        help="L2 as a fraction of the unique-block footprint (default 0.1 for a trace, 0.5 for the embedded workload)",
    )
    p.add_argument("--tokens-per-block", type=int, help="tokens per 512-token trace block (default: one page)")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--policy", choices=policy_names(), help="eviction policy (default lru)")
    p.add_argument("--write-policy", choices=["write_through", "write_through_selective", "write_back"])
    p.add_argument("--io-backend", help="io backend (default auto)")
    p.add_argument("--cp-size", type=int, default=1, help="context-parallel ranks, one process each")
    p.add_argument("--pd", action="store_true", help="ship every request's KV to a decode peer process")
    p.add_argument("--bounds", action="store_true", help="also compute the infinite-capacity and Belady bounds")
    p.add_argument("--no-verify", action="store_true", help="skip the byte-for-byte integrity check")
    p.add_argument("--seed", type=int, default=0, help="seed of the embedded workload")
    p.add_argument("--json", type=Path, help="write the report as JSON here")
    p.add_argument("--plot", type=Path, help="write a PNG of hit rate and occupancy here")
    p.add_argument("--device", default="auto", help="L1 device: cpu, cuda or auto")


def run(args: argparse.Namespace) -> int:
    try:
        report = replay(args)
    except (InputError, TraceError, ValueError) as exc:
        print(f"hicache-cp replay: error: {exc}", file=sys.stderr)
        return 2
    print_table(report)
    if args.json:
        write_json(args.json, report)
    return 1 if report["integrity_mismatches"] else 0


def replay(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole replay described by `args`; return the report dict."""
    _check_args(args)
    requests = load_requests(args)
    config = build_config(args, requests)
    if args.cp_size > 1 or args.pd:
        from hicache_cp.launch import run_ranks  # multi-process: CP ranks and/or the decode peer

        report = run_ranks(args, config, requests)
    else:
        report = replay_rank(args, config, requests)
    if args.bounds:
        report["bounds"] = compute_bounds(requests, config, args)
    return report


def _check_args(args: argparse.Namespace) -> None:
    for name in ("l1_pages", "tokens_per_block", "limit", "l2_gib", "l2_fraction"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise InputError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.l2_fraction is not None and args.l2_fraction > 1:
        raise InputError(f"--l2-fraction must be in (0, 1], got {args.l2_fraction}")
    if args.cp_size < 1:
        raise InputError(f"--cp-size must be >= 1, got {args.cp_size}")
    if args.trace is not None and not args.trace.is_file():
        raise InputError(f"--trace {args.trace}: no such file")


def load_requests(args: argparse.Namespace) -> list[TraceRequest]:
    if args.trace is None:
        requests = default_workload(seed=args.seed)
        return requests[: args.limit] if args.limit else requests
    return load_trace(args.trace, limit=args.limit)


def tokens_per_block(args: argparse.Namespace, config: Config) -> int:
    return args.tokens_per_block or config.page_size


def size(args: argparse.Namespace, config: Config, requests: list[TraceRequest]) -> Sizing:
    """Turn the CLI's logical capacities into per-rank pool sizes.

    Depends on the config's layout and page size only, so the config that
    `build_config` returns gives the same sizing again."""
    layout = config.layout()
    tpb = tokens_per_block(args, config)
    pages_per_block = max(1, tpb // config.page_size)
    footprint = max(1, unique_blocks(requests) * pages_per_block)
    longest = max((len(r.hash_ids) for r in requests), default=1) * math.ceil(tpb / config.page_size)
    cp = args.cp_size
    if args.l2_gib is not None:
        budget = int(args.l2_gib * 2**30)
        l2 = (budget // layout.bytes_per_page - 1) * cp
    else:
        fraction = args.l2_fraction or (0.1 if args.trace else EMBEDDED_L2_FRACTION)
        l2 = max(1, math.ceil(fraction * footprint))
        budget = (math.ceil(l2 / cp) + 1) * layout.bytes_per_page
    # L2 is typically 5-20x L1 (DOMAIN.md); L1 must still hold a few requests.
    l1 = args.l1_pages or max(l2 // L2_TO_L1, 3 * longest)
    if l1 < longest + cp:
        raise InputError(f"--l1-pages {l1} cannot hold the longest request ({longest} pages)")
    return Sizing(footprint, l1, l2, math.ceil(l1 / cp) + 1, budget)


def build_config(args: argparse.Namespace, requests: list[TraceRequest]) -> Config:
    overrides: dict[str, Any] = {
        "model": args.model,
        "eviction_policy": args.policy,
        "write_policy": args.write_policy,
        "io_backend": args.io_backend,
        "cp_size": args.cp_size,
    }
    base = Config.load(args.config, overrides={k: v for k, v in overrides.items() if v is not None})
    sizing = size(args, base, requests)
    config = Config.from_dict(
        {**base.to_dict(), "l1_pages": sizing.l1_physical_pages, "host_budget_bytes": sizing.host_budget_bytes}
    )
    return config


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
        from hicache_cp.plot import plot_replay

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


def compute_bounds(requests: list[TraceRequest], config: Config, args: argparse.Namespace) -> dict[str, Any]:
    from hicache_cp.bounds import belady_hit_rate, infinite_capacity_hit_rate

    pages_per_block = max(1, tokens_per_block(args, config) // config.page_size)
    capacity_blocks = max(1, size(args, config, requests).l2_logical_pages // pages_per_block)
    inf = infinite_capacity_hit_rate(requests)
    bel = belady_hit_rate(requests, capacity_blocks)
    return {
        "infinite_capacity_hit_rate": inf.hit_rate,
        "belady_hit_rate": bel.hit_rate,
        "belady_capacity_blocks": capacity_blocks,
        "note": "block-level bounds over full blocks; the replay's hit_rate also counts partial tail tokens as misses",
    }


def print_table(report: dict[str, Any]) -> None:
    rows = [(k, report[k]) for k in REPORT_KEYS if k in report]
    rows += [(k, report[k]) for k in ("rejected_requests", "l2_used_pages", "l2_capacity_pages") if k in report]
    rows += [(k, v) for k, v in report.items() if k.startswith("pd_") and not isinstance(v, list)]
    for k in ("pd", "bounds", "per_rank"):
        if k in report:
            rows.append((k, json.dumps(report[k]) if not isinstance(report[k], list) else ""))
    if "per_rank" in report:
        rows += [(f"  rank {r['rank']} host", f"{r['l2_used_pages']}/{r['l2_capacity_pages']} pages, "
                  f"{r['host_bytes'] / 2**20:.1f} MiB") for r in report["per_rank"]]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        v = f"{v:.4f}" if isinstance(v, float) else v
        print(f"{k:<{width}}  {v}")
    for m in report.get("mismatch_examples", []):
        print(f"mismatch: {m}")


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Write atomically: a reader never sees a half-written report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(report, f, indent=2, default=str)
    os.replace(tmp, path)
