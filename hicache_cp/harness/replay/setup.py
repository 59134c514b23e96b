"""What a replay runs on: its requests, its sizing and its configuration.

Sizing: one trace block (512 tokens) becomes `--tokens-per-block` tokens
(default: one page of the model's page size), so a whole trace replays on a
CPU in minutes. `--l2-fraction F` sizes L2 to F times the trace's
unique-block footprint; `--l1-pages` is the logical L1 capacity. With
`--cp-size N` both are logical and split over N rank processes.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from hicache_cp.config import Config
from hicache_cp.harness.errors import InputError
from hicache_cp.harness.trace import TraceRequest, load_trace, unique_blocks
from hicache_cp.harness.workload import default_workload

EMBEDDED_L2_FRACTION = 0.5  # the embedded workload is small: give L2 room to matter
L2_TO_L1 = 8  # default L1 = L2 / 8


@dataclass(frozen=True)
class Sizing:
    """Logical capacities of the run and what they became per rank."""

    footprint_pages: int
    l1_logical_pages: int
    l2_logical_pages: int
    l1_physical_pages: int  # per rank, dummy page included
    host_budget_bytes: int  # per rank


def check_args(args: argparse.Namespace) -> None:
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
    return Config.from_dict(
        {**base.to_dict(), "l1_pages": sizing.l1_physical_pages, "host_budget_bytes": sizing.host_budget_bytes}
    )
