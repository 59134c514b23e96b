#!/usr/bin/env python3
"""hicache-cp under SGLang 0.5.23 beside SGLang's own tree caches (hicache_harness.bench.sglang).

    .venv/bin/python bench/scripts/bench_sglang.py                       # shared trace + embedded workload
    .venv/bin/python bench/scripts/bench_sglang.py --limit 200 --json bench/results/sglang-side-by-side.json

Prints a Markdown table per workload and writes one JSON (commit, machine, command).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from hicache_harness.bench.sglang import side_by_side, table
from hicache_harness.outputs import write_json
from hicache_harness.provenance import git_commit, machine
from hicache_harness.trace import load_trace
from hicache_harness.workload import default_workload

SHARED_TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "synthetic_trace.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=SHARED_TRACE, help="a Mooncake-format trace (default: the shared one)")
    ap.add_argument("--limit", type=int, default=150, help="requests of each workload (default 150)")
    ap.add_argument("--tokens-per-block", type=int, default=64, help="tokens per trace block (default 64: one page)")
    ap.add_argument("--device-pages", type=int, default=256)
    ap.add_argument("--l2-pages", type=int, default=2048)
    ap.add_argument("--json", type=Path, default=Path("bench/results/sglang-side-by-side.json"))
    ap.add_argument("--tables", type=Path, metavar="JSON", help="print the tables of an existing result and exit")
    args = ap.parse_args()
    if args.tables is not None:
        import json

        for name, res in json.loads(args.tables.read_text())["workloads"].items():
            print(f"{name} ({res['backends'][0].get('requests', '?')} requests):\n\n{table(res)}\n")
        return 0
    logging.basicConfig(level=logging.ERROR)
    workloads = {"embedded": default_workload()[: args.limit]}
    if args.trace.exists():
        workloads["trace"] = load_trace(args.trace, limit=args.limit)
    else:
        print(f"note: {args.trace} not found; embedded workload only", file=sys.stderr)
    out = {"commit": git_commit(), "machine": machine(), "command": " ".join(["bench/scripts/bench_sglang.py", *sys.argv[1:]]),
           "sglang": "0.5.23", "workloads": {}}  # fmt: skip
    for name, reqs in workloads.items():
        print(f"-- {name}: {len(reqs)} requests", flush=True)
        res = side_by_side(reqs, tokens_per_block=args.tokens_per_block, device_pages=args.device_pages,
                           l2_pages=args.l2_pages)  # fmt: skip
        out["workloads"][name] = res
        print(table(res), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.json, out)
    print(f"wrote {args.json}")
    bad = sum(r.get("mismatched_bytes", 0) for w in out["workloads"].values() for r in w["backends"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
