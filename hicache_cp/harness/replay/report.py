"""The replay's report: bounds, the printed table and the JSON file."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from hicache_cp.config import Config
from hicache_cp.harness.replay.rank import REPORT_KEYS
from hicache_cp.harness.replay.setup import size, tokens_per_block
from hicache_cp.harness.trace import TraceRequest


def compute_bounds(requests: list[TraceRequest], config: Config, args: argparse.Namespace) -> dict[str, Any]:
    from hicache_cp.harness.bounds import belady_hit_rate, infinite_capacity_hit_rate

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


def integrity_failures(report: dict[str, Any]) -> list[str]:
    """Every reason this run's bytes cannot be trusted (exit code 1); [] when clean.

    Cache hits: mismatches, or byte checks that covered less than what was
    reused. PD: rooms that failed or mismatched, transfers the decode peer
    rejected."""
    out = []
    if report.get("integrity_mismatches"):
        out.append(f"{report['integrity_mismatches']} reused (page, part, layer) units differ from what prefill computed")
    checked, expected = report.get("integrity_checked_units"), report.get("integrity_expected_units")
    if report.get("verified", True) and checked is not None and checked != expected:
        out.append(f"byte checks covered {checked} of the {expected} reused (page, part, layer) units")
    if report.get("pd_failed_rooms"):
        out.append(f"{report['pd_failed_rooms']} of {report.get('pd_rooms')} PD rooms failed")
    if report.get("pd_mismatches"):
        out.append(f"{report['pd_mismatches']} PD pages differ at the decode peer")
    rejected = (report.get("pd") or {}).get("decode_rejected")
    if rejected:
        out.append(f"the decode peer rejected {rejected} transfers")
    return out


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
